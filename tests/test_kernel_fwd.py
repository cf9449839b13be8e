"""The Hopper forward kernel against a float64 reference, on the GPU.

Every case draws fresh random inputs, poisons the outputs with NaN before the launch and
compares every element of O and of the LSE.
"""

import dataclasses
import math

import pytest
import torch

from cute_flash.torch_helpers import DENSE_BATCH, TORCH_DTYPE_NAMES

import cute_flash
from cute_flash import compile_cache, compile_fwd
from cute_flash.config import get_config, without_clusters
from cute_flash.kernels import tile_scheduler
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.reference import attention_reference

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
LSE_TOLERANCE = 1e-3  # absolute, natural log; the LSE is computed in fp32 from fp32 scores

SEQLENS = [1, 17, 128, 1000, 4096, 8191]


def dense_config(name, head_dim, causal, device):
    """The shipped forward config as the host runs it on heads that are not grouped: one query
    head per cluster (config.heads_clustered)."""
    return without_clusters(get_config(name, head_dim, causal, "fwd", device))



def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(b, n, sq, sk, d, dtype, scale=1.0, generator=None):
    def rand(s):
        return (torch.randn(b, n, s, d, device="cuda", dtype=torch.float32, generator=generator) * scale).to(dtype)

    return rand(sq), rand(sk), rand(sk)


def run_poisoned(q, k, v, causal, softmax_scale, kernel=None):
    """Call the compiled kernel (default: the shipped config's) directly on NaN-filled outputs:
    an unwritten element stays NaN."""
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype]
    if kernel is None:
        config = dense_config(name, q.shape[-1], causal, q.device)
        major, minor = torch.cuda.get_device_capability(q.device)
        kernel = compile_fwd.get_forward(name, q.shape[-1], AttentionProblem.of(causal), config,
                                         f"sm_{major}{minor}a")
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    kernel(q, k, v, out, lse, None, *DENSE_BATCH, softmax_scale)
    torch.cuda.synchronize()
    return out, lse


def check(q, k, v, causal, softmax_scale=None, poisoned=True, kernel=None):
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if poisoned:
        out, lse = run_poisoned(q, k, v, causal, scale, kernel)
    else:
        out, lse = cute_flash.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                              return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, dtype=torch.float64)
    assert out.shape == q.shape[:3] + (v.shape[-1],) and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "non-finite (or unwritten) output elements"
    assert torch.isfinite(lse).all(), "non-finite (or unwritten) LSE elements"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[q.dtype], f"relative error {err:.2e}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err <= LSE_TOLERANCE * max(1.0, ref_lse.abs().max().item()), f"LSE error {lse_err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_square(seqlen, causal, head_dim, dtype):
    batch_heads = (2, 2) if seqlen <= 1000 else (1, 1)
    check(*make_inputs(*batch_heads, seqlen, seqlen, head_dim, dtype), causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1, 1000), (1000, 1), (17, 4096), (4096, 17), (128, 1000), (1000, 128), (300, 777)])
def test_different_query_and_key_lengths(sq, sk, causal, dtype):
    check(*make_inputs(1, 3, sq, sk, 128, dtype), causal)


@pytest.mark.parametrize("batch,heads", [(1, 1), (4, 64), (2, 128), (256, 1), (1, 256)])
def test_batch_and_heads(batch, heads):
    check(*make_inputs(batch, heads, 200, 200, 128, torch.float16), causal=True)


@pytest.mark.parametrize("section_pairs", [1, 3, 4, None], ids=["one-pair", "three-pairs", "four-pairs", "shipped"])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (1000, 700), (300, 1000)])
def test_causal_tile_sections(monkeypatch, section_pairs, sq, sk):
    """A causal grid runs its tiles in sections of (head, batch) pairs (kernels/tile_scheduler.py):
    with sections of at most one, three and four of ten pairs (balanced: 3, 3, 2, 2 and 4, 3, 3;
    tile_scheduler.sections_fast) every tile is computed, once, for its own rows. Compiled uncached: the patched budget is not in the cache key."""
    q, k, v = make_inputs(2, 5, sq, sk, 128, torch.bfloat16)
    if section_pairs is not None:  # K and V of exactly section_pairs (head, batch) pairs
        monkeypatch.setattr(tile_scheduler, "L2_SECTION_BYTES", section_pairs * sk * (128 + 128) * 2)
    config = dense_config("bfloat16", 128, True, q.device)
    kernel = compile_fwd.compile_forward("bfloat16", 128, AttentionProblem.of(True), config)
    check(q, k, v, causal=True, kernel=kernel)


