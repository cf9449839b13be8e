"""The variants of issue 21 on the GPU, forward and gradients, against the float64 reference:
grouped-query attention (GQA / MQA), band masks (causal and windows, both alignments),
softcap, sinks, their combinations, and flash-attn's entry point.

Fresh random inputs per case; forward outputs poisoned with NaN before the launch; every
element compared. The cases name few distinct problems on purpose: each compiles a forward
and a backward set. `python tests/test_variants.py --prewarm` compiles them all in parallel
first (on the GPU machine: minutes of device time otherwise; `--softcap-only`: the softcap
cases' kernels)."""

import dataclasses
import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cute_flash
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.reference import attention_reference

FP16, BF16 = torch.float16, torch.bfloat16
FWD_TOLERANCE = {FP16: 3e-3, BF16: 1.2e-2}  # relative error of O, norm-wise
BWD_TOLERANCE = {FP16: 1e-2, BF16: 2.5e-2}  # of each gradient
LSE_TOLERANCE = 2e-3

# (id, flash_attention keyword arguments, kv heads of 4 query heads)
VARIANTS = [
    ("gqa", dict(), 2),
    ("mqa-causal", dict(causal=True), 1),
    ("causal-bottom-right", dict(causal=True, alignment="bottom_right"), 4),
    ("window", dict(window_size=(64, 32)), 4),
    ("window-causal-bottom-right-gqa", dict(causal=True, window_size=(100, 0), alignment="bottom_right"), 2),
    ("softcap", dict(softcap=5.0), 4),
    ("softcap-causal-gqa", dict(causal=True, softcap=20.0), 2),
    ("sink", dict(sink=True), 4),
    ("everything", dict(causal=True, window_size=(90, 0), alignment="bottom_right", softcap=10.0, sink=True), 2),
]
# (dtype, head dim): the two native tiles, alternating dtypes per variant.
HEAD_DIMS = [(BF16, 128), (FP16, 64)]
# (Sq, Sk): equal, Sq < Sk and Sq > Sk (bottom-right rows that see nothing), tails.
SEQLENS = [(300, 300), (17, 1000), (1000, 129)]


def inputs(dtype, head_dim, kv_heads, sq, sk, sink, batch=2, heads=4):
    q = torch.randn(batch, heads, sq, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, sk, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, sk, head_dim, device="cuda", dtype=dtype)
    sinks = torch.randn(heads, device="cuda", dtype=torch.float32) if sink else None
    return q, k, v, sinks


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def reference(q, k, v, sink, kwargs, dout=None):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.detach().double().requires_grad_() if sink is not None else None
    out, lse = attention_reference(*leaves, dtype=torch.float64, sink=sink_leaf, **kwargs)
    grads = None
    if dout is not None:
        (out * dout.double()).sum().backward()
        grads = [t.grad for t in leaves] + ([sink_leaf.grad] if sink is not None else [])
    return out.detach(), lse.detach(), grads


def check_grad(name, got, ref, dout, tolerance):
    assert got.shape == ref.shape and torch.isfinite(got).all(), name
    if ref.norm() > 1e-3:
        assert rel_err(got, ref) < tolerance, f"{name}: {rel_err(got, ref):.3e}"
    else:
        # All rows masked (exact zeros), or a gradient that cancels (one visible key:
        # dS = P (dP - delta) = 0 exactly, and delta from the 16-bit O leaves ~1e-7).
        assert got.double().norm() <= 1e-4 * dout.double().norm(), f"{name}: {got.double().norm():.3e}"


def check_dsink(got, ref, sink, want, want_lse, dout):
    """The sink's gradient: a sum over all rows of terms of either sign, P_sink * delta, which
    can cancel, delta coming from the 16-bit O: measured against the terms' magnitude too."""
    terms = torch.exp(sink.double().view(1, -1, 1) - want_lse) * (dout.double() * want).sum(-1).abs()
    bound = BWD_TOLERANCE[dout.dtype] * max(ref.norm().item(), 0.1 * terms.sum(dim=(0, 2)).norm().item())
    assert (got.double() - ref).norm().item() <= bound, f"dsink: {(got.double() - ref).norm().item():.3e}"


def check_lse(lse, ref_lse):
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf exactly where the row sees no key"
    assert (lse[~finite] == float("-inf")).all()
    if finite.any():
        assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < LSE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("sq, sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("hd", range(len(HEAD_DIMS)), ids=[f"{str(d)[6:]}-D{h}" for d, h in HEAD_DIMS])
def test_forward_and_gradients(hd, variant, sq, sk):
    dtype, head_dim = HEAD_DIMS[hd]
    _, kwargs, kv_heads = VARIANTS[variant]
    kwargs = dict(kwargs)
    q, k, v, sink = inputs(dtype, head_dim, kv_heads, sq, sk, kwargs.pop("sink", False))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_() if sink is not None else None
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, sink=sink_leaf, **kwargs)
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sink, kwargs, dout)
    assert out.shape == q.shape and torch.isfinite(out).all()
    # Rows that see no key are exact zeros.
    empty = ~torch.isfinite(want_lse)
    assert (out[empty] == 0).all()
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    check_lse(lse, want_lse)
    got_grads = torch.autograd.grad(out, leaves + ([sink_leaf] if sink is not None else []), dout)
    for name, got, ref in zip(("dq", "dk", "dv", "dsink"), got_grads, want_grads):
        assert got.shape == ref.shape and torch.isfinite(got).all(), name
        if name == "dsink":
            check_dsink(got, ref, sink, want, want_lse, dout)
        else:
            assert rel_err(got, ref) < BWD_TOLERANCE[dtype], f"{name}: {rel_err(got, ref):.3e}"


