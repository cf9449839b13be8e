"""The Hopper backward kernels against float64 autograd of the naive attention, on the GPU.

Every case draws fresh random inputs and a random upstream gradient, poisons dq, dk, dv with
NaN before the launch and compares every element.
"""

import dataclasses
import math

import pytest
import torch

import cute_flash
from cute_flash import launch_bwd
from cute_flash.config import get_config, runs_as_one_launch
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.reference import attention_reference
from cute_flash.torch_helpers import TORCH_DTYPE_NAMES

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def rel_err(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def make_inputs(b, n, sq, sk, d, dtype, scale=1.0):
    def rand(s):
        return (torch.randn(b, n, s, d, device="cuda") * scale).to(dtype)

    return rand(sq), rand(sk), rand(sk)


def reference_grads(q, k, v, dout, causal, softmax_scale, dlse=None):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, causal=causal, softmax_scale=softmax_scale)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.nan_to_num(lse, neginf=0.0) * dlse.double()).sum()
    loss.backward()
    return [t.grad for t in leaves]


def gradient_magnitudes(q, k, v, dout, causal, softmax_scale):
    """float64 norms of dQ, dK, dV computed from |terms| (no cancellation): the scale the
    rounding of a correct fp16/bf16 kernel is measured against where the exact gradient
    cancels to ~0 (dQ and dK when every query sees one key: dS = P (dP - delta) = 0)."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    scores = q @ k.transpose(-1, -2) * softmax_scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = probs @ v
    delta = (dout * out).sum(-1, keepdim=True)
    terms = probs * ((dout @ v.transpose(-1, -2)).abs() + delta.abs())
    return [
        (softmax_scale * terms @ k.abs()).norm().item(),
        (softmax_scale * terms.transpose(-1, -2) @ q.abs()).norm().item(),
        (probs.transpose(-1, -2) @ dout.abs()).norm().item(),
    ]


def assert_grad_close(name, got, want, magnitude, dtype):
    """Relative error within the tolerance, measured against the gradient's norm, or against
    1 % of the norm of its terms where the gradient itself nearly cancels."""
    err = (got.double() - want).norm().item()
    bound = TOLERANCE[dtype] * max(want.norm().item(), 1e-2 * magnitude)
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (|ref| = {want.norm().item():.3e})"


def separate_dq_backward(q, k, v, out, dout, lse, problem, scale, grads):
    """The backward with the shipped bwd_dq tiles forced on for every Sq: dK / dV from the
    main kernel, dQ from its own kernel (the long-sequence path)."""
    dtype, head_dim = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype], q.shape[-1]
    config = get_config(dtype, head_dim, problem.causal, "bwd", q.device)
    dq_config = dataclasses.replace(get_config(dtype, head_dim, problem.causal, "bwd_dq", q.device), min_seqlen_q=1)
    return launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config=config, grads=grads,
                                           dq_config=dq_config)


def check(q, k, v, causal, softmax_scale=None, backward=launch_bwd.backward):
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    dout = torch.randn_like(out)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv = backward(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale, grads=grads)
    torch.cuda.synchronize()
    expected = reference_grads(q, k, v, dout, causal, scale)
    magnitudes = gradient_magnitudes(q, k, v, dout, causal, scale)
    for name, got, want, magnitude in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, magnitudes):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        assert torch.isfinite(got).all(), f"{name}: non-finite (or unwritten) elements"
        assert_grad_close(name, got, want, magnitude, q.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", [1, 17, 128, 1000, 4096])
def test_square(seqlen, causal, head_dim, dtype):
    batch_heads = (2, 2) if seqlen <= 1000 else (1, 2)
    check(*make_inputs(*batch_heads, seqlen, seqlen, head_dim, dtype), causal)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_postprocess_behind_a_main_kernel_of_several_waves(causal, dtype, overlap):
    """24 heads x 16 key blocks = 384 main CTAs, ~3 waves on 132 SMs: the overlapped dQ
    postprocess starts while the last wave runs, so it finds heads whose sums are complete
    and heads whose CTAs still add (it must wait for those)."""
    def backward(*args, **kwargs):
        return launch_bwd.backward(*args, overlap_postprocess=overlap, **kwargs)

    check(*make_inputs(1, 24, 2048, 2048, 128, dtype), causal, backward=backward)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.float16, 128)], ids=["bf16-D64", "fp16-D128"])
@pytest.mark.parametrize("sq, sk, alignment", [(1000, 1000, "top_left"), (1000, 700, "bottom_right"),
                                               (300, 1000, "bottom_right"), (777, 129, "top_left")])
def test_grouped_causal_key_blocks_in_sections(sq, sk, alignment, dtype, head_dim):
    """A grouped causal backward numbers its key blocks longest first across sections of
    (kv head, batch) pairs (launch_bwd.GROUPED_SECTION_PAIRS; kernels/tile_scheduler.sections_fast):
    10 pairs in sections of at most 4 and 3 (balanced: 4, 3, 3 and 3, 3, 2, 2) against the per-pair order and
    float64. Every key block is computed once for its own head and batch: dK and dV (summed
    in one CTA's registers, in a fixed order) bitwise equal to the per-pair order's; dQ and all
    three against the reference, per (batch, head) (a swapped pair hides in a global norm)."""
    heads, kv_heads = 10, 5
    q = torch.randn(2, heads, sq, head_dim, device="cuda").to(dtype)
    k, v = (torch.randn(2, kv_heads, sk, head_dim, device="cuda").to(dtype) for _ in range(2))
    scale = 1.0 / math.sqrt(head_dim)
    problem = AttentionProblem.of(True, alignment=alignment, grouped=True)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True,
                                          alignment=alignment)
    dout = torch.randn_like(out)
    entry = get_config(TORCH_DTYPE_NAMES[dtype], head_dim, True, "bwd", q.device)
    derived = launch_bwd.derived_config(entry, TORCH_DTYPE_NAMES[dtype], problem, head_dim, head_dim, False)
    assert derived.section_pairs == launch_bwd.GROUPED_SECTION_PAIRS > 1
    results = {}
    for pairs in (1, 3, derived.section_pairs):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        config = dataclasses.replace(derived, section_pairs=pairs)
        results[pairs] = launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config, grads=grads)
    torch.cuda.synchronize()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out, _ = attention_reference(*leaves, causal=True, softmax_scale=scale, alignment=alignment)
    expected = torch.autograd.grad(want_out, leaves, dout.double())
    for pairs, got_grads in results.items():
        for name, got, want in zip(("dq", "dk", "dv"), got_grads, expected):
            assert torch.isfinite(got).all(), f"{pairs} pairs, {name}: non-finite (or unwritten) elements"
            per_head = (got.double() - want).flatten(2).norm(dim=2) / want.flatten(2).norm(dim=2).clamp_min(1e-30)
            assert per_head.max().item() <= 2 * TOLERANCE[dtype], f"{pairs} pairs, {name}: per-head errors {per_head}"
        assert torch.equal(got_grads[1], results[1][1]) and torch.equal(got_grads[2], results[1][2]), pairs


@pytest.mark.parametrize("waves", [launch_bwd.PREP_AHEAD_WAVES, 0], ids=["planned", "one-head-ahead"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_preprocess_of_later_heads_in_the_main_kernel(causal, dtype, head_dim, fused, waves):
    """3 x 40 heads, Sq 1001 (not a multiple of the prepared passes) and Sk 900: with
    fused_preprocess the preprocess kernel prepares the first heads (33, or 1 with
    prep_ahead_waves = 0: every head then waits for the CTAs of the head just before it) and
    the main kernel's idle warps all later ones. Without it, the preprocess prepares all."""
    q, k, v = make_inputs(3, 40, 1001, 900, head_dim, dtype)
    key = (TORCH_DTYPE_NAMES[dtype], head_dim, causal)
    config = dataclasses.replace(get_config(*key, "bwd", q.device, seqlens=(1001, 900)), fused_preprocess=fused)
    problem = AttentionProblem.of(causal)
    prep_ahead, _ = launch_bwd.prepare_ahead_plan(config, None, problem, 3, 40, 900, 132, None, True, waves)
    assert (prep_ahead < 3 * 40) == fused  # the test would not see the main kernel prepare

    def backward(*args, **kwargs):
        return launch_bwd.backward_with_config(*args, config=config, prep_ahead_waves=waves, **kwargs)

    check(q, k, v, causal, backward=backward)


@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk, kv_heads", [(1, 1, 4), (17, 300, 4), (200, 17, 4), (200, 200, 4), (1, 129, 4),
                                              (60, 600, 2)])
