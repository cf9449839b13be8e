"""Merging a split decode step's chunks (split-KV): the chunks' partial (O, LSE) into the step's
output, in one launch.

A decode step whose keys were split into `splits` chunks (cute_flash.kvcache: each chunk a
sequence of its own, the group's query heads as its rows) leaves per chunk an O
normalised over the chunk's keys and the chunk's LSE. The step's output is their weighted sum,
weights exp(LSE_s - max) / sum (a chunk without keys has LSE -inf: weight 0), and its LSE is
max + log(sum). One CTA per (sequence, query head) sums the chunks in order (deterministic for
a fixed split count) in float32 and writes O in the caller's head order, so the torch glue the
merge took (about ten small ops, perf/NOTES.md) is one launch.

Tensors: the chunks' O (B, splits, Nkv, group, D) as the forward wrote it (row j of chunk s of
sequence b, key/value head h: query head h * group + j), their LSE (B, splits, Nkv, group)
float32, the output (B, 1, N, D) and its LSE (B, N, 1) float32.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 128
UNROLL = 8
LOG2_E = math.log2(math.e)


class SplitMerge:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(self, mPartial: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, mLseOut: cute.Tensor,
                 stream: cuda.CUstream):
        grid = (mOut.shape[2], mOut.shape[0], 1)
        self.kernel(mPartial, mLse, mOut, mLseOut).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPartial: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, mLseOut: cute.Tensor):
        head, batch, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        splits, group = mPartial.shape[1], mPartial.shape[3]
        kv_head, row = head // group, head % group
        top = Float32(-math.inf)
        # Loops unrolled by UNROLL: their loads are independent, and a loop of one load per
        # iteration waits a memory latency per chunk (a 32-chunk merge took tens of us).
        for s in cutlass.range(splits, unroll=UNROLL):
            top = cute.arch.fmax(top, mLse[batch, s, kv_head, row])
        if top == Float32(-math.inf):
            top = Float32(0.0)  # every chunk empty: weights 0, O = 0, LSE -inf
        total = Float32(0.0)
        for s in cutlass.range(splits, unroll=UNROLL):
            total += cute.math.exp2((mLse[batch, s, kv_head, row] - top) * LOG2_E)
        inv_total = Float32(1.0) / cutlass.max(total, Float32(1e-30))
        for d in cutlass.range(tid, self.head_dim, THREADS, unroll=1):
            acc = Float32(0.0)
            for s in cutlass.range(splits, unroll=UNROLL):
                weight = cute.math.exp2((mLse[batch, s, kv_head, row] - top) * LOG2_E)
                acc += weight * Float32(mPartial[batch, s, kv_head, row, d])
            mOut[batch, 0, head, d] = (acc * inv_total).to(self.dtype)
        if tid == 0:
            mLseOut[batch, head, 0] = top + cute.math.log(total)