@pytest.mark.gpu
def test_forward_poisoned_outputs_every_row_written():
    """The kernel itself (no allocation by the API): rows that see no key (bottom-right with
    Sq > Sk) and every other row are written, O and LSE, on NaN-filled outputs."""
    from cute_flash import launch_fwd
    from cute_flash.torch_helpers import DENSE_BATCH

    q, k, v, _ = inputs(BF16, 128, 2, 1000, 129, False)
    problem = AttentionProblem.of(True, (100, 0), "bottom_right", 0.0, False, True)
    kernel = launch_fwd.kernel_for(q.dtype, 128, problem, q.device)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    kernel(q, k, v, out, lse, None, *DENSE_BATCH, 1 / math.sqrt(128))
    want, want_lse, _ = reference(q, k, v, None, dict(causal=True, window_size=(100, 0), alignment="bottom_right"))
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)


OTHER_HEAD_DIMS = [(BF16, 16), (FP16, 32), (BF16, 96), (FP16, 192), (BF16, 256), (FP16, 72), (FP16, 128)]
EVERYTHING = dict(causal=True, window_size=(90, 0), alignment="bottom_right", softcap=10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("hd", range(len(OTHER_HEAD_DIMS)), ids=[f"{str(d)[6:]}-D{h}" for d, h in OTHER_HEAD_DIMS])
def test_every_variant_on_the_other_head_dims(hd):
    """GQA + window + bottom-right causal + softcap + sink on the other native tiles (16, 32,
    96, 192, 256), a wider one (72 on the 96 tiles) and fp16 on the 128 tile (its grouped
    softcap backward runs on transposed gradients, launch_bwd.derived_config): forward and
    gradients."""
    dtype, head_dim = OTHER_HEAD_DIMS[hd]
    check_everything(*inputs(dtype, head_dim, 2, 400, 333, True))


def check_everything(q, k, v, sink):
    """EVERYTHING with q, k, v and sink through flash_attention: forward and gradients against
    float64; returns O."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, sink=sink, **EVERYTHING)
    assert out.shape == (*q.shape[:3], v.shape[-1])
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sink, EVERYTHING, dout)
    assert rel_err(out, want) < FWD_TOLERANCE[q.dtype]
    check_lse(lse, want_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
        check_grad(name, got, ref, dout, BWD_TOLERANCE[q.dtype])
    return out.detach()


# (dtype, q's head dim, v's): DeepSeek's pair and one whose value head dim is the wider.
VALUE_PAIRS = [(BF16, 192, 128), (FP16, 64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", range(len(VALUE_PAIRS)), ids=[f"{str(d)[6:]}-D{h}-Dv{v}" for d, h, v in VALUE_PAIRS])
def test_every_variant_with_a_value_head_dim_of_its_own(pair):
    """GQA + window + bottom-right causal + softcap + sink with v's head dim differing from
    q's: forward and gradients, and flash_attn_func on the same problem."""
    dtype, head_dim, value_head_dim = VALUE_PAIRS[pair]
    q, k, _, sink = inputs(dtype, head_dim, 2, 400, 333, True)
    v = inputs(dtype, value_head_dim, 2, 400, 333, False)[2]
    out = check_everything(q, k, v, sink)
    views = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # (B, S, H, D) memory
    same = cute_flash.flash_attn_func(*views, causal=True, window_size=(90, 0), softcap=10.0, learnable_sink=sink)
    assert same.shape == (q.shape[0], q.shape[2], q.shape[1], value_head_dim) and same.is_contiguous()
    assert torch.equal(same.transpose(1, 2), out)


@pytest.mark.gpu
def test_window_and_sink_on_a_wider_tile_forward():
    """D = 96 (fwd native) and D = 200 (on the 256 tile), forward only, with the variants."""
    for head_dim in (96, 200):
        q, k, v, sink = inputs(FP16, head_dim, 2, 333, 777, True)
        kwargs = dict(window_size=(50, 20), softcap=8.0)
        out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, sink=sink, **kwargs)
        want, want_lse, _ = reference(q, k, v, sink, kwargs)
        assert rel_err(out, want) < FWD_TOLERANCE[FP16]
        check_lse(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(), dict(window_size=(300, 40))], ids=["full", "window"])
@pytest.mark.parametrize("waves", [2, 0], ids=["planned", "one-unit-ahead"])
def test_grouped_backward_prepares_later_units_in_the_main_kernel(kwargs, waves):
    """GQA (48 query heads on 12 key/value heads, batch 3) with the in-kernel preprocess: the
    preprocess kernel prepares the first units' query heads, the main kernel's idle warps the
    rest, one query head per preparing CTA (Sq 1001: not a multiple of the passes)."""
    from cute_flash import launch_bwd
    from cute_flash.config import get_config

    q, k, v, _ = inputs(BF16, 128, 12, 1001, 900, False, batch=3, heads=48)
    problem = AttentionProblem.of(False, kwargs.get("window_size", (-1, -1)), grouped=True)
    config = get_config("bfloat16", 128, False, "bwd", q.device, seqlens=(1001, 900))
    assert config.fused_preprocess  # the shipped entry: the test would not see the main kernel prepare
    prep_ahead, prep_ctas = launch_bwd.prepare_ahead_plan(config, None, problem, 3, 12, 900, 132, None, True, waves, 4)
    assert prep_ahead < 36 and prep_ctas % 4 == 0
    scale = 1 / math.sqrt(128)
    out, lse = cute_flash.flash_attention(q, k, v, softmax_scale=scale, return_lse=True, **kwargs)
    dout = torch.randn_like(out)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    got = launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config=config, grads=grads,
                                          prep_ahead_waves=waves)
    _, _, want = reference(q, k, v, None, dict(kwargs, softmax_scale=scale), dout)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all() and rel_err(g, w) < BWD_TOLERANCE[BF16], f"{name}: {rel_err(g, w):.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    dict(), dict(causal=True), dict(causal=True, alignment="bottom_right"),
    dict(causal=True, window_size=(100, 0), alignment="bottom_right"), dict(window_size=(30, 50)),
    dict(softcap=6.0, window_size=(-1, 0), alignment="bottom_right"),
], ids=["full", "causal-top-left", "causal", "window", "window-top-left", "softcap"])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("sk", [1, 77, 1000])
def test_decode_packs_the_group_into_one_tile(kwargs, kv_heads, sk):
    """Sq = 1 with grouped heads runs packed (the group's query heads as a tile's rows, the
    mask as a key range): forward and gradients against float64."""
    from cute_flash import api

    batch = -(-api.PACKED_DECODE_MIN_UNITS // kv_heads)
    q, k, v, _ = inputs(BF16, 128, kv_heads, 1, sk, False, batch=batch, heads=8)
    assert api._packs_query_heads(q, k, v, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, **kwargs)
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, None, kwargs, dout)
    assert out.shape == q.shape and rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
        check_grad(name, got, ref, dout, BWD_TOLERANCE[BF16])


