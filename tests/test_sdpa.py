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
from cute_flash.reference import attention_reference

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
    ((meta(1, 2, 8, 160),) * 3 + (0.0, False, False), "head dims"),
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
@pytest.mark.parametrize("head_dim", [64, 128])
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
@pytest.mark.parametrize("case", ["head_dim_160", "dropout"])
def test_what_cute_flash_cannot_serve_runs_torch_s_kernel_unchanged(case):
    dtype = torch.bfloat16
    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=dtype)
    k = v = torch.randn(1, 4, 128, 64, device="cuda", dtype=dtype)
    kwargs = {}
    if case == "head_dim_160":
        q, k = (torch.randn(1, 4, 128, 160, device="cuda", dtype=dtype) for _ in range(2))
        v = k
    if case == "dropout":
        kwargs = dict(dropout_p=0.5)
    torch.manual_seed(0)  # dropout: the same seed gives torch's kernel the same mask
    expect = torch_flash(q, k, v, **kwargs)
    with cute_flash_behind_sdpa():
        torch.manual_seed(0)
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert sdpa.last_decision != "ours"
    assert torch.equal(out, expect)


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
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ours = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert sdpa.last_decision == "ours"
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
