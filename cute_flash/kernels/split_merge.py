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
the launch's latency in a step of a few microseconds.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 128
UNROLL = 8
MAX_SPLITS = 256  # cute_flash.kvcache.MAX_SPLITS: the weights' shared-memory row
LOG2_E = math.log2(math.e)


class SplitMerge:
    def __init__(self, dtype, head_dim: int, sink: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.sink = sink

    @cute.jit
    def __call__(self, mPartial: cute.Tensor, mLse: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor,
                 mLseOut: cute.Tensor, stream: cuda.CUstream):
        grid = (mOut.shape[2], mOut.shape[0], mOut.shape[1])
        sink = mSink if cutlass.const_expr(self.sink) else None
        self.kernel(mPartial, mLse, sink, mOut, mLseOut).launch(grid=grid, block=[THREADS, 1, 1], stream=stream,
                                                                smem=MAX_SPLITS * 4, use_pdl=True)

    @cute.kernel
    def kernel(self, mPartial: cute.Tensor, mLse: cute.Tensor, mSink: object, mOut: cute.Tensor,
               mLseOut: cute.Tensor):
        head, batch, position = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        splits = cutlass.min(mPartial.shape[0] // mOut.shape[0], MAX_SPLITS)
        group, positions = mOut.shape[2] // mPartial.shape[1], mOut.shape[1]
        kv_head, row = head // group, (head % group) * positions + position
        first = batch * splits
        weights = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(MAX_SPLITS),
                                                                 byte_alignment=16)
        cute.arch.griddepcontrol_wait()  # the parts are written (see the module's docstring)
        # The first warp turns the parts' LSEs into weights: each lane reads every 32nd part
        # (one round of loads up to 32 parts), shuffles reduce the max and the sum, and the
        # weights go to shared memory, so the O loop below loads only the parts' rows.
        if tid < cute.arch.WARP_SIZE:
            top = Float32(-math.inf)
            for s in cutlass.range(tid, splits, cute.arch.WARP_SIZE, unroll=1):
                top = cute.arch.fmax(top, mLse[first + s, head, position])
            top = cute.arch.warp_reduction_max(top)
            if cutlass.const_expr(self.sink):
                top = cute.arch.fmax(top, mSink[head])
            if top == Float32(-math.inf):
                top = Float32(0.0)  # every part empty: weights 0, O = 0, LSE -inf
            total = Float32(0.0)
            for s in cutlass.range(tid, splits, cute.arch.WARP_SIZE, unroll=1):
                weight = cute.math.exp2((mLse[first + s, head, position] - top) * LOG2_E)
                weights[s] = weight
                total += weight
            total = cute.arch.warp_reduction_sum(total)
            if cutlass.const_expr(self.sink):
                total += cute.math.exp2((mSink[head] - top) * LOG2_E)  # a term without a value
            inv_total = Float32(1.0) / cutlass.max(total, Float32(1e-30))
            for s in cutlass.range(tid, splits, cute.arch.WARP_SIZE, unroll=1):
                weights[s] = weights[s] * inv_total
            if tid == 0:
                mLseOut[batch, head, position] = top + cute.math.log(total)
        cute.arch.barrier()
        for d in cutlass.range(tid, self.head_dim, THREADS, unroll=1):
            acc = Float32(0.0)
            # Unrolled: the loads are independent, and a loop of one load per iteration waits
            # a memory latency per part.
            for s in cutlass.range(splits, unroll=UNROLL):
                acc += weights[s] * Float32(mPartial[first + s, kv_head, row, d])
            mOut[batch, position, head, d] = acc.to(self.dtype)