@pytest.mark.gpu
def test_the_ops_run_a_banded_group_as_rows_too(monkeypatch):
    """torch.compile's path (the custom ops) takes the eager entry point's rule: the forward op
    runs a banded grouped prefill with the group as each tile's rows; forward, LSE and
    gradients (the backward op's grouped problem on that O and LSE) against float64."""
    from cute_flash import compile_fwd

    problems = []
    get_forward = compile_fwd.get_forward
    monkeypatch.setattr(compile_fwd, "get_forward", lambda *a, **kw: problems.append(a[2]) or get_forward(*a, **kw))
    kwargs = dict(causal=True, window_size=(100, 0), alignment="bottom_right", softcap=5.0)
    q, k, v, sinks = inputs(BF16, 64, 2, 300, 333, True, heads=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step(q, k, v, sink):
        return cute_flash.flash_attention(q, k, v, return_lse=True, sink=sink, **kwargs)

    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves, sinks)
    assert [p.row_heads for p in problems] == [4]
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sinks, kwargs, dout)
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
        check_grad(name, got, ref, dout, BWD_TOLERANCE[BF16])


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    dict(causal=True, alignment="bottom_right"), dict(causal=True),
    dict(softcap=6.0, window_size=(40, 0), alignment="bottom_right"), dict(window_size=(30, 3)),
], ids=["causal", "causal-top-left", "window-softcap", "window-top-left"])
@pytest.mark.parametrize("sq, sk", [(2, 1000), (5, 77), (16, 300), (7, 3)])
@pytest.mark.parametrize("layout", ["bnsd", "bsnd"])
def test_a_few_positions_run_the_group_as_rows(kwargs, sq, sk, layout):
    """2 .. 16 query positions with grouped heads: a key/value head's group
    at every position runs as one tile's rows (problem.grouped_rows), O and the LSE written in
    the caller's layout; every element against float64, outputs from NaN-filled memory."""
    from cute_flash import api

    kv_heads = 2
    batch = -(-api.PACKED_DECODE_MIN_UNITS // kv_heads)
    q, k, v, _ = inputs(BF16, 128, kv_heads, sq, sk, False, batch=batch, heads=8)
    if layout == "bsnd":  # flash-attn's memory layout: q's rows are one copy
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert api._groups_query_rows(q, k, v, None)
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
    problem = api.AttentionProblem.of(kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                                      kwargs.get("alignment", "top_left"), kwargs.get("softcap", 0.0),
                                      grouped_rows=True)
    assert any(plan.problem == problem for plan in api._plans.values()), "the grouped-rows plan ran"
    want, want_lse, _ = reference(q, k, v, None, kwargs)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)
    assert (out[~torch.isfinite(want_lse)] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(causal=True, alignment="bottom_right"),
                                    dict(softcap=6.0, window_size=(40, 0), alignment="bottom_right")],
                         ids=["causal", "window-softcap"])
@pytest.mark.parametrize("sq, sk", [(1, 1000), (4, 300), (16, 5)])
def test_grouped_rows_take_each_query_heads_sink(kwargs, sq, sk):
    """With a sink, 1 .. 16 positions with grouped heads run as grouped rows too (the Sq = 1
    packing takes no sinks): each row's denominator takes its own query head's sink."""
    from cute_flash import api

    kv_heads = 2
    batch = -(-api.PACKED_DECODE_MIN_UNITS // kv_heads)
    q, k, v, sink = inputs(BF16, 128, kv_heads, sq, sk, True, batch=batch, heads=8)
    sink = sink * 3  # sinks that matter beside the scores
    assert api._groups_query_rows(q, k, v, sink) and not api._packs_query_heads(q, k, v, sink)
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, sink=sink, **kwargs)
    want, want_lse, _ = reference(q, k, v, sink, kwargs)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)


# (dtype, head dim, query heads, kv heads, Sq, Sk, keyword arguments, sink): prefill with
# grouped heads and a band, whose group runs as each tile's rows (api._heads_in_rows): groups of 2 to 8
# on the three-warpgroup (D = 64) and two-warpgroup (D = 128) tiles, Sq != Sk both ways, tails,
# both alignments, a right window, softcap and sinks.
HEADS_IN_ROWS = [
    (BF16, 64, 16, 2, 1000, 1000, dict(causal=True, window_size=(127, 0)), True),
    (FP16, 64, 8, 2, 17, 700, dict(causal=True, window_size=(50, 0), alignment="bottom_right"), False),
    (BF16, 128, 8, 2, 777, 300, dict(window_size=(60, 20), alignment="bottom_right", softcap=10.0), True),
    (FP16, 128, 16, 4, 513, 513, dict(window_size=(200, 0), softcap=8.0), False),
    (BF16, 96, 12, 6, 300, 1000, dict(window_size=(0, 64)), True),
    (BF16, 256, 4, 2, 1000, 129, dict(causal=True, alignment="bottom_right"), False),
    (FP16, 192, 8, 1, 200, 200, dict(causal=True), True),
]


