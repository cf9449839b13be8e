"""The operands a float32 forward takes (cute_flash.float32), made in one pass over q, k and v.

* q and k: every element rounded to TF32 (cvt.rna; the tensor cores would truncate it), or
  with `split` its two TF32 parts side by side, hi = tf32(x) in columns [0, D) and
  lo = tf32(x - hi) in columns [T, T + D) of a row 2T wide (T the kernel's tile head dim).
* v: transposed to (D, Sk8) per (batch, head), its keys permuted within each group of 8 (key
  8g + 2t + h to column 8g + 4h + t, where P's registers put it: layouts.acc_as_tf32_operand_a)
  and rounded, keys Sk..Sk8 zero; with `split` the lo part's rows follow at row T.

Columns (rows of V^T) between D and T are not written: the caller allocates those outputs
zeroed where T > D. Three launches (q, k, v) from one host call, each a flat walk of its
elements by 128-thread CTAs, consecutive threads on consecutive addresses of the input (and
of q's and k's outputs); V^T's writes are 8-key runs (32 bytes) per thread.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.ptx import round_to_tf32

THREADS = 128
ROWS_PER_CTA = 16  # rows of q or k per CTA
GROUPS_PER_CTA = 16  # groups of 8 keys of v per CTA
KEY_GROUP = 8


class Tf32Operands:
    def __init__(self, head_dim: int, tile_head_dim: int, split: bool):
        self.head_dim = head_dim
        self.tile = tile_head_dim
        self.split = split

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D) float32
        mK: cute.Tensor,  # (B, Nkv, Sk, D)
        mV: cute.Tensor,  # (B, Nkv, Sk, D)
        mQOut: cute.Tensor,  # (B, N, Sq, D), or (B, N, Sq, 2T) with split
        mKOut: cute.Tensor,  # (B, Nkv, Sk, D), or (B, Nkv, Sk, 2T)
        mVt: cute.Tensor,  # (B, Nkv, D, Sk8), or (B, Nkv, 2T, Sk8)
        stream: cuda.CUstream,
    ):
        for src, dst in ((mQ, mQOut), (mK, mKOut)):
            grid = (cute.ceil_div(src.shape[2], ROWS_PER_CTA), src.shape[1], src.shape[0])
            self.round_rows(src, dst).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)
        grid = (cute.ceil_div(mVt.shape[3], KEY_GROUP * GROUPS_PER_CTA), mV.shape[1], mV.shape[0])
        self.transpose_values(mV, mVt).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def round_rows(self, src: cute.Tensor, dst: cute.Tensor):
        chunk, head, batch = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        rows = src.shape[2]
        for i in cutlass.range(tid, ROWS_PER_CTA * self.head_dim, THREADS, unroll=1):
            row = chunk * ROWS_PER_CTA + i // self.head_dim
            col = i % self.head_dim
            if row < rows:
                x = src[batch, head, row, col]
                hi = round_to_tf32(x)
                dst[batch, head, row, col] = hi
                if cutlass.const_expr(self.split):
                    dst[batch, head, row, self.tile + col] = round_to_tf32(x - hi)

    @cute.kernel
    def transpose_values(self, mV: cute.Tensor, mVt: cute.Tensor):
        chunk, head, batch = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        seqlen = mV.shape[2]
        groups = mVt.shape[3] // KEY_GROUP
        for i in cutlass.range(tid, GROUPS_PER_CTA * self.head_dim, THREADS, unroll=1):
            group = chunk * GROUPS_PER_CTA + i // self.head_dim
            col = i % self.head_dim
            if group < groups:
                hi = cute.make_rmem_tensor(KEY_GROUP, Float32)
                lo = cute.make_rmem_tensor(KEY_GROUP, Float32)
                for j in cutlass.range_constexpr(KEY_GROUP):
                    key = group * KEY_GROUP + j
                    x = Float32(0.0)
                    if key < seqlen:
                        x = mV[batch, head, key, col]
                    # Key 2t + h of the group goes to column 4h + t.
                    position = (j % 2) * (KEY_GROUP // 2) + j // 2
                    hi[position] = round_to_tf32(x)
                    if cutlass.const_expr(self.split):
                        lo[position] = round_to_tf32(x - hi[position])
                start = group * KEY_GROUP
                for j in cutlass.range_constexpr(KEY_GROUP):
                    mVt[batch, head, col, start + j] = hi[j]
                    if cutlass.const_expr(self.split):
                        mVt[batch, head, self.tile + col, start + j] = lo[j]

