"""The operands of a float32 forward on fp16 parts (cute_flash.float32, "float32x3h"), made in
one pass over each of q, k and v once their largest magnitudes per (batch, head) are known.

Every (batch, head) of x is scaled by a power of two 2^e that puts its largest |x| ("top",
the host's max-norm reduction) into [2^HALVES_TOP_LOG2, 2^(HALVES_TOP_LOG2 + 1)), the top of
fp16's range, and split as hi = fp16(x 2^e) in columns [0, D) and lo = fp16(x 2^e - hi) from
column T of a row 2T wide (T the kernel's tile head dim; columns between are not written, the
caller zeroes them). x 2^e - hi is exact in float32, so hi + lo keeps 22 significant bits of x
down to 2^-17 of the top (fp16's subnormals below). The exponent is read off the top's float32
bits (exact, no log2): e = HALVES_TOP_LOG2 - floor(log2(top)), within [-126, 126] so that 2^e
and 2^-e are both normal floats; a head that is all zeros or holds a non-finite value keeps
e = 0: its infinities and NaNs reach the rows they reach in float32, but its finite values
above fp16's 65504 then overflow too (their rows non-finite where float32's are not).

A last one-thread-per-head launch writes the operand scales that take the powers of two back
out (write_scales): the forward's (B, N, 2), per (batch, query head) the factor of its scores,
2^-(e_q + e_k) with k's exponent of its key/value head, and of O, 2^-e_v / P_SCALE (P's
scale in the kernels); the backward's (B, N, 5) (ScaledHalvesBackward, dO split too).

V's tile may be wider than the kernels' value tile (the forward above D = 128 runs P V in
VALUE_CHUNK-column chunks, one launch each: cute_flash.float32): its rows are then chunks of
[hi | lo] VALUE_CHUNK columns each, so that a chunk is one contiguous 2 VALUE_CHUNK-wide view.

Threads move VECTOR floats of a row per access (16 bytes in, two 8-byte fp16 stores out), ROWS
rows per CTA, one launch per tensor (per chunk of V's columns).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, const_expr

from cute_flash.kernels.layouts import (
    acc_as_operand_a,
    acc_as_rows_cols,
    chunk_row_partitions,
    row_copy_threads,
    row_tiled_copy,
)
from cute_flash.kernels.ptx import bits_of_float, float_of_bits
from cute_flash.kernels.rules import VALUE_CHUNK

THREADS = 128
ROWS = 64
VECTOR = 4
HALVES_TOP_LOG2 = 14
MAX_EXPONENT = 126
FLOAT_EXPONENT_BIAS = 127
# P (at most 1) times 2^14 before its split, so that P's small values keep their low part out
# of fp16's subnormals (perf/NOTES.md, forty-fourth session).
P_SCALE = 2.0 ** 14
# The operand scales per (batch, query head): the forward's (B, N, 2) ...
FWD_SCALE_SCORES, FWD_SCALE_O = range(2)
# ... and the backward's (B, N, 5).
SCALE_SCORES, SCALE_DP, SCALE_DQ, SCALE_DK, SCALE_DV = range(5)


@cute.jit
def scale_exponent(top: Float32) -> Int32:
    """e for a (batch, head) whose largest |x| is `top` (see the module docstring)."""
    bits = bits_of_float(top)
    biased = (bits >> 23) & 0xFF
    e = Int32(0)
    if biased == 0:
        if bits != 0:  # subnormal: as far up as e goes
            e = Int32(MAX_EXPONENT)
    elif biased != 0xFF:
        e = cutlass.min(Int32(HALVES_TOP_LOG2 + FLOAT_EXPONENT_BIAS) - biased, Int32(MAX_EXPONENT))
        e = cutlass.max(e, Int32(-MAX_EXPONENT))
    return e


@cute.jit
def power_of_two(e: Int32) -> Float32:
    """2^e for |e| <= MAX_EXPONENT, exactly."""
    return float_of_bits((e + FLOAT_EXPONENT_BIAS) << 23)


def store_halves(hi: cute.Tensor, lo: cute.Tensor, values) -> None:
    """Float32 `values` (a loaded tensor) as fp16 parts: hi = fp16(values) into `hi`, lo =
    fp16(values - hi) into `lo` (values - hi is exact in float32). The operand passes' rows
    and the kernels' register operands (P, P^T, dS) alike. Plain Python."""
    high = values.to(hi.element_type)
    hi.store(high)
    lo.store((values - high.to(Float32)).to(lo.element_type))