@pytest.mark.parametrize("rescale_before_pv", [False, True], ids=["after-pv", "before-pv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (17, 4096), (1000, 77), (300, 777)])
def test_rescale_of_o_one_block_late(sq, sk, causal, dtype, rescale_before_pv):
    """Both places of O's rescale (TileConfig.rescale_before_pv) on logits scaled x20, where
    row maxima move by large steps on many blocks, and on the first block of several tails."""
    name = TORCH_DTYPE_NAMES[dtype]
    config = dataclasses.replace(dense_config(name, 128, causal, torch.device("cuda")),
                                 rescale_before_pv=rescale_before_pv)
    kernel = compile_fwd.get_forward(name, 128, AttentionProblem.of(causal), config)
    check(*make_inputs(2, 3, sq, sk, 128, dtype, scale=20.0), causal, kernel=kernel)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits(causal, dtype):
    """Inputs scaled x20: logits in the hundreds, the online max must keep exp2 in range."""
    q, k, v = make_inputs(1, 2, 1000, 1000, 128, dtype, scale=20.0)
    check(q, k, v, causal)


def test_custom_softmax_scale():
    q, k, v = make_inputs(1, 2, 300, 500, 64, torch.bfloat16)
    check(q, k, v, causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bsnd_view_goes_to_the_kernel_without_copy(causal):
    """A (B, S, N, D) tensor viewed as (B, N, S, D): the layout flash-attn and most models use."""
    b, s, n, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    from cute_flash.torch_helpers import tma_compatible

    assert all(tma_compatible(t) for t in (q, k, v))
    check(q, k, v, causal)
    check(q, k, v, causal, poisoned=False)


def test_unaligned_strides_are_copied_not_rejected():
    base = torch.randn(1, 2, 129, 136, device="cuda", dtype=torch.float16)
    q = base[:, :, 1:, 4:68]  # storage offset and row stride not 16-byte multiples
    k = torch.randn(1, 2, 77, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 2, 77, 64, device="cuda", dtype=torch.float16)
    check(q, k, v, causal=False, poisoned=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_api_matches_sdpa(causal):
    q, k, v = make_inputs(2, 8, 1024, 1024, 128, torch.float16)
    out = cute_flash.flash_attention(q, k, v, causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert rel_err(out, ref.double()) < 2e-3


def test_forward_is_bitwise_deterministic():
    q, k, v = make_inputs(2, 4, 2048, 2048, 128, torch.bfloat16)
    first = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    for _ in range(3):
        again = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_empty_sequences():
    q, k, v = make_inputs(1, 2, 0, 5, 128, torch.float16)
    assert cute_flash.flash_attention(q, k, v).shape == (1, 2, 0, 128)
    q, k, v = make_inputs(1, 2, 5, 0, 128, torch.float16)
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_second_call_does_not_recompile():
    q, k, v = make_inputs(1, 2, 256, 256, 128, torch.float16)
    cute_flash.flash_attention(q, k, v)
    before = compile_cache.compile_count
    cute_flash.flash_attention(*make_inputs(3, 5, 999, 333, 128, torch.float16))
    assert compile_cache.compile_count == before


def test_cuda_graph_capture():
    q, k, v = make_inputs(2, 4, 512, 512, 128, torch.float16)
    expected = cute_flash.flash_attention(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cute_flash.flash_attention(q, k, v, causal=True)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_flash.flash_attention(q, k, v, causal=True)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = cute_flash.flash_attention(q, k, v, causal=True)
    assert not torch.equal(fresh, expected)
    assert torch.equal(out, fresh)


# Band tiles aligned to the last query (kernels/sequences.SequenceLayout.aligned_to_end):
# (Sq, Sk, band). Sq % 192 != 0 puts the first tile's first rows before row 0.
END_ALIGNED = [
    (1000, 1000, dict(causal=True)), (8191, 8191, dict(causal=True)), (193, 193, dict(causal=True)),
    (1, 1, dict(causal=True)), (1000, 1500, dict(causal=True)), (1500, 1000, dict(causal=True)),
    (1000, 1000, dict(window_size=(300, 0))), (777, 900, dict(window_size=(64, 16))),
    # One key block; the first tile (rows -84 ... 107) sees no key, the last tile's last 17 rows
    # do. At D = 16 the first tile's row stores once reached past its 192 rows into the last's.
    (300, 17, dict(causal=True)),
]


@pytest.mark.parametrize("sq, sk, band", END_ALIGNED, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 16),
                                             (torch.float16, 32)],
                         ids=["bf16-D128", "fp16-D64", "bf16-D16", "fp16-D32"])
def test_band_tiles_end_at_the_last_query(entry_tiles_on_every_grid, dtype, head_dim, sq, sk, band):
    """A bottom-right band forward (tiles end at each sequence's last query) on the entry's
    tile (grid_fitted off): every row of O and the LSE against the float64 reference (rows
    that see no key: O = 0, LSE = -inf), written into a NaN-filled buffer whose rows before and
    after each (batch, head) stay NaN: the first tile's rows before row 0 are neither stored by
    the TMA nor by the LSE's per-row stores, nor reach into the next tile's (D = 16 and 32 on
    their entries' 192-row tiles, where the row stores' passes once did not tile the rows)."""
    from cute_flash import launch_fwd

    batch, heads, guard = 2, 3, 64
    problem = AttentionProblem.of(band.get("causal", False), band.get("window_size", (-1, -1)), "bottom_right")
    kernel = launch_fwd.kernel_for(dtype, head_dim, problem, torch.device("cuda"), (sq, sk), head_dim,
                                   (batch, heads, heads))
    if head_dim <= 32 and sq > 128 and band.get("window_size") != (64, 16):  # (that narrow band: one warpgroup)
        assert entry_tiles_on_every_grid[-1].block_m == 192
    q, k, v = make_inputs(batch, heads, sq, sk, head_dim, dtype)
    buffer = torch.full((batch, heads, sq + 2 * guard, head_dim), float("nan"), dtype=dtype, device="cuda")
    out = buffer[:, :, guard:guard + sq]
    lse_buffer = torch.full((batch, heads, sq + 2 * guard), float("nan"), dtype=torch.float32, device="cuda")
    lse = lse_buffer[:, :, guard:guard + sq]
    kernel(q, k, v, out, lse, None, *DENSE_BATCH, head_dim ** -0.5)
    torch.cuda.synchronize()
    assert buffer[:, :, :guard].isnan().all() and buffer[:, :, guard + sq:].isnan().all()
    assert lse_buffer[:, :, :guard].isnan().all() and lse_buffer[:, :, guard + sq:].isnan().all()
    ref, ref_lse = attention_reference(q, k, v, alignment="bottom_right", **band)
    seen = torch.isfinite(ref_lse)
    assert torch.isfinite(out).all() and not lse.isnan().any()
    assert torch.equal(torch.isfinite(lse), seen) and (out[~seen] == 0).all()
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= LSE_TOLERANCE * max(
        1.0, ref_lse[seen].abs().max().item())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "window"])
def test_top_left_band_with_as_many_queries_as_keys_runs_end_aligned(causal):
    """The public path runs a top-left band with Sq = Sk on the bottom-right kernel
    (launch_fwd.end_aligned_problem), bitwise equal to an explicit bottom-right call, and its
    gradients match the reference (the backward keeps the top-left problem)."""
    kwargs = dict(causal=True) if causal else dict(window_size=(300, 20))
    q, k, v = (t.requires_grad_() for t in make_inputs(2, 4, 1000, 1000, 128, torch.bfloat16))
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
    right, right_lse = cute_flash.flash_attention(q, k, v, return_lse=True, alignment="bottom_right", **kwargs)
    assert torch.equal(out, right) and torch.equal(lse, right_lse)
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), **kwargs)
    assert rel_err(out.detach(), ref) <= TOLERANCE[torch.bfloat16]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = attention_reference(*leaves, **kwargs)
    want = torch.autograd.grad(ref_out, leaves, dout.double())
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 2.5e-2