def test_heads_in_rows_takes_banded_grouped_prefill_only():
    """The host's rule (api._heads_in_rows, shapes and dtypes only): grouped heads, a band
    (causal or a window), more than GROUPED_ROWS_MAX_SQ positions, 16-bit, a group dividing 64."""
    from cute_flash import api
    from cute_flash.kernels.problem import GROUPED_ROWS_MAX_SQ

    def takes(heads=8, kv_heads=2, sq=300, causal=True, window=(-1, -1), dtype=BF16, v_heads=None):
        q = torch.empty(1, heads, sq, 64, dtype=dtype, device="meta")
        k = torch.empty(1, kv_heads, 500, 64, dtype=dtype, device="meta")
        v = torch.empty(1, v_heads or kv_heads, 500, 64, dtype=dtype, device="meta")
        return api._heads_in_rows(q, k, v, causal, window)

    assert takes() and takes(causal=False, window=(127, 0)) and takes(causal=False, window=(-1, 5))
    assert takes(heads=64, kv_heads=1) and takes(dtype=FP16) and takes(sq=GROUPED_ROWS_MAX_SQ + 1)
    assert not takes(causal=False)  # no band: measured no gain (perf/NOTES.md, thirty-eighth session)
    assert not takes(kv_heads=8)  # MHA
    assert not takes(heads=12, kv_heads=4)  # a group of 3 divides no 128-row tile
    assert not takes(sq=GROUPED_ROWS_MAX_SQ)  # grouped rows / packed decode steps take those
    assert not takes(dtype=torch.float32)
    assert not takes(v_heads=4)  # v's heads differ from k's: refused later, not packed here


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(HEADS_IN_ROWS)), ids=[
    f"{str(c[0])[6:]}-D{c[1]}-{c[2]}over{c[3]}-{c[4]}x{c[5]}" for c in HEADS_IN_ROWS])
def test_a_banded_group_runs_as_each_tiles_rows(case):
    """Prefill with grouped heads and a band (causal or a window) runs the group's query heads as a tile's
    rows (problem.row_heads: each tile's keys follow block_m / G positions): forward, LSE
    and gradients (the backward runs the ordinary grouped kernels on its O and LSE)."""
    from cute_flash import api

    dtype, head_dim, heads, kv_heads, sq, sk, kwargs, sink = HEADS_IN_ROWS[case]
    q, k, v, sinks = inputs(dtype, head_dim, kv_heads, sq, sk, sink, heads=heads)
    assert api._heads_in_rows(q, k, v, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, sink=sinks, **kwargs)
    assert any(plan.problem.row_heads == heads // kv_heads for plan in api._plans.values())
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sinks, kwargs, dout)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert (out[~torch.isfinite(want_lse)] == 0).all()
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    check_lse(lse, want_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
        check_grad(name, got, ref, dout, BWD_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    dict(causal=True, alignment="bottom_right"), dict(causal=True),
    dict(softcap=6.0, window_size=(8500, 0), alignment="bottom_right"), dict(window_size=(-1, 40)),
], ids=["causal", "causal-top-left", "window-softcap", "right-window"])
@pytest.mark.parametrize("sq, kv_heads, sink", [(1, 2, False), (1, 8, False), (1, 1, True), (4, 2, False),
                                                (16, 4, True)])
def test_decode_steps_with_few_units_split_their_keys(kwargs, sq, kv_heads, sink):
    """Few (batch, key/value head) units over a long key range, no gradients: the step's keys
    are walked in parts (problem.split_keys over a dense batch's keys, grouped rows) and merged
    (kernels/split_merge.py); every element against float64 (top-left causal leaves all but
    the first part without keys: empty parts weigh 0), outputs from NaN-filled memory."""
    from cute_flash import api

    sk = 9000  # beyond kvcache.SPLIT_MIN_CACHE, a tail of 40 keys past 70 blocks
    q, k, v, sinks = inputs(BF16, 128, kv_heads, sq, sk, sink, batch=1, heads=8)
    if sink:
        sinks = sinks * 3
    assert api._split_parts(q, k, v, kwargs.get("window_size", (-1, -1))) > 1
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, sink=sinks, **kwargs)
    assert any(plan.splits > 1 for plan in api._plans.values()), "the split plan ran"
    want, want_lse, _ = reference(q, k, v, sinks, kwargs)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)
    # Deterministic for a fixed split count, and equal to the unsplit step within rounding.
    again, again_lse = cute_flash.flash_attention(q, k, v, return_lse=True, sink=sinks, **kwargs)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.gpu
