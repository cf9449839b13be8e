"""The backward's per-call work buffers (LSE * log2(e), delta, the fp32 dQ accumulator and its
two per-head counters), and float32 inputs' operand copies (cute_flash.float32), kept between
calls while they are small.

Why: a small backward is host-bound, and on the H200's host each tensor object costs
microseconds: the five buffers took ~18-30 us of a ~200 us backward through autograd
(perf/NOTES.md, fifty-sixth session), as long as the three kernel launches together.

Why reusing a set is exact: the kernels never read a buffer element they did not write in the
same call (the preprocess writes LSE * log2(e) and delta and zeroes the accumulator and the
counters; torch.empty's arbitrary contents already hold them to that), so the previous
call's values cannot leak into the next. What needs care is only *when*: a set is handed back
only to the thread and the CUDA stream that used it last, so its earlier use is ordered before
the next call's kernels by the stream (the preprocess is an ordinary launch, not a
programmatic dependent one: it starts after the previous call's postprocess has finished);
never while that stream is being captured into a CUDA graph (a graph keeps the addresses for
replays that eager calls would race; captures allocate from their graph's pool as before).

A counted set (counted_work_set) is the exception: its two per-head counts are zeroed once
and never again, so that a backward run as one launch needs no preprocess launch to zero them; the
kernels count on from the previous call's totals, which the set keeps beside it (CountTotals).

A float32 call's operand copies (the split or rounded q, k, v, dO, the operand scales and the
partial maxima) are a set of the same kind: its operand pass writes every element the kernels
read, and columns it never writes (a tile's padding) are zeroed when the set is made and never
written by anyone; the pass is an ordinary launch too, so the previous call's kernels that read
the set have finished before it writes.

At most MAX_SETS sets of at most MAX_SET_BYTES each, MAX_KEPT_BYTES together, are kept (least
recently used dropped); larger problems allocate per call as before (their kernels take long
enough to hide the host path). The per-set bound is the GPU time's: at 16 MiB, (1, 16, 2048,
128) bf16 causal (16.3 MiB) allocated its five buffers per call, 243 us of host time per
backward against 149 kept, beside ~150 us of kernels (perf/NOTES.md, sixty-third session); at 64 MiB a set's kernels take
several hundred us at any sequence length of the seeds' grid. Models run one set per shape
(every layer of a step shares it), so the total bound, not the per-set one, caps what is held
where shapes change from call to call (packed batches). release() drops every kept set.
"""

import threading
from collections import OrderedDict

import torch

MAX_SET_BYTES = 64 * 2**20
MAX_KEPT_BYTES = 128 * 2**20
MAX_SETS = 8

_sets: OrderedDict = OrderedDict()


def set_bytes(rows: tuple, accum_tile: int) -> int:
    """Bytes of one set: two float32 per row, accum_tile float32 per row for the dQ
    accumulator (0: none, the separate dQ path's), two int32 counters per (batch, head)."""
    batch, heads, padded_rows = rows
    return 4 * batch * heads * (padded_rows * (2 + accum_tile) + 2)


def new_set(rows: tuple, accum_tile: int, device) -> tuple:
    """(lse_log2, delta, dq_accum, dq_done, prepared); with accum_tile 0 the last three are None
    (the caller passes its never-read placeholders)."""
    f32 = dict(dtype=torch.float32, device=device)
    lse_log2, delta = torch.empty(rows, **f32), torch.empty(rows, **f32)
    if not accum_tile:
        return lse_log2, delta, None, None, None
    counters = rows[:2]
    return (lse_log2, delta, torch.empty((*rows, accum_tile), **f32),
            torch.empty(counters, dtype=torch.int32, device=device),
            torch.empty(counters, dtype=torch.int32, device=device))


