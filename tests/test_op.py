"""The torch custom op without a GPU: its fake implementation under meta tensors and
torch.compile, and its refusal to run on the CPU."""

import pytest
import torch

import cute_flash  # noqa: F401  (registers torch.ops.cute_flash)


def meta_qkv(b=2, n=3, sq=17, sk=40, d=128, dtype=torch.float16):
    return tuple(torch.empty(b, n, s, d, device="meta", dtype=dtype) for s in (sq, sk, sk))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_shapes_on_meta(dtype):
    q, k, v = meta_qkv(dtype=dtype)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 3, 17, 128) and out.dtype == dtype and out.device.type == "meta"
    assert lse.shape == (2, 3, 17) and lse.dtype == torch.float32


def test_empty_sequence_gives_empty_output_on_meta():
    out = cute_flash.flash_attention(*meta_qkv(sq=0, sk=5))
    assert out.shape == (2, 3, 0, 128)


def test_torch_compile_fullgraph_traces_through_the_op():
    def block(q, k, v):
        out, lse = cute_flash.flash_attention(q * 2, k, v, causal=True, return_lse=True)
        return out.sum(dim=-1), lse + 1

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    summed, lse = compiled(*meta_qkv(b=1, n=2, sq=33, sk=33, d=64))
    assert summed.shape == (1, 2, 33) and summed.dtype == torch.float16
    assert lse.shape == (1, 2, 33) and lse.dtype == torch.float32


def test_op_is_registered_with_the_dispatcher():
    q, k, v = meta_qkv()
    out, lse = torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, 0.125)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    torch.library.opcheck(torch.ops.cute_flash.flash_attention_fwd.default, (q, k, v, False, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def _variant_qkv(requires_grad=False):
    """Grouped heads (6 query heads, 2 key/value heads), Sq != Sk and a value head dim of its
    own (192, 128), with a sink: every argument the schemas carry beyond plain attention."""
    q = torch.empty(2, 6, 17, 192, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 40, 192, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 2, 40, 128, device="meta", dtype=torch.bfloat16)
    sink = torch.empty(6, device="meta", dtype=torch.float32)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, sink)]


# (causal, softmax_scale, window_left, window_right, bottom_right, softcap): the schemas' primitives.
VARIANT_PRIMITIVES = [(True, 0.07, 16, 0, True, 30.0), (False, 0.1, 8, 4, False, 0.0)]


@pytest.mark.parametrize("primitives", VARIANT_PRIMITIVES, ids=["causal-window-softcap", "two-sided-window"])
def test_variant_ops_fakes_and_schemas(primitives):
    q, k, v, sink = _variant_qkv()
    args = (q, k, v, *primitives, sink, False)
    out, lse = torch.ops.cute_flash.flash_attention_fwd(*args)
    assert out.shape == (2, 6, 17, 128) and lse.shape == (2, 6, 17)
    torch.library.opcheck(torch.ops.cute_flash.flash_attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    backward_args = (torch.empty_like(out), torch.empty_like(lse), q, k, v, out, lse, *primitives, sink, True)
    dq, dk, dv, dsink = torch.ops.cute_flash.flash_attention_bwd(*backward_args)
    assert (dq.shape, dk.shape, dv.shape, dsink.shape) == (q.shape, k.shape, v.shape, (6,))
    assert dsink.dtype == torch.float32 and dv.dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.cute_flash.flash_attention_bwd.default, backward_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_variants_trace_through_autograd_and_torch_compile_on_meta():
    """Every variant argument reaches the ops (not a plain-attention shortcut), gradients
    included: the sink's, in its own dtype; compiled whole (fullgraph) as well."""
    q, k, v, sink = _variant_qkv(requires_grad=True)
    kwargs = dict(causal=True, window_size=(16, 0), alignment="bottom_right", softcap=30.0, return_lse=True)
    out, lse = cute_flash.flash_attention(q, k, v, sink=sink, **kwargs)
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v, sink):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device.type == "meta"

    def block(q, k, v, sink):
        out, lse = cute_flash.flash_attention(q, k, v, sink=sink, **kwargs)
        return out.sum(dim=-1), lse * 2

    summed, lse = torch.compile(block, fullgraph=True, backend="aot_eager")(*(t.detach() for t in (q, k, v, sink)))
    assert summed.shape == (2, 6, 17) and lse.shape == (2, 6, 17)


def test_op_refuses_cpu_tensors_instead_of_falling_back():
    q, k, v = (torch.randn(1, 1, 4, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="CUDA tensors"):
        torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, 0.125)


def test_autograd_traces_through_both_ops_on_meta():
    q, k, v = (t.requires_grad_() for t in meta_qkv(b=1, n=2, sq=33, sk=50, d=64))
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device.type == "meta"