def test_a_captured_split_decode_step_replays_as_the_eager_one():
    """Under CUDA graph capture the step splits from a shorter key range (kvcache's captured
    rule): the replayed graph's output against float64, the merge launched inside the graph."""
    from cute_flash import api
    from cute_flash.kvcache import SPLIT_MIN_CACHE, SPLIT_MIN_CACHE_CAPTURED

    sk = (SPLIT_MIN_CACHE_CAPTURED + SPLIT_MIN_CACHE) // 2  # split only when captured
    q, k, v, _ = inputs(BF16, 128, 2, 1, sk, False, batch=1, heads=8)
    kwargs = dict(causal=True, alignment="bottom_right")
    assert api._split_parts(q, k, v, (-1, -1)) == 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cute_flash.flash_attention(q, k, v, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_flash.flash_attention(q, k, v, **kwargs)
    assert any(plan.splits > 1 for plan in api._plans.values()), "the capture split the step"
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _, _ = reference(q, k, v, None, kwargs)
    assert torch.isfinite(out).all() and rel_err(out, want) < FWD_TOLERANCE[BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("sq, sk", [(3, 500), (16, 77)])
def test_grouped_rows_forward_with_gradients(sq, sk):
    """With gradients the forward still runs the group as rows; the backward runs the ordinary
    grouped kernels on its O and LSE: gradients of q, k, v and the sink against float64."""
    from cute_flash import api

    kv_heads = 2
    batch = -(-api.PACKED_DECODE_MIN_UNITS // kv_heads)
    kwargs = dict(causal=True, window_size=(60, 0), alignment="bottom_right", softcap=8.0)
    q, k, v, sink = inputs(BF16, 128, kv_heads, sq, sk, True, batch=batch, heads=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = cute_flash.flash_attention(*leaves[:3], return_lse=True, sink=leaves[3], **kwargs)
    assert any(plan.problem.grouped_rows for plan in api._plans.values())
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sink, kwargs, dout)
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)
    *got, got_dsink = torch.autograd.grad(out, leaves, dout)
    for name, g, ref in zip(("dq", "dk", "dv"), got, want_grads):
        check_grad(name, g, ref, dout, BWD_TOLERANCE[BF16])
    check_dsink(got_dsink, want_grads[3], sink, want, want_lse, dout)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [0.0, 8.0])
def test_grouped_window_backward_is_deterministic(softcap):
    """Bitwise the same gradients twice, with a softcap too (at D = 128 with GQA its backward
    runs on transposed gradients: launch_bwd.derived_config)."""
    q, k, v, _ = inputs(BF16, 128, 2, 700, 900, False)
    kwargs = dict(causal=True, window_size=(200, 0), alignment="bottom_right", deterministic=True, softcap=softcap)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cute_flash.flash_attention(*leaves, **kwargs)
        runs.append(torch.autograd.grad(out.float().square().sum(), leaves))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_flash_attn_func_is_flash_attention_on_transposed_views():
    """flash-attn's layout (B, S, H, D) and conventions (bottom-right), the same kernels."""
    q, k, v, sink = inputs(BF16, 64, 2, 200, 500, True)
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, S, H, D) memory
    out, lse = cute_flash.flash_attn_func(qs, ks, vs, causal=True, window_size=(64, 0), softcap=3.0,
                                          learnable_sink=sink, return_lse=True)
    same, same_lse = cute_flash.flash_attention(q, k, v, causal=True, window_size=(64, 0), softcap=3.0, sink=sink,
                                                alignment="bottom_right", return_lse=True)
    assert out.shape == qs.shape
    assert torch.equal(out.transpose(1, 2), same) and torch.equal(lse, same_lse)


# A softcap's forward with two consumer warpgroups (D = 128) hands the transform to the
# softmax in unmasked blocks: the row maximum over raw scores, a quarter of exp2 on the FMA pipe
# (kernels/ptx.exp2_fma, whose exponents below -125 clamp: reached at c = 50). Scores far below
# -c (softcap_inputs) saturate tanh; Sq > Sk bottom-right leaves rows that see no key.
# bf16 caps up to 65 run without a running maximum (kernels/softmax.py's bounded scores), 65
# at the edge of that range; fp16 and larger caps keep the maximum.
SOFTCAP_CASES = [(BF16, 30.0), (BF16, 50.0), (BF16, 65.0), (BF16, 70.0), (FP16, 30.0)]


def softcap_inputs(dtype, far_below, sq=1000, sk=700, heads=4, head_dim=128):
    """far_below: keys spread 1.0 around one direction, queries opposite: at D = 128 every score
    s * scale lies below -2c at c = 30 (1 - t^2 < 0.06) and below -0.9c at 70. The spread keeps
    dq well conditioned: dq_i = sum_j dS_ij k_j, where sum_j dS_ij = 0, so each key's common
    part cancels and the spread is what remains. At a spread of 0.1 the arithmetic every 16-bit
    kernel shares (16-bit O and dS, the SFU's tanh) left dq and dk 1.1-7x the error of rounding
    O and dS alone: up to 3.5e-2 in fp16 and 4.5e-2 in bf16, against 0.65-2.5 for torch's own
    attention in those dtypes (perf/NOTES.md, seventieth session)."""
    if not far_below:
        return [torch.randn(2, heads, s, head_dim, device="cuda", dtype=dtype) * 2 for s in (sq, sk, sk)]
    base = torch.randn(head_dim, device="cuda")
    k = base + torch.randn(2, heads, sk, head_dim, device="cuda")
    q = -10 * base + 0.1 * torch.randn(2, heads, sq, head_dim, device="cuda")
    return [q.to(dtype), k.to(dtype), torch.randn(2, heads, sk, head_dim, device="cuda", dtype=dtype)]


@pytest.mark.gpu
@pytest.mark.parametrize("far_below", [False, True], ids=["random", "far-below-cap"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal-bottom-right", "full"])
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=[f"{str(d)[6:]}-c{c:g}" for d, c in SOFTCAP_CASES])
def test_softcap_extremes(case, causal, far_below):
    dtype, softcap = case
    kwargs = dict(causal=True, alignment="bottom_right", softcap=softcap) if causal else dict(softcap=softcap)
    q, k, v = softcap_inputs(dtype, far_below)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, **kwargs)
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, None, kwargs, dout if causal else None)
    assert torch.isfinite(out).all() and (out[~torch.isfinite(want_lse)] == 0).all()
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    check_lse(lse, want_lse)
    if causal:
        for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
            check_grad(name, got, ref, dout, BWD_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [30.0, 50.0, 70.0])
