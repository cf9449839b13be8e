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

A float32 call's operand copies (the split or rounded q, k, v, dO, the operand scales and the
partial maxima) are a set of the same kind: its operand pass writes every element the kernels
read, and columns it never writes (a tile's padding) are zeroed when the set is made and never
written by anyone; the pass is an ordinary launch too, so the previous call's kernels that read
the set have finished before it writes.

At most MAX_SETS sets of at most MAX_SET_BYTES each are kept (least recently used dropped), so
the buffers hold at most 128 MiB of device memory; larger problems allocate per call as before
(their kernels take long enough to hide the host path). release() drops every kept set.
"""

import threading
from collections import OrderedDict

import torch

MAX_SET_BYTES = 16 * 2**20
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


def kept_set(kind: tuple, nbytes: int, make, device) -> tuple:
    """make()'s tensors for one call, kept for the next call of this thread on the device's
    current stream with the same `kind` (which names the buffers' use and shapes) when they
    hold at most MAX_SET_BYTES (`nbytes`) and the stream is not being captured. The caller's
    kernels must write every element they read in each call (see the module's docstring)."""
    if nbytes > MAX_SET_BYTES or torch._C._cuda_isCurrentStreamCapturing():
        return make()
    key = (threading.get_ident(), device.index, torch._C._cuda_getCurrentRawStream(device.index), kind)
    kept = _sets.get(key)
    if kept is not None:
        _sets.move_to_end(key)
        return kept
    kept = _sets[key] = make()
    if len(_sets) > MAX_SETS:
        _sets.popitem(last=False)
    return kept


def release() -> None:
    """Drops every kept set (their memory returns to torch's caching allocator)."""
    _sets.clear()