def test_backward_op_fake_and_schema():
    q, k, v = meta_qkv()
    out, lse = torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, 0.125)
    args = (torch.empty_like(out), None, q, k, v, out, lse, False, 0.125)
    dq, dk, dv, dsink = torch.ops.cute_flash.flash_attention_bwd(*args)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dsink.numel() == 0
    torch.library.opcheck(torch.ops.cute_flash.flash_attention_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_backward_op_refuses_cpu_tensors():
    q, k, v = (torch.randn(1, 1, 4, 64, dtype=torch.float16) for _ in range(3))
    lse = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="CUDA tensors"):
        torch.ops.cute_flash.flash_attention_bwd(q, None, q, k, v, q, lse, False, 0.125)


def _cpu_kernels(monkeypatch):
    """Stand-ins for the CUDA launches that compute on the CPU but allocate their outputs as
    the real ones do (launch_bwd.new_gradients), so that torch.compile's stride checks of the
    real outputs against the fake ones run without a GPU."""
    from cute_flash import launch_bwd, launch_fwd, op, reference
    from cute_flash.kernels.problem import AttentionProblem

    def forward(q, k, v, problem, scale, sink=None):
        assert isinstance(problem, AttentionProblem)  # the op builds it from its schema's bool
        out, lse = reference.attention_reference(q, k, v, problem.causal, scale, dtype=torch.float32)
        batch, heads, seqlen_q, _ = q.shape
        o = torch.empty((batch, heads, seqlen_q, v.shape[-1]), dtype=q.dtype)
        return o.copy_(out), lse.float().contiguous()

    def backward(q, k, v, out, dout, lse, problem, scale, sink=None, dlse=None, deterministic=False):
        # Written out: a custom op's implementation runs below autograd.
        assert isinstance(problem, AttentionProblem)
        q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
        scores = (q64 @ k64.transpose(-1, -2)) * scale
        if problem.causal:
            scores = scores.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2]), float("-inf"))
        probs = scores.softmax(dim=-1)
        dp = do64 @ v64.transpose(-1, -2)
        ds = probs * (dp - (dp * probs).sum(dim=-1, keepdim=True))
        computed = (ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, probs.transpose(-1, -2) @ do64)
        grads = launch_bwd.new_gradients(q, k, v)
        for g, c in zip(grads, computed):
            g.copy_(c)
        return (*grads, None)

    monkeypatch.setattr(op, "check_kernel_device", lambda t: None)
    monkeypatch.setattr(launch_fwd, "forward", forward)
    monkeypatch.setattr(launch_bwd, "backward_with_sink", backward)


def test_compiled_backward_on_strided_views_agrees_with_the_fake_strides(monkeypatch):
    # transformers hands attention (B, N, S, D) views of (B, S, N, D) memory; the compiled
    # backward once failed on them because the fake backward promised gradients laid out like
    # the inputs while the real one returns contiguous ones (inductor's assert_size_stride).
    _cpu_kernels(monkeypatch)
    torch._dynamo.reset()
    # A cached compiled graph would not re-check the fake implementation.
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)

    def step(x, weight):
        # As in a transformers attention layer: q, k, v are (B, N, S, D) views of a projection's
        # (B, S, N, D) output, made inside the compiled graph.
        batch, seqlen, _ = x.shape
        q, k, v = (x @ weight).view(batch, seqlen, 3, 3, 64).unbind(2)
        out = cute_flash.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    x = torch.randn(2, 24, 96, dtype=torch.bfloat16)
    weight = torch.randn(96, 3 * 3 * 64, dtype=torch.bfloat16) / 10
    got = [t.clone().requires_grad_() for t in (x, weight)]
    compiled(*got).backward()
    want = [t.clone().requires_grad_() for t in (x, weight)]
    step(*want).backward()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.grad, w.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_attention_in_the_autocast_dtype(autocast_dtype):
    # Under autocast RoPE hands attention float32 q and k beside a 16-bit v (transformers).
    q, k = (torch.randn(2, 3, 77, 64, device="cuda", requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 77, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cuda", dtype=autocast_dtype):
        out = cute_flash.flash_attention(q, k, v, causal=True)
        op_out, _ = torch.ops.cute_flash.flash_attention_fwd(q, k, v, True, 0.125)
    expect = cute_flash.flash_attention(*(t.detach().to(autocast_dtype) for t in (q, k, v)), causal=True)
    assert out.dtype == op_out.dtype == autocast_dtype
    assert torch.equal(out, expect) and torch.equal(op_out, expect)
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    assert all(t.grad.isfinite().all() and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_backward_on_strided_views_on_the_gpu(causal):
    torch._dynamo.reset()

    def step(x, weight):
        batch, seqlen, _ = x.shape
        q, k, v = (x @ weight).view(batch, seqlen, 3, 4, 128).unbind(2)
        out = cute_flash.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return out.float().square().sum()

    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 3 * 4 * 128, device="cuda", dtype=torch.bfloat16) / 16
    got = [t.clone().requires_grad_() for t in (x, weight)]
    torch.compile(step, fullgraph=True)(*got).backward()
    want = [t.clone().requires_grad_() for t in (x, weight)]
    step(*want).backward()
    for g, w in zip(got, want):
        assert ((g.grad.float() - w.grad.float()).norm() / w.grad.float().norm()).item() < 2e-2