def test_softcap_rows_that_see_one_key_return_its_value_exactly(softcap):
    """Causal top-left: query 0 sees key 0 alone, so O's row is v's, bit for bit, and its dq is
    0. Without a running maximum (bf16 caps up to 65) the row's one probability is not 1 and
    its bf16 rounding in P V does not cancel against the float32 row sum; O is divided by the
    sum of the rounded probabilities instead (a version without that gave O = v (1 + up to
    2^-9) and dq 1.6e-3 of dO, perf/NOTES.md twenty-first session)."""
    q, k, v = softcap_inputs(BF16, False, sq=300, sk=300)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cute_flash.flash_attention(*leaves, causal=True, softcap=softcap)
    assert torch.equal(out[:, :, 0], v[:, :, 0])
    dout = torch.randn_like(out)
    dq, _, _ = torch.autograd.grad(out, leaves, dout)
    assert dq[:, :, 0].float().abs().max().item() <= 1e-5 * dq.float().abs().max().item()


@pytest.mark.gpu
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(variant=st.integers(0, len(VARIANTS) - 1), hd=st.integers(0, len(HEAD_DIMS) - 1),
       b=st.integers(1, 2), sq=st.integers(1, 600), sk=st.integers(1, 600),
       layout=st.sampled_from(["bnsd", "bsnd"]), scale=st.one_of(st.none(), st.floats(0.02, 0.5)))
def test_fuzz_variants(variant, hd, b, sq, sk, layout, scale):
    """Random shapes, layouts and scales over the variants' kernels (the same problems as
    above: their kernels compile once), forward and gradients against float64."""
    dtype, head_dim = HEAD_DIMS[hd]
    _, kwargs, kv_heads = VARIANTS[variant]
    kwargs = dict(kwargs)
    q, k, v, sink = inputs(dtype, head_dim, kv_heads, sq, sk, kwargs.pop("sink", False), batch=b)
    if layout == "bsnd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention(*leaves, softmax_scale=scale, return_lse=True, sink=sink, **kwargs)
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sink, dict(kwargs, softmax_scale=scale), dout)
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    check_lse(lse, want_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
        check_grad(name, got, ref, dout, 2 * BWD_TOLERANCE[dtype])


# ---- clusters of query heads (TileConfig.cluster_heads: two query heads of a group per
# thread-block cluster, each CTA loading half of every K / V stage into both) ----

# (id, kwargs, query heads per K/V head, Sq, Sk): tails, Sq != Sk both ways, one row.
CLUSTER_CASES = [
    ("causal-bottom-right", dict(causal=True, alignment="bottom_right"), 4, 17, 1000),
    ("causal-top-left", dict(causal=True), 2, 1000, 129),
    ("full", dict(), 8, 300, 300),
    ("everything", dict(causal=True, window_size=(90, 0), alignment="bottom_right", softcap=10.0, sink=True), 2,
     1000, 1000),
    ("one-row", dict(causal=True, alignment="bottom_right"), 4, 1, 8191),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(CLUSTER_CASES)), ids=[c[0] for c in CLUSTER_CASES])
@pytest.mark.parametrize("hd", range(len(HEAD_DIMS)), ids=[f"{str(d)[6:]}-D{h}" for d, h in HEAD_DIMS])
def test_clusters_of_query_heads_match_the_reference(hd, case):
    """The forward compiled with cluster_heads 2 on any entry (the bf16 D = 128 ones ship it;
    fp16 D = 64's 192-row tiles too here), launched directly on NaN-poisoned outputs: every
    element of O and the LSE against float64."""
    from cute_flash import compile_fwd
    from cute_flash.config import get_config
    from cute_flash.torch_helpers import DENSE_BATCH, TORCH_DTYPE_NAMES

    dtype, head_dim = HEAD_DIMS[hd]
    _, kwargs, group, sq, sk = CLUSTER_CASES[case]
    kwargs = dict(kwargs)
    heads = 2 * group
    q, k, v, sink = inputs(dtype, head_dim, 2, sq, sk, kwargs.pop("sink", False), heads=heads)
    problem = AttentionProblem.of(kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                                  kwargs.get("alignment", "top_left"), kwargs.get("softcap", 0.0), sink is not None,
                                  grouped=True)
    config = dataclasses.replace(get_config(TORCH_DTYPE_NAMES[dtype], head_dim, problem.causal, "fwd", q.device),
                                 cluster_heads=2)
    kernel = compile_fwd.get_forward(TORCH_DTYPE_NAMES[dtype], head_dim, problem, config)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device="cuda")
    scale = head_dim ** -0.5
    kernel(q, k, v, out, lse, sink, *DENSE_BATCH, scale)
    want, want_lse, _ = reference(q, k, v, sink, dict(kwargs, softmax_scale=scale))
    assert torch.isfinite(out).all()
    empty = ~torch.isfinite(want_lse)
    assert (out[empty] == 0).all()
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    check_lse(lse, want_lse)


