"""cute_flash.work_buffers: the backward's work buffers and float32's operand copies kept between
calls of one thread on one stream. CPU: the size rule and the bound on kept sets (with the CUDA queries stubbed). GPU:
a reused set gives the gradients a fresh set gives, bitwise, after a call on other inputs;
other streams, other threads, graph captures and kept deltas never share a set."""

import threading

import pytest
import torch

import cute_flash
from cute_flash import launch_bwd, work_buffers


@pytest.fixture
def fake_cuda(monkeypatch):
    """work_set's CUDA queries stubbed: not capturing, stream 7 current; new_set gives markers."""
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    made = []

    def new_set(rows, accum_tile, device):
        made.append(object())
        return (made[-1],)

    monkeypatch.setattr(work_buffers, "new_set", new_set)
    monkeypatch.setattr(work_buffers, "_sets", type(work_buffers._sets)())
    return made


class _Device:
    index = 0


def test_set_bytes_counts_rows_accumulator_and_counters():
    assert work_buffers.set_bytes((2, 3, 128), 64) == 4 * 2 * 3 * (128 * 66 + 2)
    assert work_buffers.set_bytes((1, 16, 1024), 0) == 4 * 16 * (1024 * 2 + 2)


def test_a_set_is_reused_for_the_same_shapes_and_kept_sets_are_bounded(fake_cuda):
    first = work_buffers.work_set((1, 2, 128), 64, _Device)
    assert work_buffers.work_set((1, 2, 128), 64, _Device) is first
    assert work_buffers.work_set((1, 2, 128), 0, _Device) is not first  # other shapes, other set
    for rows in range(256, 256 * (work_buffers.MAX_SETS + 2), 256):
        work_buffers.work_set((1, 2, rows), 64, _Device)
    assert len(work_buffers._sets) == work_buffers.MAX_SETS
    assert work_buffers.work_set((1, 2, 128), 64, _Device) is not first  # dropped as least recently used


def test_kept_sets_are_bounded_in_bytes_together(fake_cuda):
    """At most MAX_KEPT_BYTES are kept (least recently used sets dropped first), each set up to
    MAX_SET_BYTES: (1, 16, 2048) rows with a 128-column accumulator, 17 MiB, are kept."""
    assert work_buffers.set_bytes((1, 16, 2048), 128) <= work_buffers.MAX_SET_BYTES <= work_buffers.MAX_KEPT_BYTES
    rows_per_set = work_buffers.MAX_SET_BYTES // (4 * 16 * 130)  # (1, 16, rows) sets of just under the bound
    first = work_buffers.work_set((1, 16, rows_per_set), 128, _Device)
    second = work_buffers.work_set((1, 16, rows_per_set - 1), 128, _Device)
    assert work_buffers.work_set((1, 16, rows_per_set), 128, _Device) is first  # first is now the most recent
    held = work_buffers.MAX_KEPT_BYTES // work_buffers.MAX_SET_BYTES
    assert held < work_buffers.MAX_SETS  # the byte bound is the one that drops here
    for i in range(held - 1):
        work_buffers.work_set((1, 16, rows_per_set - 2 - i), 128, _Device)
    assert sum(n for _, n in work_buffers._sets.values()) <= work_buffers.MAX_KEPT_BYTES
    assert len(work_buffers._sets) == held
    assert work_buffers.work_set((1, 16, rows_per_set - 1), 128, _Device) is not second  # dropped
    assert work_buffers.work_set((1, 16, rows_per_set), 128, _Device) is not first  # dropped for it


def test_large_sets_and_unreusable_calls_are_never_kept(fake_cuda):
    rows = (1, 64, 8192)  # 8192 rows x 64 heads x (2 + 128) floats: far above MAX_SET_BYTES
    assert work_buffers.set_bytes(rows, 128) > work_buffers.MAX_SET_BYTES
    work_buffers.work_set(rows, 128, _Device)
    work_buffers.work_set((1, 2, 128), 64, _Device, reusable=False)
    assert not work_buffers._sets and len(fake_cuda) == 2


