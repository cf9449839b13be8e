"""Merging a split step's parts (split-KV): the parts' partial (O, LSE) into the step's output,
in one launch.

A step whose keys the forward walked in `splits` parts (problem.split_keys: each part a run of
a sequence's key blocks, a key/value head's group of query heads at its Sq positions as the
rows, problem.grouped_rows or, at Sq = 1, the decode step's view) leaves per part an O
normalised over the part's keys and the part's LSE. The step's output is their weighted sum,
weights exp(LSE_s - max) / sum (a part without keys has LSE -inf: weight 0), and its LSE is
max + log(sum). With a sink (problem.sink: the parts leave it out) its logit joins the sum,
once: sum + exp(sink - max), max taken over it too, so a row without keys gets O = 0 and the
sink's logit as its LSE. One CTA per (query head, sequence, position) sums the parts in order
(deterministic for a fixed split count) in float32 and writes O in the caller's layout, so the
torch glue the merge took (about ten small ops, perf/NOTES.md) is one launch.

Tensors: the parts' O (B * splits, Nkv, group * Sq, D) as the forward wrote it (row g * Sq + s
of entry b * splits + p, key/value head h: part p of sequence b, query head h * group + g,
position s), their LSE (B * splits, N, Sq) float32, the sink logits (N,) float32 (read with
`sink` only), the output (B, Sq, N, D) and its LSE (B, N, Sq) float32.

The merge is launched as the forward's programmatic dependent (the split forward lets it
launch once all of its CTAs run): its CTAs wait at entry (griddepcontrol.wait: the forward
complete, its writes visible) instead of being launched after the forward ends, which hides
the launch's latency in a step of a few microseconds. After that wait the merge is two
dependent steps, a memory round trip and the arithmetic: every thread reads a chunk of CHUNK
parts' LSEs and O values in one round of independent loads and weighs them itself (the
weights are cheap; a separate pass computing them first cost one more round trip, ~0.5 us of
a ~12 us decode step), with an online rescale between chunks for more than CHUNK parts.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.optional_arguments import check_given

THREADS = 128
CHUNK = 16  # parts read per round of loads (two registers each; a B = 1 step splits in 16)
MAX_SPLITS = 256  # cute_flash.kvcache.MAX_SPLITS: the most parts the host asks for
LOG2_E = math.log2(math.e)


class SplitMerge:
    def __init__(self, dtype, head_dim: int, sink: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.sink = sink

    @cute.jit
    def __call__(self, mPartial: cute.Tensor, mLse: cute.Tensor, mSink: cute.Tensor | None, mOut: cute.Tensor,
                 mLseOut: cute.Tensor, stream: cuda.CUstream):
        # mSink: the (N,) logits with self.sink, else None (optional_arguments.py).
        check_given("the split merge", ("sink",), (mSink,), (self.sink,))
        grid = (mOut.shape[2], mOut.shape[0], mOut.shape[1])
        self.kernel(mPartial, mLse, mSink, mOut, mLseOut).launch(grid=grid, block=[THREADS, 1, 1], stream=stream,
                                                                 use_pdl=True)

    @cute.kernel
    def kernel(self, mPartial: cute.Tensor, mLse: cute.Tensor, mSink: object, mOut: cute.Tensor,
               mLseOut: cute.Tensor):
        head, batch, position = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        splits = cutlass.min(mPartial.shape[0] // mOut.shape[0], MAX_SPLITS)
        group, positions = mOut.shape[2] // mPartial.shape[1], mOut.shape[1]
        kv_head, row = head // group, (head % group) * positions + position
        first = batch * splits
        lse = cute.make_rmem_tensor(CHUNK, Float32)
        val = cute.make_rmem_tensor(CHUNK, Float32)
        cute.arch.griddepcontrol_wait()  # the parts are written (see the module's docstring)
        lse_parts = mLse[None, head, position]  # (B * splits,): this row's LSE in every part
        for d in cutlass.range(tid, self.head_dim, THREADS, unroll=1):
            o_parts = mPartial[None, kv_head, row, d]
            top = Float32(-math.inf)  # the running max over the parts read so far (log2 units)
            if cutlass.const_expr(self.sink):
                top = mSink[head] * LOG2_E
            total = Float32(0.0)
            acc = Float32(0.0)
            for start in cutlass.range(0, splits, CHUNK, unroll=1):
                # One round of independent loads: a part past the last reads the last one again
                # (a valid address) and gets LSE -inf, so its weight is 0.
                for s in cutlass.range_constexpr(CHUNK):
                    part = cutlass.min(start + s, splits - 1)
                    value = lse_parts[first + part] * LOG2_E
                    lse[s] = value if start + s < splits else Float32(-math.inf)
                    val[s] = Float32(o_parts[first + part])
                new_top = top
                for s in cutlass.range_constexpr(CHUNK):
                    new_top = cute.arch.fmax(new_top, lse[s])
                # Every part so far empty (and no sink): weights 0, O = 0, LSE -inf below.
                safe_top = new_top if new_top != Float32(-math.inf) else Float32(0.0)
                rescale = cute.math.exp2(top - safe_top, fastmath=True)
                total *= rescale
                acc *= rescale
                for s in cutlass.range_constexpr(CHUNK):
                    weight = cute.math.exp2(lse[s] - safe_top, fastmath=True)
                    total += weight
                    acc += weight * val[s]
                top = new_top
            safe_top = top if top != Float32(-math.inf) else Float32(0.0)
            if cutlass.const_expr(self.sink):
                # The sink's term, without a value; `top` started at it, so it is in the max.
                total += cute.math.exp2(mSink[head] * LOG2_E - safe_top, fastmath=True)
            mOut[batch, position, head, d] = (acc / cutlass.max(total, Float32(1e-30))).to(self.dtype)
            if d == 0:
                mLseOut[batch, head, position] = (safe_top + cute.math.log2(total, fastmath=True)) / LOG2_E