@pytest.mark.gpu
def test_the_host_runs_clusters_of_query_heads_on_grouped_grids(monkeypatch):
    """With the wave threshold at 0 the shipped bf16 D = 128 entry's clusters run in
    flash_attention (GQA, forward and gradients) and in a prefill over a KV cache (when they
    apply: tests/test_config.py)."""
    from cute_flash import config as config_module
    from cute_flash.config import get_config, heads_clustered
    from test_kvcache import cache_inputs, check_against_reference

    monkeypatch.setattr(config_module, "CLUSTER_MIN_WAVES", 0)
    # (The entry for these lengths: S <= 5792.)
    entry = get_config("bfloat16", 128, True, "fwd", torch.device("cuda"), seqlens=(777, 901))
    assert entry.cluster_heads == 2, "the shipped entry has clusters (else this test tests nothing)"
    assert heads_clustered(entry, AttentionProblem.of(True, grouped=True), 2, 12, 3, 777, 132).cluster_heads == 2

    q, k, v, _ = inputs(BF16, 128, 3, 777, 901, False, batch=2, heads=12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=True, alignment="bottom_right")
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, **kwargs)
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, None, kwargs, dout)
    assert rel_err(out, want) < FWD_TOLERANCE[BF16]
    check_lse(lse, want_lse)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), want_grads):
        assert rel_err(got, ref) < BWD_TOLERANCE[BF16], name

    q, k_cache, v_cache, _, _ = cache_inputs(3, 333, 16, 4, 128, 3, 1500, BF16)
    lengths = [1500, 1000, 333]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                  return_softmax_lse=True)
    check_against_reference(out, lse, q, k_cache, v_cache, lengths, [0, 1, 2], BF16, causal=True)


# (dtype, Sq, Sk): tails, Sq != Sk both ways; more than 128 query rows, so that rows_fitted keeps
# three warpgroups, and max(Sq, Sk) above 5792, where D = 128's S = 8192 entries serve.
THREE_WARPGROUP_SHAPES = [(BF16, 300, 6000), (FP16, 6000, 129), (BF16, 129, 8191)]
# The entries' three-warpgroup tiles for long sequences: (warpgroups, key block) by head dim.
THREE_WARPGROUP_TILES = {64: (3, 128), 96: (3, 112), 128: (3, 80)}


# A softcap's own key block (TileConfig.softcap_block_n) by (dtype, head dim, causal entry).
SOFTCAP_THREE_WARPGROUP_TILES = {
    (torch.float16, 64, False): (3, 80), (torch.float16, 64, True): (3, 112),
    (torch.bfloat16, 64, False): (3, 112), (torch.bfloat16, 64, True): (3, 112),
    (torch.float16, 96, False): (3, 96), (torch.float16, 96, True): (3, 96),
    (torch.bfloat16, 96, False): (3, 96), (torch.bfloat16, 96, True): (3, 96),
}


def long_sequence_tile(head_dim, kwargs, dtype):
    """(warpgroups, key block) of the tile a call with these keyword arguments runs on long
    sequences without grid_fitted: the entry's three-warpgroup tile (with a softcap, its own
    key block where it has one), or where the band is narrow on K / V rows as short as D = 64's,
    one warpgroup (config.band_fitted)."""
    from cute_flash.config import TileConfig, band_fitted

    problem = AttentionProblem.of(kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                                  kwargs.get("alignment", "top_left"))
    entry = TileConfig(192, 128, 2, 3, True)
    if band_fitted(entry, problem, head_dim * 2) is not entry:
        return (1, 128)
    if kwargs.get("softcap"):
        return SOFTCAP_THREE_WARPGROUP_TILES.get((dtype, head_dim, problem.causal), THREE_WARPGROUP_TILES[head_dim])
    return THREE_WARPGROUP_TILES[head_dim]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", range(len(THREE_WARPGROUP_SHAPES)),
                         ids=[f"{str(d)[6:]}-{a}x{b}" for d, a, b in THREE_WARPGROUP_SHAPES])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("head_dim", sorted(THREE_WARPGROUP_TILES), ids=lambda d: f"d{d}")
def test_three_warpgroup_tiles_run_every_variant(entry_tiles_on_every_grid, head_dim, variant, shape):
    """The entries' tiles for long sequences (three consumer warpgroups: D = 64 on 128-key
    blocks, D = 96 on 112, D = 128 on 80; with a softcap some on their own key block,
    SOFTCAP_THREE_WARPGROUP_TILES; on grids of many tiles:
    config.grid_fitted, off here; D = 64's narrow bands on one warpgroup) through
    flash_attention, every variant, forward and gradients against float64."""
    dtype, sq, sk = THREE_WARPGROUP_SHAPES[shape]
    _, kwargs, kv_heads = VARIANTS[variant]
    kwargs = dict(kwargs)
    q, k, v, sink = inputs(dtype, head_dim, kv_heads, sq, sk, kwargs.pop("sink", False))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_() if sink is not None else None
    out, lse = cute_flash.flash_attention(*leaves, return_lse=True, sink=sink_leaf, **kwargs)
    ran = entry_tiles_on_every_grid[-1]
    assert (ran.num_mma_warpgroups, ran.block_n) == long_sequence_tile(head_dim, kwargs, dtype), (
        f"the call ran {ran}, not the three-warpgroup tile (or a narrow band's)")
    dout = torch.randn_like(out)
    want, want_lse, want_grads = reference(q, k, v, sink, kwargs, dout)
    assert torch.isfinite(out).all() and (out[~torch.isfinite(want_lse)] == 0).all()
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    check_lse(lse, want_lse)
    got_grads = torch.autograd.grad(out, leaves + ([sink_leaf] if sink is not None else []), dout)
    for name, got, ref in zip(("dq", "dk", "dv", "dsink"), got_grads, want_grads):
        if name == "dsink":
            check_dsink(got, ref, sink, want, want_lse, dout)
        else:
            check_grad(name, got, ref, dout, BWD_TOLERANCE[dtype])