def test_a_capturing_stream_gets_a_new_set_every_time(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
    assert work_buffers.work_set((1, 2, 128), 64, _Device) is not work_buffers.work_set((1, 2, 128), 64, _Device)
    assert not work_buffers._sets


def test_other_threads_and_streams_get_sets_of_their_own(fake_cuda, monkeypatch):
    mine = work_buffers.work_set((1, 2, 128), 64, _Device)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(work_buffers.work_set((1, 2, 128), 64, _Device)))
    thread.start()
    thread.join()
    assert theirs[0] is not mine
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 8, raising=False)
    assert work_buffers.work_set((1, 2, 128), 64, _Device) is not mine


def test_kept_sets_of_other_uses_are_apart(fake_cuda):
    """kept_set (float32's operand copies use it too): one set per use and shapes."""
    made = []

    def make():
        made.append(object())
        return (made[-1],)

    halves = work_buffers.kept_set(("float32x3h", ((1, 2, 4),)), 64, make, _Device)
    assert work_buffers.kept_set(("float32x3h", ((1, 2, 4),)), 64, make, _Device) is halves
    assert work_buffers.kept_set(("float32", ((1, 2, 4),)), 64, make, _Device) is not halves
    assert work_buffers.work_set((1, 2, 4), 0, _Device) is not halves
    assert work_buffers.kept_set(("float32x3h", ((1, 2, 4),)), work_buffers.MAX_SET_BYTES + 1, make, _Device) \
        is not halves
    assert len(made) == 3 and len(work_buffers._sets) == 3


def _kept():
    """The kept sets as (key, the buffers' addresses): what a later call would be handed."""
    return {key: tuple(t.data_ptr() for t in buffers if isinstance(t, torch.Tensor))
            for key, (buffers, _) in work_buffers._sets.items()}


def _inputs(seed, shape=(1, 4, 300, 64), dtype=torch.bfloat16):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=generator) for _ in range(4)]


def _assert_same_gradients(got, expected):
    """dK and dV bitwise (each written by one CTA, summed in a fixed order); dQ, whose fp32
    partial sums the key blocks' CTAs add in the order they finish, within one rounding of
    its dtype (a set leaking a previous call's values would be far off)."""
    dq, dk, dv = got
    assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])
    bound = expected[0].float().abs() * 2.0 ** -6 + 1e-30
    assert ((dq.float() - expected[0].float()).abs() <= bound).all()


def _grads(q, k, v, dout, causal=True):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = cute_flash.flash_attention(*leaves, causal=causal)
    return torch.autograd.grad(out, leaves, dout)


def _packed_grads(q, k, v, dout, cu_seqlens):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = cute_flash.flash_attention_varlen(*leaves, cu_seqlens, cu_seqlens, longest, longest, causal=True)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_a_reused_set_gives_the_gradients_of_a_fresh_one(causal, monkeypatch):
    work_buffers.release()
    _grads(*_inputs(1), causal=causal)  # leaves its values in the kept set
    kept = _kept()
    assert kept, "a small backward keeps its work buffers"
    second = _inputs(2)
    reused = _grads(*second, causal=causal)
    assert _kept() == kept  # the same set served the second call
    # A fresh set of the same kind: a grid run as one launch runs on a counted set (its counts made
    # zero), whose main kernel prepares the heads; kept sets off, the preprocess would.
    work_buffers.release()
    fresh = _grads(*second, causal=causal)
    assert _kept().keys() == kept.keys()
    _assert_same_gradients(reused, fresh)


@pytest.mark.gpu
def test_packed_batches_reuse_a_set_exactly(monkeypatch):
    work_buffers.release()
    cu_seqlens = torch.tensor([0, 17, 17, 300, 301], dtype=torch.int32, device="cuda")
    first, second = ([t[0].transpose(0, 1).contiguous() for t in _inputs(seed, (1, 4, 301, 64))] for seed in (9, 10))
    _packed_grads(*first, cu_seqlens)
    kept = _kept()
    assert kept
    reused = _packed_grads(*second, cu_seqlens)
    assert _kept() == kept
    monkeypatch.setattr(work_buffers, "MAX_SET_BYTES", 0)
    fresh = _packed_grads(*second, cu_seqlens)
    _assert_same_gradients(reused, fresh)


