"""cute_flash behind SDPA's flash backend (cute_flash.sdpa): which calls it serves (CPU), and
on the GPU that SDPA with the backend active equals cute_flash called directly (bitwise) and
the reference, forward and gradients, eager and compiled, and that everything else falls back
to PyTorch's own kernel unchanged."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import cute_flash
from cute_flash import sdpa
from cute_flash.reference import attention_reference, packed_attention_reference

needs_registry = pytest.mark.skipif(not sdpa.registry_available(),
                                    reason=f"torch {torch.__version__} has no SDPA flash registry")


def meta(b, n, s, d, dtype=torch.float16):
    return torch.empty(b, n, s, d, dtype=dtype, device="meta")


@needs_registry
def test_importing_registers_but_does_not_activate():
    import torch.nn.attention as attention

    assert sdpa.NAME in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != sdpa.NAME


@pytest.mark.parametrize("args, reason", [
    ((meta(1, 2, 8, 64),) * 3 + (0.1, False, False), "dropout"),
    ((meta(1, 2, 8, 64),) * 3 + (0.0, False, True), "debug_mask"),
    ((meta(1, 2, 8, 100),) * 3 + (0.0, False, False), "head dims"),
    ((meta(1, 2, 8, 264),) * 3 + (0.0, False, False), "head dims"),
    ((meta(1, 2, 8, 64), meta(1, 2, 8, 64), meta(1, 2, 8, 128), 0.0, False, False), "head dims"),
    ((meta(1, 6, 8, 64), meta(1, 4, 8, 64), meta(1, 4, 8, 64), 0.0, False, False), "do not divide"),
    ((meta(1, 4, 8, 64), meta(1, 2, 8, 64), meta(1, 1, 8, 64), 0.0, False, False), "different head counts"),
    ((meta(1, 2, 8, 64, torch.float32),) * 3 + (0.0, False, False), "dtypes"),
    ((meta(1, 2, 8, 64),) * 3 + (0.0, False, False), "Hopper"),  # meta tensors: every other check passed
])
def test_what_is_not_served_says_why(args, reason):
    assert reason in sdpa.not_served_reason(*args)


@contextlib.contextmanager
def cute_flash_behind_sdpa():
    import torch.nn.attention as attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa.activate()
    try:
        # cuDNN comes first on the H100 (torch 2.11): choose the flash backend.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        if hasattr(attention, "restore_flash_attention_impl"):
            attention.restore_flash_attention_impl()


TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
GRAD_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def leaves(shape, dtype, bsnd=False):
    """Fresh random q, k, v requiring grad; bsnd: (B, N, S, D) views of (B, S, N, D) memory."""
    b, n, s, d = shape
    made = []
    for _ in range(3):
        if bsnd:
            made.append(torch.randn(b, s, n, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_())
        else:
            made.append(torch.randn(b, n, s, d, device="cuda", dtype=dtype).requires_grad_())
    return made


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen, bsnd", [(17, False), (1000, True)])
def test_sdpa_equals_cute_flash_and_the_reference(dtype, head_dim, causal, seqlen, bsnd):
    q, k, v = leaves((2, 3, seqlen, head_dim), dtype, bsnd)
    dout = torch.randn(2, 3, seqlen, head_dim, device="cuda", dtype=dtype)
    direct = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    # Deterministic mode: dQ's fp32 partial sums are otherwise added in a run-dependent order.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with cute_flash_behind_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            assert sdpa.last_decision == "ours"
            out.backward(dout)
            assert sdpa.last_decision == "ours"
        expect = cute_flash.flash_attention(*direct, causal=causal)
        expect.backward(dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out, expect)
    assert out.stride() == q.stride()  # empty_like(query), as the op's meta function says
    for got, want in zip((q, k, v), direct):
        assert torch.equal(got.grad, want.grad)
        assert got.grad.stride() == got.stride()
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*ref_leaves, causal=causal)
    ref.backward(dout.double())
    assert rel_err(out, ref) < TOLERANCE[dtype]
    for got, want in zip((q, k, v), ref_leaves):
        assert rel_err(got.grad, want.grad) < GRAD_TOLERANCE[dtype]


def torch_flash(q, k, v, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.gpu
@needs_registry
def test_what_cute_flash_cannot_serve_runs_torch_s_kernel_unchanged():
    # Dropout. (Every head dim torch's flash kernel takes reaches its op as a multiple of 8 up
    # to 256, which cute_flash serves: the head-dim case that was here, D = 160, now runs ours.)
    dtype = torch.bfloat16
    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=dtype)
    k = v = torch.randn(1, 4, 128, 64, device="cuda", dtype=dtype)
    kwargs = dict(dropout_p=0.5)
    torch.manual_seed(0)  # the same seed gives torch's kernel the same mask
    expect = torch_flash(q, k, v, **kwargs)
    with cute_flash_behind_sdpa():
        torch.manual_seed(0)
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert sdpa.last_decision != "ours"
    assert torch.equal(out, expect)


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_sdpa_decode_steps_with_few_units_split_their_keys(kv_heads):
    """One query row over 9000 keys at B = 1 (8 or 2 key/value heads for 132 SMs), as a
    decode step calls SDPA (not causal: torch's flash route refuses is_causal with grouped
    heads here): without gradients the served call splits its keys across CTAs
    (api._split_parts) and merges; with gradients the same signature runs the whole step and
    its backward. Both against float64."""
    causal = False
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, 9000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kwargs = dict(is_causal=causal, enable_gqa=kv_heads < 8)
    with cute_flash_behind_sdpa():
        with torch.no_grad():
            split = F.scaled_dot_product_attention(q, k, v, **kwargs)
        assert sdpa.last_decision == "ours"
        tensors = [t.clone().requires_grad_() for t in (q, k, v)]
        whole = F.scaled_dot_product_attention(*tensors, **kwargs)
        dout = torch.randn_like(whole)
        grads = torch.autograd.grad(whole, tensors, dout)
        assert sdpa.last_decision == "ours"
    assert any(plan.splits > 1 for plan in cute_flash.api._plans.values()), "the split plan ran"
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*ref_leaves, causal=causal, alignment="bottom_right")
    ref.backward(dout.double())
    assert split.stride() == whole.stride() and torch.isfinite(split).all()
    assert rel_err(split, ref) < TOLERANCE[torch.bfloat16] and rel_err(whole, ref) < TOLERANCE[torch.bfloat16]
    for got, want in zip(grads, ref_leaves):
        assert rel_err(got, want.grad) < GRAD_TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_serves_grouped_query_attention(causal):
    q, k, v = leaves((2, 8, 300, 64), torch.bfloat16)
    k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    expect = torch_flash(q, k, v, is_causal=causal, enable_gqa=True)
    grads = torch.autograd.grad(expect.float().square().sum(), (q, k, v))
    with cute_flash_behind_sdpa():
        sdpa.last_decision = None
        cute_flash.api._plans.clear()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ours = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert sdpa.last_decision == "ours"
    # Causal: the forward ran each group as its tiles' rows (api._heads_in_rows).
    assert any(plan.problem.row_heads == 4 for plan in cute_flash.api._plans.values()) == causal
    torch.testing.assert_close(out, expect, atol=2e-2, rtol=2e-2)
    for a, b in zip(ours, grads):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_sdpa_runs_cute_flash(causal):
    torch._dynamo.reset()
    q, k, v = leaves((2, 4, 333, 128), torch.bfloat16, bsnd=True)
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).float().square().sum()

    compiled = torch.compile(attend, fullgraph=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with cute_flash_behind_sdpa():
            sdpa.last_decision = None
            compiled(q, k, v).backward()
            assert sdpa.last_decision == "ours"
        cute = cute_flash.flash_attention(*eager, causal=causal).float().square().sum()
        cute.backward()
    finally:
        torch.use_deterministic_algorithms(False)
    for got, want in zip((q, k, v), eager):
        torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0)


# Ragged calls (aten::_flash_attention_forward / _backward with cumulative lengths): what torch's
# varlen_attn and nested-tensor SDPA run.

def meta3(total, n, d, dtype=torch.float16):
    return torch.empty(total, n, d, dtype=dtype, device="meta")


CU = torch.empty(3, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("args, options, reason", [
    ((meta3(9, 2, 64),) * 3 + (None, None, 0.0, False), {}, "dense call"),
    ((meta3(9, 2, 64),) * 3 + (CU, CU, 0.1, False), {}, "dropout"),
    ((meta3(9, 2, 64),) * 3 + (CU, CU, 0.0, True), {}, "debug_mask"),
    ((meta3(9, 2, 64),) * 3 + (CU, CU, 0.0, False), {"alibi_slopes": CU}, "ALiBi"),
    ((meta3(9, 2, 64),) * 3 + (CU, CU, 0.0, False), {"block_table": CU}, "block_table"),
    ((meta3(9, 2, 64),) * 3 + (CU, CU, 0.0, False), {"new_option": 1}, "new_option"),
    ((meta(1, 2, 8, 64),) * 3 + (CU, CU, 0.0, False), {}, "3-D"),
    ((meta3(9, 2, 100),) * 3 + (CU, CU, 0.0, False), {}, "head dims"),
    ((meta3(9, 2, 64, torch.float32),) * 3 + (CU, CU, 0.0, False), {}, "dtypes"),
    ((meta3(9, 6, 64), meta3(9, 4, 64), meta3(9, 4, 64), CU, CU, 0.0, False), {}, "do not divide"),
    ((meta3(9, 4, 64), meta3(9, 2, 64), meta3(8, 2, 64), CU, CU, 0.0, False), {}, "different lengths"),
    ((meta3(9, 2, 64),) * 3 + (CU, CU, 0.0, False), {"num_splits": 4, "window_size_left": 3}, "Hopper"),
])
def test_what_ragged_call_is_not_served_says_why(args, options, reason):
    assert reason in sdpa.ragged_not_served_reason(*args, options)


def ragged_leaves(lens_q, lens_k, heads, kv_heads, head_dim, dtype):
    """Packed q (total_q, N, D), k, v (total_k, Nkv, D) requiring grad, and their int32
    offsets; q is a view of (N, total_q, D) memory (a layout the outputs must follow)."""
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
                  for lens in (lens_q, lens_k))
    q = torch.randn(heads, sum(lens_q), head_dim, device="cuda", dtype=dtype).transpose(0, 1).requires_grad_()
    k, v = (torch.randn(sum(lens_k), kv_heads, head_dim, device="cuda", dtype=dtype).requires_grad_()
            for _ in range(2))
    return q, k, v, cu_q, cu_k


def torch_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """torch.nn.attention.varlen.varlen_attn in either of its spellings of causal (2.11:
    is_causal; later: window_size=(-1, 0))."""
    import inspect

    from torch.nn.attention import varlen

    if "is_causal" in inspect.signature(varlen.varlen_attn).parameters:
        return varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal)
    return varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0) if causal else (-1, -1))


LENS_Q, LENS_K = [300, 0, 1, 17, 129, 1000], [300, 5, 0, 1000, 64, 129]  # Sq != Sk both ways, empty ones


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("causal", [False, True])
def test_torch_varlen_attn_runs_cute_flash(causal):
    pytest.importorskip("torch.nn.attention.varlen")
    dtype = torch.bfloat16
    q, k, v, cu_q, cu_k = ragged_leaves(LENS_Q, LENS_K, 4, 4, 128, dtype)
    direct = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, device="cuda", dtype=dtype)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with cute_flash_behind_sdpa():
            sdpa.last_decision = None
            out = torch_varlen_attn(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal)
            assert sdpa.last_decision == "ours"
            sdpa.last_decision = None
            out.backward(dout)
            assert sdpa.last_decision == "ours"
        expect = cute_flash.flash_attn_varlen_func(*direct, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal)
        expect.backward(dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out, expect)
    for got, want in zip((q, k, v), direct):
        assert torch.equal(got.grad, want.grad)
    ref, _ = packed_attention_reference(
        *(t.detach().double() for t in (q, k, v)), cu_q, cu_k, causal=causal, alignment="bottom_right")
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.gpu
@needs_registry
def test_the_ragged_op_serves_gqa_windows_and_seqused_k_in_the_query_s_layout():
    dtype = torch.float16
    q, k, v, cu_q, cu_k = (t.detach() if t.is_floating_point() else t
                           for t in ragged_leaves(LENS_Q, LENS_K, 8, 2, 64, dtype))
    used = torch.tensor([250, 5, 0, 17, 64, 100], dtype=torch.int32, device="cuda")
    args = (q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.0, False, False)
    options = dict(scale=0.3, window_size_left=40, window_size_right=7, seqused_k=used)
    with cute_flash_behind_sdpa():
        sdpa.last_decision = None
        out, lse, *_ = torch.ops.aten._flash_attention_forward(*args, **options)
        assert sdpa.last_decision == "ours"
    assert out.stride() == q.stride()  # empty_like(query), as the op's meta function says
    expect, expect_lse = cute_flash.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), softmax_scale=0.3, window_size=(40, 7),
        alignment="bottom_right", seqused_k=used, return_lse=True)
    assert torch.equal(out, expect) and torch.equal(lse, expect_lse)
    ref, _ = packed_attention_reference(
        q.double(), k.double(), v.double(), cu_q, cu_k, seqused_k=used, softmax_scale=0.3, window_size=(40, 7),
        alignment="bottom_right")
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.gpu
@needs_registry
def test_a_ragged_call_cute_flash_cannot_serve_runs_torch_s_kernel_unchanged():
    q, k, v, cu_q, cu_k = (t.detach() if t.is_floating_point() else t
                           for t in ragged_leaves([100, 28], [60, 90], 2, 2, 64, torch.bfloat16))
    args = (q, k, v, cu_q, cu_k, 100, 90, 0.5, False, False)  # dropout
    torch.manual_seed(0)
    expect = torch.ops.aten._flash_attention_forward(*args)[0]
    with cute_flash_behind_sdpa():
        torch.manual_seed(0)
        out = torch.ops.aten._flash_attention_forward(*args)[0]
        assert "dropout" in sdpa.last_decision
    assert torch.equal(out, expect)


@pytest.mark.gpu
@needs_registry
def test_nested_tensor_sdpa_runs_cute_flash():
    lengths = [130, 1, 77]
    parts = [[torch.randn(s, 4, 64, device="cuda", dtype=torch.bfloat16) for s in lengths] for _ in range(3)]
    q, k, v = (torch.nested.nested_tensor(p, layout=torch.jagged).transpose(1, 2) for p in parts)
    with cute_flash_behind_sdpa():
        sdpa.last_decision = None
        out = F.scaled_dot_product_attention(q, k, v)
        assert sdpa.last_decision == "ours"
    for got, qs, ks, vs in zip(out.transpose(1, 2).unbind(), *parts):
        expect = cute_flash.flash_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)))
        torch.testing.assert_close(got, expect[0].transpose(0, 1), atol=0, rtol=0)