def test_one_launch_backward_converts_dq_in_its_main_kernel(sq, sk, kv_heads, causal, head_dim, dtype, layout,
                                                          monkeypatch):
    """A one-launch grid with a small head (launch_bwd.IN_KERNEL_DQ_BYTES) launches no
    postprocess: each head's last CTA converts its dQ after its epilogue (fused_postprocess),
    grouped heads (4 query heads on 2 key/value heads) too; its consumers prepared each head's
    rows first, also through (B, S, N, D) buffers' strides (layout bsnd: q, k, v, O and dO
    transposed views, as flash-attn's layout and Hugging Face's projections give them). Into
    poisoned gradients, every element of dQ against the postprocess's conversion of the same
    call (they differ by the order of the fp32 sums only), dK and dV against float64, twice on
    one counted set."""
    def tensor(heads, seqlen):
        if layout == "bsnd":
            return torch.randn(2, seqlen, heads, head_dim, device="cuda").to(dtype).transpose(1, 2)
        return torch.randn(2, heads, seqlen, head_dim, device="cuda").to(dtype)

    q = tensor(4, sq)
    k, v = tensor(kv_heads, sk), tensor(kv_heads, sk)
    scale = 1.0 / math.sqrt(head_dim)
    problem = AttentionProblem.of(causal, grouped=kv_heads < 4)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    dout = tensor(4, sq)
    assert (out.stride(2) == head_dim) == (dout.stride(2) == head_dim) == (layout == "bnsd")

    def backward():
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        return launch_bwd.backward(q, k, v, out, dout, lse, problem, scale, grads=grads)

    launch_bwd._plans.clear()
    converted = [backward(), backward()]
    (plan,) = launch_bwd._plans.values()
    assert plan.one_launch and plan.converts_dq
    monkeypatch.setattr(launch_bwd, "IN_KERNEL_DQ_BYTES", 0)
    launch_bwd._plans.clear()
    postprocessed = backward()
    assert not next(iter(launch_bwd._plans.values())).converts_dq
    launch_bwd._plans.clear()
    torch.cuda.synchronize()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out, _ = attention_reference(*leaves, causal=causal, softmax_scale=scale)
    expected = torch.autograd.grad(want_out, leaves, dout.double())
    group = 4 // kv_heads
    magnitudes = gradient_magnitudes(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), dout, causal,
                                     scale)
    for dq, dk, dv in converted:
        assert torch.isfinite(dq).all(), "dQ: non-finite (or unwritten) elements"
        torch.testing.assert_close(dq.float(), postprocessed[0].float(), rtol=2 ** -6,
                                   atol=1e-3 * postprocessed[0].float().abs().max().item())
        for name, got, want, magnitude in zip(("dq", "dk", "dv"), (dq, dk, dv), expected, magnitudes):
            assert torch.isfinite(got).all(), name
            assert_grad_close(name, got, want, magnitude, dtype)