@pytest.mark.gpu
def test_calls_on_another_stream_use_a_set_of_their_own():
    work_buffers.release()
    inputs = _inputs(3)
    expected = _grads(*inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = _grads(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    assert len(work_buffers._sets) == 2
    _assert_same_gradients(on_stream, expected)


@pytest.mark.gpu
def test_a_backward_whose_delta_is_kept_allocates_its_own():
    """The sink's gradient reads the delta the kernels used: that call's set is not kept."""
    work_buffers.release()
    q, k, v, dout = (t.requires_grad_() for t in _inputs(4))
    sink = torch.randn(q.shape[1], device="cuda", requires_grad=True)
    out = cute_flash.flash_attention(q, k, v, causal=True, sink=sink)
    torch.autograd.grad(out, (q, k, v, sink), dout)
    assert not work_buffers._sets


@pytest.mark.gpu
def test_a_captured_backward_keeps_no_set_and_replays_exactly():
    """Forward and backward captured into a CUDA graph allocate from the graph's pool (no set
    is kept inside the capture); eager calls between replays keep theirs without disturbing
    the graph's."""
    q, k, v, dout = _inputs(5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on a side stream (plans, kernels)
            torch.autograd.grad(cute_flash.flash_attention(*leaves, causal=True), leaves, dout)
    torch.cuda.current_stream().wait_stream(stream)
    work_buffers.release()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.autograd.grad(cute_flash.flash_attention(*leaves, causal=True), leaves, dout)
    assert not work_buffers._sets
    with torch.no_grad():
        for t, fresh in zip((*leaves, dout), _inputs(6)):
            t.copy_(fresh)
    _grads(*_inputs(7))  # an eager call in between, with a kept set of its own
    assert work_buffers._sets
    graph.replay()
    torch.cuda.synchronize()
    expected = _grads(*(t.detach() for t in leaves), dout)
    _assert_same_gradients(captured, expected)


def _out_and_grads(q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = cute_flash.flash_attention(*leaves, causal=True)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


@pytest.mark.gpu
# D = 8, 24 and 72 are narrower than their tiles (16, 64, 128): the copies' padding columns must
# stay zero, also after a call of a wider head dim on the same tile (first_head_dim).
@pytest.mark.parametrize("precision, head_dim, first_head_dim",
                         [("highest", 8, 8), ("highest", 24, 56), ("highest", 72, 80), ("highest", 64, 64),
                          ("high", 40, 40)])
def test_float32_operand_copies_reused_give_the_results_of_fresh_ones(precision, head_dim, first_head_dim,
                                                                      monkeypatch):
    """A float32 call's operand copies (cute_flash.float32.OperandPass.buffers: 3xTF32's, the scaled
    halves' with their partial maxima, TF32's) are kept like the backward's work buffers: after a
    call on other inputs, the output and gradients equal those of fresh copies, bitwise."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        work_buffers.release()
        shape = (1, 4, 300, head_dim)
        _out_and_grads(*_inputs(5, (*shape[:3], first_head_dim), torch.float32))
        _out_and_grads(*_inputs(3, shape, torch.float32))
        kept = _kept()
        assert any(key[3][0] != "backward" for key in kept), "a small float32 call keeps its operand copies"
        second = _inputs(4, shape, torch.float32)
        reused = _out_and_grads(*second)
        assert _kept() == kept
        monkeypatch.setattr(work_buffers, "MAX_SET_BYTES", 0)
        work_buffers.release()
        fresh = _out_and_grads(*second)
        assert not work_buffers._sets
        for a, b in zip(reused, fresh):
            assert torch.equal(a, b)
    finally:
        torch.set_float32_matmul_precision(previous)


def _counted_sets():
    return {key: buffers for key, (buffers, _) in work_buffers._sets.items() if key[3][0] == "backward-counted"}


def _check_against_reference(grads, q, k, v, dout, causal):
    from cute_flash.reference import attention_reference

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = attention_reference(*leaves, causal=causal)
    want = torch.autograd.grad(out, leaves, dout.double())
    for name, got, w in zip("qkv", grads, want):
        # (Relative to at least 1: with one key dQ is 0 up to the rounding of delta.)
        err = ((got.double() - w).norm() / max(w.norm().item(), 1.0)).item()
        assert err < 1e-2, f"d{name}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_launch_backwards_count_on_from_call_to_call(causal):
    """Grids run as one launch (launch_bwd.BackwardPlan.one_launch) launch no preprocess: their counts
    are kept and go on counting. Calls with other key lengths (other totals per call) and
    other inputs share one counted set; each call's gradients match the float64 reference,
    and the counts read on the device are the totals the host passed. A total near int32's
    end restarts the counts from zero."""
    work_buffers.release()
    launch_bwd._plans.clear()
    seen = (0, 0)
    for sq, sk, seed in [(300, 300, 11), (300, 700, 12), (300, 1, 13), (300, 300, 14)]:
        q = _inputs(seed, (1, 4, sq, 64))[0]
        k, v = _inputs(seed + 100, (1, 4, sk, 64))[:2]
        dout = _inputs(seed + 200, (1, 4, sq, 64))[0]
        grads = _grads(q, k, v, dout, causal=causal)
        _check_against_reference(grads, q, k, v, dout, causal)
        (counted,) = _counted_sets().values()  # one set for every call: the same rows
        dq_done, prepared, totals = counted[3:]
        torch.cuda.synchronize()
        assert totals.prepared > seen[0] and totals.done > seen[1]
        assert (dq_done == totals.done).all() and (prepared[:, :4] == totals.prepared).all()
        seen = (totals.prepared, totals.done)
    assert all(p.one_launch for p in launch_bwd._plans.values()), "grids of 1-6 CTAs run as one launch"
    totals.prepared = 2**31 - 2  # the next call would pass int32's range: the counts restart
    q, k, v, dout = _inputs(15, (1, 4, 300, 64))
    grads = _grads(q, k, v, dout, causal=causal)
    _check_against_reference(grads, q, k, v, dout, causal)
    torch.cuda.synchronize()
    assert totals.prepared < 100 and (prepared[:, :4] == totals.prepared).all() and (dq_done == totals.done).all()


@pytest.mark.gpu
def test_one_launch_backward_with_grouped_heads_and_the_preprocess_path_agree(monkeypatch):
    """A grouped one-launch grid (4 query heads on 2 key/value heads: the units are key/value
    heads, each prepared by its CTAs a query head each) against the float64 reference, twice on
    one counted set; and the same call with kept sets off (no counted set: the preprocess
    prepares every head) within rounding of it."""
    work_buffers.release()
    q, dout = _inputs(21, (1, 4, 500, 64))[:2]
    k, v = _inputs(22, (1, 2, 500, 64))[:2]
    for _ in range(2):
        grads = _grads(q, k, v, dout)
        _check_against_reference(grads, q, k, v, dout, True)
    assert _counted_sets()
    monkeypatch.setattr(work_buffers, "MAX_SET_BYTES", 0)
    work_buffers.release()
    fallback = _grads(q, k, v, dout)
    assert not work_buffers._sets
    for a, b in zip(grads, fallback):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-3


def test_count_totals_advance_restart_near_int32s_end_and_reset():
    """work_buffers.CountTotals: the totals a counted set's counts reach, call by call; zeroed
    (with the counts) where one would pass int32's range, and by reset (a launch that raised)."""
    counts = (torch.ones(2, 3, dtype=torch.int32), torch.ones(2, 3, dtype=torch.int32))
    totals = work_buffers.CountTotals()
    assert totals.advance(4, 7, counts) == (4, 7) and totals.advance(2, 7, counts) == (6, 14)
    assert all((t == 1).all() for t in counts)
    totals.done = 2**31 - 7
    assert totals.advance(2, 7, counts) == (2, 7) and all((t == 0).all() for t in counts)
    counts[0].fill_(5)
    totals.reset(counts)
    assert (totals.prepared, totals.done) == (0, 0) and all((t == 0).all() for t in counts)
