"""The operands a float32 forward takes (cute_flash.float32), made in one pass over q, k and v.

* q and k: every element rounded to TF32 (cvt.rna; the tensor cores would truncate it), or
  with `split` its two TF32 parts side by side, hi = tf32(x) in columns [0, D) and
  lo = tf32(x - hi) in columns [T, T + D) of a row 2T wide (T the kernel's tile head dim).
* v: transposed to (D, Sk8) per (batch, head), its keys permuted within each group of 8 (key
  8g + 2t + h to column 8g + 4h + t, where P's registers put it: layouts.acc_as_tf32_operand_a)
  and rounded, keys Sk..Sk8 zero; with `split` the lo part's rows follow at row T.

Columns (rows of V^T) between D and T are not written: the caller allocates those outputs
zeroed where T > D. One launch for q, k and v (run_parts: a small call is host-bound, and a
launch costs microseconds of it). q and k move in 16-byte vectors, ROWS rows per CTA. V goes
through shared memory, KEYS keys per CTA: read in rows
(consecutive threads, consecutive columns), written into a (D, KEYS + 1) tile at each key's
permuted position (the odd row stride keeps both phases free of bank conflicts), then stored
as V^T rows in 16-byte vectors (eight threads per 128-byte row segment). The first version,
scalar accesses and one thread per (column, 8 keys) writing its 32 bytes of V^T, ran at
500-870 GB/s against a copy's 2.6-3.7 TB/s (perf/NOTES.md, eighteenth session).
"""

from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.kernels.flat_grid import launch_ctas, part_coordinates, part_ctas
from cute_flash.kernels.layouts import chunk_row_partitions, row_copy_threads, row_tiled_copy
from cute_flash.kernels.ptx import round_to_tf32

THREADS = 128
ROWS = 64  # rows of q or k per CTA
KEYS = 32  # keys of v per CTA: a (D, KEYS + 1) float tile, 33 KiB at D = 256
KEY_GROUP = 8
VECTOR = 4  # floats per 16-byte access