@pytest.mark.parametrize("grouped", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("batch, sq, sk", [(1, 1999, 2000), (8, 499, 500)], ids=["2-waves", "4-waves"])
def test_grids_of_several_waves_run_as_one_launch_where_short(batch, sq, sk, head_dim, causal, grouped):
    """Grids of several waves: 16 units of 16 key blocks (256 CTAs) or 128 units of 4 (512
    CTAs) on 132 SMs, run as one launch where config.runs_as_one_launch says so (all but the
    two waves at D = 128, which launch three kernels): every head prepared by its own CTAs,
    the heads that straddle the waves waiting until their last CTA is dispatched; where a
    group's accumulator is within IN_KERNEL_DQ_BYTES the main kernel converts dQ, else the
    postprocess does. Twice on one counted set, into poisoned gradients, every element against
    float64 (bf16, Sq != Sk)."""
    torch.manual_seed(head_dim + 2 * causal + grouped + batch)
    heads = 32 if grouped else 16
    group = heads // 16
    scale = 1.0 / math.sqrt(head_dim)
    q = torch.randn(batch, heads, sq, head_dim, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(batch, 16, sk, head_dim, device="cuda").to(torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    launch_bwd._plans.clear()
    problem = AttentionProblem.of(causal, grouped=grouped)
    calls = []
    for _ in range(2):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        calls.append(launch_bwd.backward(q, k, v, out, dout, lse, problem, scale, grads=grads))
    (plan,) = launch_bwd._plans.values()
    launch_bwd._plans.clear()
    num_sms = launch_bwd.device_traits(q.device)[1]
    assert batch * 16 * plan.key_blocks > num_sms
    assert plan.one_launch == runs_as_one_launch(batch * 16, plan.key_blocks, head_dim, num_sms)
    group_accum_bytes = 4 * plan.rows[2] * head_dim * group
    assert plan.converts_dq == (plan.one_launch and group_accum_bytes <= launch_bwd.IN_KERNEL_DQ_BYTES)
    # (The reference repeats grouped k and v itself, so autograd sums their gradients.)
    expected = reference_grads(q, k, v, dout, causal, scale)
    magnitudes = gradient_magnitudes(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), dout, causal,
                                     scale)
    for got in calls:
        for name, g, want, magnitude in zip(("dq", "dk", "dv"), got, expected, magnitudes):
            assert g.shape == want.shape and torch.isfinite(g).all(), name
            assert_grad_close(name, g, want, magnitude, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group", [31, 32, 33])
def test_one_launch_backward_with_a_group_at_the_in_kernel_bound(group, causal):
    """Grouped one-launch grids at launch_bwd.IN_KERNEL_DQ_MAX_GROUP: up to 32 query heads per
    key/value head the writer warp flags each finished head by its bit in one 32-bit word (bit
    31 included) and the main kernel converts dQ; 33 fall back to the postprocess. D = 16, the
    one head dim whose group of 32 fits launch_bwd.IN_KERNEL_DQ_BYTES (17 rows pad to 128);
    41 key blocks of 128, as a one-launch grid prepares a group only with at least one key block
    per query head (launch_bwd.preparing_ctas). Every gradient element against float64, into
    poisoned buffers."""
    torch.manual_seed(group)
    head_dim, scale, seqlen_k = 16, 0.25, 40 * 128 + 28
    q = torch.randn(1, group, 17, head_dim, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(1, 1, seqlen_k, head_dim, device="cuda").to(torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    launch_bwd._plans.clear()
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    got = launch_bwd.backward(q, k, v, out, dout, lse, AttentionProblem.of(causal, grouped=True), scale,
                              grads=grads)
    (plan,) = launch_bwd._plans.values()
    assert plan.one_launch and plan.converts_dq == (group <= launch_bwd.IN_KERNEL_DQ_MAX_GROUP)
    launch_bwd._plans.clear()
    expected = reference_grads(q, k, v, dout, causal, scale)  # (grouped k, v: see attention_reference)
    magnitudes = gradient_magnitudes(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), dout, causal,
                                     scale)
    for name, g, want, magnitude in zip(("dq", "dk", "dv"), got, expected, magnitudes):
        assert g.shape == want.shape and torch.isfinite(g).all(), name
        assert_grad_close(name, g, want, magnitude, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1, 1000), (1000, 1), (17, 300), (300, 17), (128, 1000), (1000, 128)])
def test_different_query_and_key_lengths(sq, sk, causal, dtype):
    check(*make_inputs(1, 3, sq, sk, 128, dtype), causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (1000, 1000), (4096, 4096), (17, 300), (1000, 128),
                                   (128, 1000)])
def test_separate_dq_kernel(sq, sk, causal, head_dim, dtype):
    batch_heads = (2, 2) if max(sq, sk) <= 1000 else (1, 2)
    check(*make_inputs(*batch_heads, sq, sk, head_dim, dtype), causal, backward=separate_dq_backward)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_separate_dq_kernel_on_views_with_a_custom_scale(causal):
    b, s, n, d = 2, 700, 3, 128
    q, k, v = ((torch.randn(b, s, n, d, device="cuda") * 4).to(torch.bfloat16).transpose(1, 2) for _ in range(3))
    check(q, k, v, causal, softmax_scale=0.3, backward=separate_dq_backward)


ORDER_VARIANTS = {  # fields replaced in the YAML entry
    "m64-swap": dict(block_m=64, dq_swap_ab=True),
    # One dQ tile: two of 80 rows do not fit in shared memory (the shipped entry may have two).
    "m80-swap-dv-after-ds": dict(block_m=80, dq_swap_ab=True, dv_after_ds=True, dq_stages=1),
    "m64-dv-after-ds": dict(block_m=64, dv_after_ds=True),
}


@pytest.mark.parametrize("variant", list(ORDER_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(17, 17), (1000, 1000), (300, 777), (777, 300), (1, 1000)])
def test_swapped_dq_gemm_and_late_dv(sq, sk, causal, dtype, variant):
    """dq_swap_ab (dQ^T = K^T dS^T), including FA3's 80-row step, which does not divide the
    128-row padding of the LSE / delta / dQ buffers, and dv_after_ds (dV issued once dS is
    formed, which is what lets 80 rows fit in registers): the fp16 non-causal D=128 entry
    ships 80 rows; here every dtype and mask, from whatever the YAML entry holds."""
    def backward(q, k, v, out, dout, lse, problem, scale, grads):
        name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype]
        config = dataclasses.replace(get_config(name, 128, problem.causal, "bwd", q.device), **ORDER_VARIANTS[variant])
        return launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config=config, grads=grads)

    check(*make_inputs(1, 3, sq, sk, 128, dtype), causal, backward=backward)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(17, 17), (100, 100), (200, 333), (1000, 1000), (777, 300), (1, 1000)])