# (dtype, page size (0: contiguous), new rows, query heads, kv heads, variant): pages of 16 to 256
# rows against 80-key blocks (TMA boxes of gcd(page, 80) = 16 rows), GQA with and without
# clusters of query heads, a window with softcap and a sink.
THREE_WARPGROUP_CACHES = [
    (BF16, 0, 200, 8, 2, dict(causal=True)),
    (FP16, 16, 150, 8, 8, dict(causal=True)),
    (BF16, 64, 333, 8, 2, dict(causal=True)),
    (BF16, 256, 129, 4, 1, dict(causal=True, window_size=(100, 0), softcap=10.0, sink=True)),
    (FP16, 128, 200, 8, 4, dict()),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, page_size, new, heads, kv_heads, variant", THREE_WARPGROUP_CACHES)
def test_three_warpgroups_on_80_key_blocks_over_a_cache(entry_tiles_on_every_grid, dtype, page_size, new, heads,
                                                        kv_heads, variant):
    """A prefill over a KV cache on D = 128's three-warpgroup tile: appends land in their slots,
    slots past the lengths hold NaN and never reach the output (the first key block's stale
    rows zeroed across 80 rows by 384 consumer threads: kernels/stale_keys.py), against
    float64."""
    from test_kvcache import cache_inputs, check_against_reference, paged_caches

    cache_len = 6144  # (above 5792: the S = 8192 entries serve)
    q, k_cache, v_cache, k, v = cache_inputs(3, new, heads, kv_heads, 128, 3, cache_len, dtype, new=new)
    lengths = [0, 77, cache_len - new - 5]
    for b, n in enumerate(lengths):
        k_cache[b, n + new:] = float("nan")
        v_cache[b, n + new:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    variant = dict(variant)
    sink = torch.randn(heads, device="cuda") if variant.pop("sink", False) else None
    kc, vc, table = k_cache.clone(), v_cache.clone(), None
    if page_size:
        kc, vc, table = paged_caches(kc, vc, page_size, 3, seed=3)
    out, lse = cute_flash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                  learnable_sink=sink, return_softmax_lse=True, **variant)
    assert any((c.num_mma_warpgroups, c.block_n) == (3, 80) for c in entry_tiles_on_every_grid), (
        f"no call ran the three-warpgroup tile: {entry_tiles_on_every_grid}")
    for b, n in enumerate(lengths):
        k_cache[b, n:n + new], v_cache[b, n:n + new] = k[b], v[b]
    check_against_reference(out, lse, q, k_cache, v_cache, [n + new for n in lengths], range(3), dtype, sink=sink,
                            **variant)


def prewarm(jobs: int = 14, softcap_only: bool = False):
    """Compile every kernel set the GPU tests above use (softcap_only: those of a softcap),
    in parallel worker processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cute_flash.config import get_config, tile_head_dim, tile_head_dims
    from cute_flash.launch_bwd import _tile_and_config, derived_config
    from cute_flash.precompile import Task, _run_task, forward_tasks

    device = torch.device("cuda")
    tasks = set()
    cases = [(dtype, hd, kw, kv) for (dtype, hd) in HEAD_DIMS for (_, kw, kv) in VARIANTS]
    cases += [(FP16, 96, dict(window_size=(50, 20), softcap=8.0, sink=True), 2)]  # 200: compiled by the test
    cases += [(BF16, 128, dict(causal=True, window_size=(200, 0), alignment="bottom_right"), 2)]
    cases += [(BF16, 128, dict(window_size=(300, 40)), 2)]
    cases += [(dtype, 128, dict(causal=True, alignment="bottom_right", softcap=c), 4)
              for dtype, c in SOFTCAP_CASES]
    cases += [(dtype, 128, dict(softcap=c), 4) for dtype, c in SOFTCAP_CASES]
    cases += [(dtype, d, dict(EVERYTHING, sink=True), 2) for dtype, d in OTHER_HEAD_DIMS if d in (16, 32, 96, 192, 256)]
    for dtype, head_dim, value_head_dim in VALUE_PAIRS:
        name = {FP16: "float16", BF16: "bfloat16"}[dtype]
        problem = AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True)
        tiles = tile_head_dims(name, head_dim, value_head_dim, "fwd", device)
        config = get_config(name, tiles[0], True, "fwd", device, value_head_dim=tiles[1])
        tasks.add(Task("fwd", name, head_dim, problem, config, value_head_dim=value_head_dim, tiles=tiles))
        tile, value_tile, config = _tile_and_config(name, head_dim, value_head_dim, problem, None, device, False)
        tasks.add(Task("bwd", name, head_dim, problem, config, value_head_dim=value_head_dim,
                       tiles=(tile, value_tile)))
    for dtype, head_dim, kwargs, kv_heads in cases:
        kwargs = dict(kwargs)
        sink = kwargs.pop("sink", False)
        name = {FP16: "float16", BF16: "bfloat16"}[dtype]
        problem = AttentionProblem.of(kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                                      kwargs.get("alignment", "top_left"), kwargs.get("softcap", 0.0), sink,
                                      kv_heads != 4)
        tile = tile_head_dim(name, head_dim, "fwd", device)
        tasks.update(forward_tasks(name, head_dim, problem, get_config(name, tile, problem.causal, "fwd", device)))
        if head_dim in (16, 32, 64, 128):
            tile = tile_head_dim(name, head_dim, "bwd", device)
            config = get_config(name, tile, problem.causal, "bwd", device)
            for deterministic in (False, True):
                tasks.add(Task("bwd", name, head_dim, problem,
                               derived_config(config, name, problem, tile, head_dim, deterministic)))
    if softcap_only:
        tasks = {task for task in tasks if task.problem.softcap}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for task, (count, seconds) in zip(tasks, pool.map(_run_task, tasks, ["sm_90a"] * len(tasks))):
            print(f"{task.label()} {task.problem}: {count} compiled in {seconds:.0f} s", flush=True)


if __name__ == "__main__" and "--prewarm" in sys.argv:
    prewarm(softcap_only="--softcap-only" in sys.argv)

