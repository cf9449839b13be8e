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
    return {key: tuple(t.data_ptr() for t in buffers if t is not None) for key, buffers in work_buffers._sets.items()}


def _inputs(seed, shape=(1, 4, 300, 64), dtype=torch.bfloat16):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=generator) for _ in range(4)]


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
    monkeypatch.setattr(work_buffers, "MAX_SET_BYTES", 0)
    work_buffers.release()
    fresh = _grads(*second, causal=causal)
    assert not work_buffers._sets
    for a, b in zip(reused, fresh):
        assert torch.equal(a, b)


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
    for a, b in zip(reused, fresh):
        assert torch.equal(a, b)


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
    for a, b in zip(on_stream, expected):
        assert torch.equal(a, b)


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
    for a, b in zip(captured, expected):
        assert torch.equal(a, b)


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