def work_set(rows: tuple, accum_tile: int, device, reusable: bool = True) -> tuple:
    """A set of work buffers for one backward call (new_set's tuple): the one this thread last
    used on the device's current stream with these shapes when there is one (see the module's
    docstring), else a new one, kept for the next call when it is small enough. reusable=False:
    always a new set, not kept (the caller keeps delta beyond the call)."""
    if not reusable:
        return new_set(rows, accum_tile, device)
    return kept_set(("backward", rows, accum_tile), set_bytes(rows, accum_tile),
                    lambda: new_set(rows, accum_tile, device), device)


class CountTotals:
    """What a counted set's two counts read after its calls so far (counted_work_set): every
    call adds `prepared` to each used prepared[b, u] and `done` to each dq_done[b, h]."""

    __slots__ = ("prepared", "done")

    def __init__(self):
        self.prepared = self.done = 0

    def advance(self, prepared: int, done: int, counts: tuple) -> tuple:
        """The totals after one more call adding (prepared, done); the counts are zeroed first
        (ordered by the stream) where a total would pass int32's range."""
        if self.prepared + prepared >= 2**31 or self.done + done >= 2**31:
            self.reset(counts)
        self.prepared += prepared
        self.done += done
        return self.prepared, self.done

    def reset(self, counts: tuple) -> None:
        """Zeroes the counts (ordered by the stream after whatever was launched) and the
        totals: where a total would pass int32's range, and after a launch that raised (the
        device's counts may then not be the totals, and a wait for a total never reached
        would hang the next call)."""
        for t in counts:
            t.zero_()
        self.prepared = self.done = 0


def counted_work_set(rows: tuple, accum_tile: int, units: int, device):
    """A kept backward set whose counts (dq_done, prepared) are zeroed once, when it is made,
    and then go on counting from call to call, with its CountTotals: new_set's tuple plus the
    totals; None where no set may be kept (too large, or the stream is being captured). For a
    backward that prepares every head in its main kernel and launches no preprocess (launch_bwd,
    grids run as one launch), which passes the totals its counts reach. `units`: the grid's heads per
    batch (key/value heads), whose prepared counts it adds to: calls sharing a set add to the
    same ones, so every used count has the same total."""
    nbytes = set_bytes(rows, accum_tile)
    if not _keepable(nbytes):
        return None

    def make():
        lse_log2, delta, dq_accum, dq_done, prepared = new_set(rows, accum_tile, device)
        dq_done.zero_()
        prepared.zero_()
        return lse_log2, delta, dq_accum, dq_done, prepared, CountTotals()

    return _kept(("backward-counted", rows, accum_tile, units), nbytes, make, device)


def _keepable(nbytes: int) -> bool:
    return nbytes <= MAX_SET_BYTES and not torch._C._cuda_isCurrentStreamCapturing()


def kept_set(kind: tuple, nbytes: int, make, device) -> tuple:
    """make()'s tensors for one call, kept for the next call of this thread on the device's
    current stream with the same `kind` (which names the buffers' use and shapes) when they
    hold at most MAX_SET_BYTES (`nbytes`) and the stream is not being captured. The caller's
    kernels must write every element they read in each call (see the module's docstring)."""
    if not _keepable(nbytes):
        return make()
    return _kept(kind, nbytes, make, device)


def _kept(kind: tuple, nbytes: int, make, device) -> tuple:
    """kept_set's set for a call whose set (of nbytes) may be kept (_keepable asked already)."""
    key = (threading.get_ident(), device.index, torch._C._cuda_getCurrentRawStream(device.index), kind)
    entry = _sets.get(key)
    if entry is not None:
        _sets.move_to_end(key)
        return entry[0]
    kept = make()
    _sets[key] = (kept, nbytes)
    while len(_sets) > MAX_SETS or sum(n for _, n in _sets.values()) > MAX_KEPT_BYTES:
        _sets.popitem(last=False)  # (never the new set: nbytes <= MAX_SET_BYTES <= MAX_KEPT_BYTES)
    return kept


def release() -> None:
    """Drops every kept set (their memory returns to torch's caching allocator)."""
    _sets.clear()