class Tf32Operands:
    def __init__(self, head_dim: int, tile_head_dim: int, split: bool):
        self.head_dim = head_dim
        self.tile = tile_head_dim
        self.split = split
        # Whole rows of threads, VECTOR floats each (layouts.row_copy_threads: D = 24 uses 96).
        self.row_threads = row_copy_threads(THREADS, head_dim, VECTOR, ROWS)

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
        self.forward_pass(mQ, mK, mV, mQOut, mKOut, mVt).launch(
            grid=(self.cta_count(((mQ, mQOut), (mK, mKOut)), ((mV, mVt),)), 1, 1), block=[THREADS, 1, 1],
            smem=self.smem_bytes(), stream=stream)

    def smem_bytes(self) -> int:
        """The transposes' (D, KEYS + 1) float tile (every CTA of the launch gets it)."""
        return self.head_dim * (KEYS + 1) * 4

    @staticmethod
    def parts(rounding, transposes) -> list:
        """(pair, is a transpose, (blocks, heads, batches)) of every part of the launch: a row
        block of each rounded tensor's (batch, head), a key block of each transpose's. Plain
        Python, traced (host and device side)."""
        return ([(pair, False, (cute.ceil_div(pair[0].shape[2], ROWS), pair[0].shape[1], pair[0].shape[0]))
                 for pair in rounding]
                + [(pair, True, (cute.ceil_div(pair[1].shape[3], KEYS), pair[0].shape[1], pair[0].shape[0]))
                   for pair in transposes])

    def cta_count(self, rounding, transposes):
        """CTAs of one launch over every pair (parts). Plain Python, traced."""
        return launch_ctas([grid for _, _, grid in self.parts(rounding, transposes)])

    @cute.kernel
    def forward_pass(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQOut: cute.Tensor,
                     mKOut: cute.Tensor, mVt: cute.Tensor):
        self.run_parts(((mQ, mQOut), (mK, mKOut)), ((mV, mVt),))

    @cute.jit
    def run_parts(self, rounding, transposes):
        """This CTA's block of one of the pairs, in cta_count's order: one launch for the
        whole pass (a small call is host-bound, and each launch costs microseconds of it)."""
        cta, _, _ = cute.arch.block_idx()
        tile = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout((self.head_dim, KEYS), stride=(KEYS + 1, 1)), 16)
        first = Int32(0)
        for (src, dst), transpose, grid in self.parts(rounding, transposes):
            inside, block, head, batch = part_coordinates(cta, first, *grid)
            if inside:
                if cutlass.const_expr(transpose):
                    self.transpose_values(src, dst, tile, block, head, batch)
                else:
                    self.round_rows(src, dst, block, head, batch)
            first += part_ctas(*grid)

    @cute.jit
    def round_rows(self, src: cute.Tensor, dst: cute.Tensor, chunk, head, batch):
        """ROWS rows of one (batch, head) rounded (or split)."""
        tid, _, _ = cute.arch.thread_idx()
        rows_copy = row_tiled_copy(Float32, self.row_threads, self.head_dim, VECTOR, ROWS)
        if tid < self.row_threads:
            thr = rows_copy.get_slice(tid)
            rows_left = src.shape[2] - chunk * ROWS
            coords, src_tile, hi_tile, lo_tile = chunk_row_partitions(
                thr, thr, src[batch, head, None, None], dst[batch, head, None, None], chunk, ROWS, self.head_dim,
                self.tile if cutlass.const_expr(self.split) else None)
            # One pass of rows at a time (its values, hi and lo live only that long).
            values = cute.make_rmem_tensor_like(src_tile[None, 0, None])
            hi = cute.make_rmem_tensor_like(values)
            lo = cute.make_rmem_tensor_like(values)
            for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                if coords[0, m, 0][0] < rows_left:
                    cute.copy(rows_copy, src_tile[None, m, None], values)
                    for i in cutlass.range_constexpr(cute.size(values)):
                        hi[i] = round_to_tf32(values[i])
                        if cutlass.const_expr(self.split):
                            lo[i] = round_to_tf32(values[i] - hi[i])
                    cute.copy(rows_copy, hi, hi_tile[None, m, None])
                    if cutlass.const_expr(self.split):
                        cute.copy(rows_copy, lo, lo_tile[None, m, None])

    @cute.jit
    def transpose_values(self, mV: cute.Tensor, mVt: cute.Tensor, tile: cute.Tensor, chunk, head, batch):
        """KEYS keys of one (batch, head) transposed, permuted and rounded (or split)."""
        tid, _, _ = cute.arch.thread_idx()
        seqlen = mV.shape[2]
        first = chunk * KEYS
        # Rows of V in (consecutive threads on consecutive columns), each key at its column of
        # the permuted order (key 2t + h of a group at 4h + t); keys past Sk are zero.
        for i in cutlass.range(tid, KEYS * self.head_dim, THREADS, unroll=1):
            key = i // self.head_dim
            col = i % self.head_dim
            x = Float32(0.0)
            if first + key < seqlen:
                x = mV[batch, head, first + key, col]
            within = key % KEY_GROUP
            position = key - within + (within % 2) * (KEY_GROUP // 2) + within // 2
            tile[col, position] = x
        cute.arch.barrier()
        # V^T rows out, four keys per thread and 16-byte store, rounded (or split).
        columns = mVt.shape[3]
        chunks = KEYS // VECTOR
        for i in cutlass.range(tid, self.head_dim * chunks, THREADS, unroll=1):
            row = i // chunks
            start = (i % chunks) * VECTOR
            if first + start < columns:
                hi = cute.make_rmem_tensor(VECTOR, Float32)
                lo = cute.make_rmem_tensor(VECTOR, Float32)
                for j in cutlass.range_constexpr(VECTOR):
                    x = tile[row, start + j]
                    hi[j] = round_to_tf32(x)
                    if cutlass.const_expr(self.split):
                        lo[j] = round_to_tf32(x - hi[j])
                out = cute.local_tile(mVt[batch, head, row, None], (VECTOR,), ((first + start) // VECTOR,))
                cute.autovec_copy(hi, out)
                if cutlass.const_expr(self.split):
                    out_lo = cute.local_tile(mVt[batch, head, self.tile + row, None], (VECTOR,),
                                             ((first + start) // VECTOR,))
                    cute.autovec_copy(lo, out_lo)


class RoundedRows(NamedTuple):
    """A float32 backward's row-major operands, rounded to TF32 (shapes of q, k, v, dO)."""
    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor


class PermutedTransposes(NamedTuple):
    """A float32 backward's transposed operands (B, H, D, S8), rows permuted in groups of 8."""
    q: cute.Tensor
    k: cute.Tensor
    do: cute.Tensor


class Tf32BackwardOperands(Tf32Operands):
    """The operands a float32 backward takes (cute_flash.float32): q, k, v and dO rounded (the
    K-major operands of S^T = K Q^T and dP^T = V dO^T in the dK / dV kernel, and of S = Q K^T
    and dP = dO V^T in the dQ kernel), and Q^T, dO^T and K^T, (D, S8) per (batch, head), rows
    permuted within groups of 8 and rounded like the forward's V^T: the K-major B operands of
    dK += dS^T Q and dV += P^T dO (queries permuted, for P^T's and dS^T's registers as the TF32
    A operand) and of dQ += dS K (keys permuted, for dS's). With `split` every one as its TF32
    parts, laid out as the forward's (rows [hi | lo] 2T wide; transposes hi rows over lo rows
    from row T). One launch (run_parts) for all seven."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D) float32
        mK: cute.Tensor,  # (B, Nkv, Sk, D)
        mV: cute.Tensor,  # (B, Nkv, Sk, D)
        mdO: cute.Tensor,  # (B, N, Sq, D)
        rounded: RoundedRows,  # (.., S, D), or (.., S, 2T) with split
        transposed: PermutedTransposes,  # Q^T (B, N, D, Sq8), K^T (B, Nkv, D, Sk8), dO^T; 2T rows with split
        stream: cuda.CUstream,
    ):
        rounding = tuple(zip((mQ, mK, mV, mdO), rounded))
        transposes = tuple(zip((mQ, mK, mdO), transposed))
        self.backward_pass(mQ, mK, mV, mdO, *rounded, *transposed).launch(
            grid=(self.cta_count(rounding, transposes), 1, 1), block=[THREADS, 1, 1], smem=self.smem_bytes(),
            stream=stream)

    @cute.kernel
    def backward_pass(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                      mQRounded: cute.Tensor, mKRounded: cute.Tensor, mVRounded: cute.Tensor,
                      mdORounded: cute.Tensor, mQt: cute.Tensor, mKt: cute.Tensor, mdOt: cute.Tensor):
        self.run_parts(((mQ, mQRounded), (mK, mKRounded), (mV, mVRounded), (mdO, mdORounded)),
                       ((mQ, mQt), (mK, mKt), (mdO, mdOt)))