def test_two_staged_dq_tiles(sq, sk, causal, head_dim, deterministic):
    """dq_stages 2: consumers and the writer warp take turns through two dQ tiles; 1, 2 and
    many query blocks per key block (the writer frees the first stages before its loop). At
    D = 64 one dS buffer: beside the entries' second one, two dQ tiles overflow shared memory."""
    one_ds_buffer = {"num_stages_pds": 1} if head_dim == 64 else {}

    def backward(q, k, v, out, dout, lse, problem, scale, grads):
        config = dataclasses.replace(get_config("bfloat16", head_dim, problem.causal, "bwd", q.device), dq_stages=2,
                                     deterministic=deterministic, **one_ds_buffer)
        return launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config=config, grads=grads)

    check(*make_inputs(1, 3, sq, sk, head_dim, torch.bfloat16), causal, backward=backward)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_and_custom_scale(causal):
    check(*make_inputs(1, 2, 1000, 1000, 64, torch.bfloat16, scale=5.0), causal, softmax_scale=0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bsnd_views(causal):
    b, s, n, d = 2, 700, 3, 128
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_autograd_through_public_api(causal):
    """The public function is differentiable, including through the returned LSE."""
    q, k, v = (t.requires_grad_() for t in make_inputs(2, 4, 333, 517, 128, torch.float16))
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    expected = reference_grads(q, k, v, dout, causal, 1 / math.sqrt(128), dlse=dlse)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), expected):
        assert rel_err(got, want) <= TOLERANCE[torch.float16], name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_eager_autograd_and_the_custom_op_agree_bitwise(causal):
    """Eager calls differentiate through api._AttentionFunction, traced ones through the
    custom op's registered autograd: both must run the same kernels on the same inputs."""
    q0, k0, v0 = make_inputs(2, 3, 700, 900, 128, torch.bfloat16)
    dout = torch.randn_like(q0)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for path in ("api", "op"):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            if path == "api":
                out = cute_flash.flash_attention(q, k, v, causal=causal)
            else:
                out, _ = torch.ops.cute_flash.flash_attention_fwd(q, k, v, causal, 1 / math.sqrt(128))
            out.backward(dout)
            grads.append((out.detach(), q.grad, k.grad, v.grad))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_gradient_of_the_lse_alone():
    """Only the LSE is used: O's upstream gradient is None (zeros), dlse drives dQ and dK."""
    q, k, v = (t.requires_grad_() for t in make_inputs(1, 2, 300, 400, 64, torch.float16))
    _, lse = cute_flash.flash_attention(q, k, v, return_lse=True)
    dlse = torch.randn_like(lse)
    (lse * dlse).sum().backward()
    expected = reference_grads(q, k, v, torch.zeros_like(q), False, 1 / math.sqrt(64), dlse=dlse)
    for name, got, want in zip(("dq", "dk"), (q.grad, k.grad), expected):
        assert rel_err(got, want) <= TOLERANCE[torch.float16], name
    assert torch.count_nonzero(v.grad) == 0  # V does not enter the LSE