@cute.jit
def split_rows_scaled(hi: cute.Tensor, lo: cute.Tensor, acc: cute.Tensor) -> cute.Tensor:
    """An accumulator's values (float32, e.g. the backward's dS) as the fp16 parts hi + lo of
    acc 2^e_r, one power of two per row (its largest |x| into [2^14, 2^15): scale_exponent),
    written into the 16-bit A-operand fragments hi and lo; returns each row's 2^-e_r, the
    factor of the product's rows (a row's factor comes out of its product). acc is scaled in
    place. A row's values are held by the four lanes of a quad."""
    rows = acc_as_rows_cols(acc)
    down = cute.make_rmem_tensor(cute.size(rows, mode=[0]), Float32)
    for r in cutlass.range_constexpr(cute.size(rows, mode=[0])):
        top = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(rows, mode=[1])):
            top = cute.arch.fmax(top, cute.arch.fmax(rows[r, c], -rows[r, c]))
        top = cute.arch.warp_reduction_max(top, threads_in_group=4)
        e = scale_exponent(top)
        down[r] = power_of_two(-e)
        rows[r, None].store(rows[r, None].load() * power_of_two(e))
    store_halves(hi, lo, acc_as_operand_a(acc).load())
    return down


class ScaledHalves:
    """The forward's operand pass: q, k and v as fp16 parts, and the operand scales (B, N, 2)."""

    backward = False  # which operand scales write_scales writes: the forward's two

    def __init__(self, head_dim: int, tile_head_dim: int):
        self.head_dim = head_dim
        self.tile = tile_head_dim

    def pieces(self, value: bool) -> list:
        """(first source column, columns, first destination column, lo's offset from it) of
        each piece a tensor's rows are split in: the whole row, hi at 0 and lo at the tile; the
        forward's V of a tile wider than VALUE_CHUNK in chunks of it (see the module docstring;
        the backward contracts over V's columns in dP, so its V stays whole)."""
        if not value or self.backward or self.tile <= VALUE_CHUNK:
            return [(0, self.head_dim, 0, self.tile)]
        return [(c, min(VALUE_CHUNK, self.head_dim - c), 2 * c, VALUE_CHUNK)
                for c in range(0, min(self.tile, self.head_dim), VALUE_CHUNK)]

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D) float32
        mK: cute.Tensor,  # (B, Nkv, Sk, D)
        mV: cute.Tensor,  # (B, Nkv, Sk, D)
        mQTop: cute.Tensor,  # (B, N) float32: each head's largest |q|
        mKTop: cute.Tensor,  # (B, Nkv)
        mVTop: cute.Tensor,  # (B, Nkv)
        mQOut: cute.Tensor,  # (B, N, Sq, 2T) fp16
        mKOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mVOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mScales: cute.Tensor,  # (B, N, 2) float32
        stream: cuda.CUstream,
    ):
        # (The forward has no dO: v's top stands in for its top, never read.)
        self.launch((mQ, mK, mV), (mQTop, mKTop, mVTop, mVTop), (mQOut, mKOut, mVOut), mScales, stream)

    @cute.jit
    def launch(self, sources, tops, outs, mScales: cute.Tensor, stream: cuda.CUstream):
        """One split_rows launch per tensor (per piece of its rows), then write_scales (tops:
        q's, k's, v's, dO's; sources: q, k, v and dO)."""
        for index, (src, dst, top) in enumerate(zip(sources, outs, tops)):
            grid = (cute.ceil_div(src.shape[2], ROWS), src.shape[1], src.shape[0])
            for piece in self.pieces(value=index == 2):
                cols = piece[1]
                threads = row_copy_threads(THREADS, cols, VECTOR)
                load = row_tiled_copy(Float32, threads, cols, VECTOR)
                store = cute.make_tiled_copy_tv(
                    cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float16, num_bits_per_copy=16 * VECTOR),
                    cute.make_ordered_layout((threads * VECTOR // cols, cols // VECTOR), order=(1, 0)),
                    cute.make_layout((1, VECTOR)))
                self.split_rows(src, dst, top, load, store, piece, threads).launch(
                    grid=grid, block=[THREADS, 1, 1], stream=stream)
        self.write_scales(*tops, mScales).launch(grid=(mScales.shape[1], mScales.shape[0], 1),
                                                 block=[cute.arch.WARP_SIZE, 1, 1], stream=stream)

    @cute.kernel
    def write_scales(self, mQTop: cute.Tensor, mKTop: cute.Tensor, mVTop: cute.Tensor, mDOTop: cute.Tensor,
                     mScales: cute.Tensor):
        """Per (batch, query head) the factors that take the operands' powers of two back out:
        the forward's scores 2^-(e_q + e_k) (k's exponent of its key/value head) and O
        2^-e_v / P_SCALE; the backward's scores, dP 2^-(e_v + e_do), dQ 2^-e_k, dK 2^-e_q and
        dV 2^-e_do / P_SCALE (SCALE_*)."""
        head, batch, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        if tid == 0:
            # The key/value head of this query head (GQA: a group per K / V head).
            kv_head = head // (mQTop.shape[1] // mKTop.shape[1])
            down_q = power_of_two(-scale_exponent(mQTop[batch, head]))
            down_k = power_of_two(-scale_exponent(mKTop[batch, kv_head]))
            down_v = power_of_two(-scale_exponent(mVTop[batch, kv_head]))
            if const_expr(self.backward):
                down_do = power_of_two(-scale_exponent(mDOTop[batch, head]))
                mScales[batch, head, SCALE_SCORES] = down_q * down_k
                mScales[batch, head, SCALE_DP] = down_v * down_do
                mScales[batch, head, SCALE_DQ] = down_k
                mScales[batch, head, SCALE_DK] = down_q
                mScales[batch, head, SCALE_DV] = down_do * Float32(1.0 / P_SCALE)
            else:
                mScales[batch, head, FWD_SCALE_SCORES] = down_q * down_k
                mScales[batch, head, FWD_SCALE_O] = down_v * Float32(1.0 / P_SCALE)

    @cute.kernel
    def split_rows(self, src: cute.Tensor, dst: cute.Tensor, mTop: cute.Tensor, load: cute.TiledCopy,
                   store: cute.TiledCopy, piece: cutlass.Constexpr, threads: cutlass.Constexpr[int]):
        """ROWS rows of one (batch, head), the columns of one of pieces()."""
        chunk, head, batch = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        e = scale_exponent(mTop[batch, head])
        src_col, cols, dst_col, lo_col = piece
        if tid < threads:
            factor = power_of_two(e)
            rows_left = src.shape[2] - chunk * ROWS
            src_rows, dst_rows = src[batch, head, None, None], dst[batch, head, None, None]
            if const_expr(src_col > 0):
                src_rows = cute.domain_offset((0, src_col), src_rows)
            if const_expr(dst_col > 0):
                dst_rows = cute.domain_offset((0, dst_col), dst_rows)
            coords, src_tile, hi_tile, lo_tile = chunk_row_partitions(
                load.get_slice(tid), store.get_slice(tid), src_rows, dst_rows, chunk, ROWS, cols, lo_col)
            values = cute.make_rmem_tensor_like(src_tile[None, 0, None])
            hi = cute.make_rmem_tensor_like(values, Float16)
            lo = cute.make_rmem_tensor_like(values, Float16)
            for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                if coords[0, m, 0][0] < rows_left:
                    cute.copy(load, src_tile[None, m, None], values)
                    store_halves(hi, lo, values.load() * factor)
                    cute.copy(store, hi, hi_tile[None, m, None])
                    cute.copy(store, lo, lo_tile[None, m, None])


class ScaledHalvesBackward(ScaledHalves):
    """The backward's operand pass: q, k, v and dO as fp16 parts, and the operand scales (B, N, 5)."""

    backward = True

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D) float32
        mK: cute.Tensor,  # (B, Nkv, Sk, D)
        mV: cute.Tensor,  # (B, Nkv, Sk, D)
        mDO: cute.Tensor,  # (B, N, Sq, D)
        mQTop: cute.Tensor,  # (B, N) float32: each head's largest |q|
        mKTop: cute.Tensor,  # (B, Nkv)
        mVTop: cute.Tensor,  # (B, Nkv)
        mDOTop: cute.Tensor,  # (B, N)
        mQOut: cute.Tensor,  # (B, N, Sq, 2T) fp16
        mKOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mVOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mDOOut: cute.Tensor,  # (B, N, Sq, 2T)
        mScales: cute.Tensor,  # (B, N, 5) float32
        stream: cuda.CUstream,
    ):
        self.launch((mQ, mK, mV, mDO), (mQTop, mKTop, mVTop, mDOTop), (mQOut, mKOut, mVOut, mDOOut), mScales,
                    stream)
