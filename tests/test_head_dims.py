"""Head dims beyond the first native tiles (cute_flash.head_dims), on the GPU: every D up to
256 runs forward on the next native tile (16, 32, 64, 96, 128, 192, 256) and backward on the
next backward tile (16, 32, 64, 128, 192, 256: above 128 the warpgroups split dK and dV along
D) -- TMA's zero fill where rows are 16-byte multiples, a padded copy where they are not -- and
the padding never shows in outputs or gradients. v may have a head dim of its own (the pair
on the tile serving the wider).
`python tests/test_head_dims.py --prewarm` compiles the wide backward kernels in parallel.

Fresh random inputs per case, outputs and gradients poisoned with NaN where the test owns
them, every element compared with a float64 reference."""

import dataclasses
import math
import sys

import pytest
import torch

from cute_flash.torch_helpers import DENSE_BATCH

import cute_flash
from cute_flash import launch_bwd, launch_fwd
from cute_flash.config import get_config
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.reference import attention_reference
from test_kernel_bwd import assert_grad_close, gradient_magnitudes, make_inputs, reference_grads
from test_kernel_fwd import LSE_TOLERANCE, TOLERANCE, rel_err

pytestmark = pytest.mark.gpu

FP16, BF16 = torch.float16, torch.bfloat16


def forward_poisoned(q, k, v, causal, scale):
    """The compiled forward of q's and v's head dims (multiples of 8) on the tiles serving them
    (launch_fwd.kernel_for), on NaN-filled outputs."""
    head_dim, value_head_dim = q.shape[-1], v.shape[-1]
    kernel = launch_fwd.kernel_for(q.dtype, head_dim, AttentionProblem.of(causal), q.device, None, value_head_dim)
    out = torch.full((*q.shape[:3], value_head_dim), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    kernel(q, k, v, out, lse, None, *DENSE_BATCH, scale)
    torch.cuda.synchronize()
    return out, lse


def check_forward(out, lse, q, k, v, causal, scale):
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, dtype=torch.float64)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "non-finite (or unwritten) elements"
    assert rel_err(out, ref) < TOLERANCE[q.dtype]
    assert (out.double() - ref).abs().max().item() < 20 * TOLERANCE[q.dtype]
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOLERANCE


@pytest.mark.parametrize("head_dim, dtype", [(8, FP16), (16, BF16), (24, FP16), (40, BF16), (72, FP16),
                                             (80, FP16), (96, BF16), (112, FP16), (136, FP16), (160, BF16),
                                             (192, FP16), (200, BF16), (256, FP16), (256, BF16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (17, 300), (300, 17)])
def test_forward_on_a_wider_or_native_tile(head_dim, dtype, causal, sq, sk):
    q, k, v = make_inputs(2, 3, sq, sk, head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, lse = forward_poisoned(q, k, v, causal, scale)
    check_forward(out, lse, q, k, v, causal, scale)


@pytest.mark.parametrize("head_dim, dtype", [(1, FP16), (3, BF16), (20, FP16), (77, BF16), (127, FP16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unaligned_head_dims_through_the_public_api(head_dim, dtype, causal):
    """Rows that are not a multiple of 16 bytes: flash_attention pads a copy; out and LSE are
    the unpadded problem's, with the default scale of the real D."""
    q, k, v = make_inputs(1, 2, 257, 190, head_dim, dtype)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_forward(out, lse, q, k, v, causal, 1 / math.sqrt(head_dim))


# Above 128: the split-head-dim tiles (192, 256) natively and under narrower head dims.
WIDE_BACKWARD = [(136, FP16), (160, BF16), (192, FP16), (192, BF16), (200, BF16), (248, FP16), (256, FP16),
                 (256, BF16)]


@pytest.mark.parametrize("head_dim, dtype", [(8, FP16), (16, BF16), (24, FP16), (32, BF16), (40, BF16), (80, FP16),
                                             (96, BF16), (112, FP16)] + WIDE_BACKWARD)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (17, 300), (300, 17), (1, 129)])
def test_backward_on_a_wider_tile(head_dim, dtype, causal, sq, sk):
    q, k, v = make_inputs(2, 3, sq, sk, head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    got = launch_bwd.backward(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale, grads=grads)
    torch.cuda.synchronize()
    check_grads(got, q, k, v, dout, causal, scale)


def check_grads(got, q, k, v, dout, causal, scale):
    expected = reference_grads(q, k, v, dout, causal, scale)
    for name, g, want, magnitude in zip(("dq", "dk", "dv"), got, expected,
                                        gradient_magnitudes(q, k, v, dout, causal, scale)):
        assert g.shape == want.shape and g.dtype == q.dtype, name
        assert torch.isfinite(g).all(), f"{name}: non-finite (or unwritten) elements"
        assert_grad_close(name, g, want, magnitude, q.dtype)


@pytest.mark.parametrize("head_dim, dtype", [(1, FP16), (20, BF16), (100, FP16), (250, BF16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unaligned_head_dim_gradients_through_autograd(head_dim, dtype, causal):
    q, k, v = (t.requires_grad_() for t in make_inputs(1, 2, 333, 200, head_dim, dtype))
    out = cute_flash.flash_attention(q, k, v, causal=causal)
    assert out.shape[-1] == head_dim
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    check_grads(got, q.detach(), k.detach(), v.detach(), dout, causal, 1 / math.sqrt(head_dim))


@pytest.mark.parametrize("variant, head_dim, tile", [("deterministic", 80, 128), ("separate dq", 80, 128),
                                                     ("deterministic", 240, 256), ("deterministic", 176, 192)])
def test_backward_variants_on_a_wider_tile(variant, head_dim, tile):
    """The deterministic dQ order and the separate dQ kernel, for D = 80 on the 128 tile; the
    deterministic order for D = 240 on the 256 tile (split head dim) and D = 176 on the 192
    tile (transposed grads: 96-key blocks)."""
    q, k, v = make_inputs(1, 4, 700, 900, head_dim, FP16)
    scale = 1 / math.sqrt(head_dim)
    problem = AttentionProblem.of(True)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    config = dataclasses.replace(get_config("float16", tile, True, "bwd", q.device), fused_preprocess=False)
    dq_config = None
    if variant == "deterministic":
        config = dataclasses.replace(config, deterministic=True)
    else:
        dq_config = dataclasses.replace(get_config("float16", tile, True, "bwd_dq", q.device), min_seqlen_q=1)
    runs = []
    for _ in range(2):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        runs.append(launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config=config,
                                                    grads=grads, dq_config=dq_config, tile_head_dim=tile))
    torch.cuda.synchronize()
    check_grads(runs[0], q, k, v, dout, True, scale)
    if variant == "deterministic":
        assert all(torch.equal(a, b) for a, b in zip(*runs))


# A value head dim of its own (v and O; DeepSeek's (192, 128)), each pair on the native tile that
# serves the wider of its two head dims: every tensor is read and written at its own width.
VALUE_PAIRS = [(192, 128, FP16), (192, 128, BF16), (128, 64, BF16), (64, 128, FP16), (256, 128, BF16),
               (32, 96, FP16)]


def value_inputs(batch, heads, sq, sk, head_dim, value_head_dim, dtype):
    q, k, _ = make_inputs(batch, heads, sq, sk, head_dim, dtype)
    v = make_inputs(batch, heads, sk, sk, value_head_dim, dtype)[2]
    return q, k, v


@pytest.mark.parametrize("head_dim, value_head_dim, dtype", VALUE_PAIRS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (17, 300), (300, 17), (1, 129)])
def test_value_head_dim_of_its_own(head_dim, value_head_dim, dtype, causal, sq, sk):
    q, k, v = value_inputs(2, 3, sq, sk, head_dim, value_head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, lse = forward_poisoned(q, k, v, causal, scale)
    check_forward(out, lse, q, k, v, causal, scale)
    dout = torch.randn_like(out)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    got = launch_bwd.backward(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale, grads=grads)
    torch.cuda.synchronize()
    check_grads(got, q, k, v, dout, causal, scale)


@pytest.mark.parametrize("head_dim, value_head_dim, dtype", [(100, 20, BF16), (20, 100, FP16), (192, 120, FP16)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_value_head_dim_through_autograd(head_dim, value_head_dim, dtype, causal):
    """Through the public API, with head dims whose rows are not 16-byte multiples (a padded
    copy of the tensors that have them), the output and gradients at the callers' widths."""
    q, k, v = (t.requires_grad_() for t in value_inputs(1, 2, 333, 200, head_dim, value_head_dim, dtype))
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (1, 2, 333, value_head_dim)
    check_forward(out.detach(), lse, q.detach(), k.detach(), v.detach(), causal, 1 / math.sqrt(head_dim))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    check_grads(got, q.detach(), k.detach(), v.detach(), dout, causal, 1 / math.sqrt(head_dim))


@pytest.mark.parametrize("head_dim", [250])
def test_unaligned_head_dim_above_128(head_dim):
    q, k, v = make_inputs(1, 2, 300, 257, head_dim, BF16)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    check_forward(out, lse, q, k, v, True, 1 / math.sqrt(head_dim))


def prewarm():
    """Compile the wide backward cases' kernels (forward and backward) in parallel."""
    from parallel_compile import compile_in_parallel

    jobs = [(dtype, head_dim, causal, False) for head_dim, dtype in WIDE_BACKWARD for causal in (False, True)]
    jobs.append((FP16, 240, True, True))
    pairs = VALUE_PAIRS + [(104, 24, BF16), (24, 104, FP16), (192, 120, FP16)]  # the autograd cases (padded)
    jobs += [(dtype, head_dim, causal, False, value_head_dim) for head_dim, value_head_dim, dtype in pairs
             for causal in (False, True)]
    compile_in_parallel(jobs, _compile)


def _compile(job):
    import time

    from parallel_compile import compile_forward_and_backward

    dtype, head_dim, causal, deterministic, *value_head_dim = job
    start = time.time()
    compile_forward_and_backward(dtype, head_dim, AttentionProblem.of(causal), (deterministic,), *value_head_dim)
    return time.time() - start


if __name__ == "__main__" and "--prewarm" in sys.argv:
    prewarm()