def test_backward_dk_dv_are_deterministic_dq_close():
    """dK and dV are owned by one CTA each: bitwise reproducible. dQ is summed across CTAs with
    fp32 bulk reductions in no fixed order, so its bits may differ between runs (by rounding only)."""
    q, k, v = (t.requires_grad_() for t in make_inputs(1, 4, 2048, 2048, 128, torch.bfloat16))
    dout = torch.randn_like(q)
    results = []
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        cute_flash.flash_attention(q, k, v, causal=True).backward(dout)
        results.append([t.grad.clone() for t in (q, k, v)])
    for again in results[1:]:
        assert torch.equal(results[0][1], again[1]) and torch.equal(results[0][2], again[2])
        assert rel_err(again[0], results[0][0].double()) < 1e-2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_mode_is_bitwise_reproducible(causal):
    q, k, v = (t.requires_grad_() for t in make_inputs(2, 4, 1500, 1500, 128, torch.bfloat16))
    dout = torch.randn_like(q)
    # First without deterministic mode: the backward's plan for this signature (launch_bwd)
    # must not serve the deterministic calls below.
    cute_flash.flash_attention(q, k, v, causal=causal).backward(dout)
    results = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            q.grad = k.grad = v.grad = None
            cute_flash.flash_attention(q, k, v, causal=causal).backward(dout)
            results.append([t.grad.clone() for t in (q, k, v)])
    finally:
        torch.use_deterministic_algorithms(False)
    for again in results[1:]:
        for a, b in zip(results[0], again):
            assert torch.equal(a, b)
    expected = reference_grads(q, k, v, dout, causal, 1 / math.sqrt(128))
    for got, want in zip(results[0], expected):
        assert rel_err(got, want) <= TOLERANCE[torch.bfloat16]


class TwoLayerAttention(torch.nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x):
        b, s, dim = x.shape
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            x = x + proj(self.attention(q, k, v).transpose(1, 2).reshape(b, s, dim))
        return x


def test_training_loss_curve_matches_sdpa():
    torch.manual_seed(0)
    data = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    target = torch.randn_like(data)
    curves = {}
    impls = {
        "cute_flash": lambda q, k, v: cute_flash.flash_attention(q, k, v, causal=True),
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    for name, attention in impls.items():
        torch.manual_seed(1)
        model = TwoLayerAttention(512, 4, attention).cuda().to(torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data).float(), target.float())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves[name] = losses
    assert curves["cute_flash"][-1] < curves["cute_flash"][0]  # it trains
    for a, b in zip(curves["cute_flash"], curves["sdpa"]):
        assert abs(a - b) <= 2e-2 * abs(b), (curves["cute_flash"], curves["sdpa"])


def test_memory_is_linear_in_sequence_length():
    b, n, s, d = 1, 8, 32768, 128
    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = cute_flash.flash_attention(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    io_bytes = 4 * q.numel() * q.element_size()  # out, dq, dk, dv
    extra = torch.cuda.max_memory_allocated() - base - io_bytes
    assert extra < 256 * 2**20, f"extra peak memory {extra / 2**20:.0f} MiB (one S x S fp16 is 2048 MiB)"
