"""The operands of a float32 forward on fp16 parts (cute_flash.float32, "float32x3h"), made in
one call of two launches: the largest magnitude of each (batch, head) of q, k and v, then one
pass over each that splits it.

Every (batch, head) of x is scaled by a power of two 2^e that puts its largest |x| ("top")
into [2^HALVES_TOP_LOG2, 2^(HALVES_TOP_LOG2 + 1)), the top of
fp16's range, and split as hi = fp16(x 2^e) in columns [0, D) and lo = fp16(x 2^e - hi) from
column T of a row 2T wide (T the kernel's tile head dim; columns between are not written, the
caller zeroes them). x 2^e - hi is exact in float32, so hi + lo keeps 22 significant bits of x
down to 2^-17 of the top (fp16's subnormals below). The exponent is read off the top's float32
bits (exact, no log2): e = HALVES_TOP_LOG2 - floor(log2(top)), within [-126, 126] so that 2^e
and 2^-e are both normal floats; a head that is all zeros or holds a non-finite value keeps
e = 0: its infinities and NaNs reach the rows they reach in float32, but its finite values
above fp16's 65504 then overflow too (their rows non-finite where float32's are not).

The tops (reduce_tops): TOP_CHUNKS CTAs per (batch, head), each over a run of its rows, write
one partial maximum per warp (float32 bits, int32) into a (B, heads, TOP_PARTIALS) buffer, so
that every entry is written each call (no zeroing launch, no atomics) and a split CTA finds
its head's top in one warp's load and reduction of TOP_PARTIALS entries. A caller that knows
a tensor's tops (a KV cache's over the slots in use) puts them in its heads' first entries,
the others zero, and clears that tensor's bit of `reduced`. Before, the host took three torch
max-norms (four for the backward): 35-50 us of host time and 9-30 us of GPU time each at
small sizes (perf/NOTES.md, fifty-seventh session).

The split (split_parts): one launch over every tensor's (and V's chunks') row blocks, its CTAs
of q's first row block also writing the operand scales that take the powers of two back out:
the forward's (B, N, 2), per (batch, query head) the factor of its scores, 2^-(e_q + e_k) with
k's exponent of its key/value head, and of O, 2^-e_v / P_SCALE (P's scale in the kernels); the
backward's (B, N, 5) (ScaledHalvesBackward, dO split too).

V's tile may be wider than the kernels' value tile (the forward above D = 128 runs P V in
VALUE_CHUNK-column chunks, one launch each: cute_flash.float32): its rows are then chunks of
[hi | lo] VALUE_CHUNK columns each, so that a chunk is one contiguous 2 VALUE_CHUNK-wide view.

Threads move VECTOR floats of a row per access (16 bytes in, two 8-byte fp16 stores out), ROWS
rows per split CTA.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, const_expr

from cute_flash.kernels.flat_grid import launch_ctas, part_coordinates, part_ctas
from cute_flash.kernels.layouts import (
    acc_as_operand_a,
    acc_as_rows_cols,
    chunk_row_partitions,
    row_copy,
)
from cute_flash.kernels.ptx import bits_of_float, float_of_bits
from cute_flash.kernels.rules import VALUE_CHUNK

THREADS = 128
WARPS = THREADS // 32
ROWS = 64
VECTOR = 4
# The largest |x| of a (batch, head) comes from TOP_CHUNKS CTAs over its rows, one partial
# maximum per warp: TOP_PARTIALS entries, which every split CTA reduces in one warp (top_bits).
TOP_CHUNKS = 32
TOP_PARTIALS = TOP_CHUNKS * WARPS
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
    count = 3  # the tensors it splits: q, k, v (the backward's: and dO)

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

    def parts(self) -> list:
        """(tensor index, piece) of every part the split launch covers, q's whole rows first
        (its CTAs of the first row block also write the operand scales)."""
        return [(index, piece) for index in range(self.count) for piece in self.pieces(value=index == 2)]

    @staticmethod
    def reduce_grid(src, index: int, reduced: Int32) -> tuple:
        """(blocks, heads, batches) of reduce_tops' part of tensor `index`: TOP_CHUNKS CTAs per
        (batch, head), none for a tensor whose maxima were given (a part of no batch). Plain
        Python, traced on the host and in the kernel (there inside the part's loop step: all
        parts' grids worked out first stay live across the reduction, which spilled at D = 128)."""
        return TOP_CHUNKS, src.shape[1], ((reduced >> index) & 1) * src.shape[0]

    @staticmethod
    def split_grid(src) -> tuple:
        """(blocks, heads, batches) of split_parts' part of `src`: ROWS rows per CTA. Plain
        Python, traced on the host and in the kernel."""
        return cute.ceil_div(src.shape[2], ROWS), src.shape[1], src.shape[0]

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D) float32
        mK: cute.Tensor,  # (B, Nkv, Sk, D)
        mV: cute.Tensor,  # (B, Nkv, Sk, D)
        mQOut: cute.Tensor,  # (B, N, Sq, 2T) fp16
        mKOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mVOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mTops: cute.Tensor,  # (B, N + 2 Nkv, TOP_PARTIALS) int32: partial maxima (see reduce_tops)
        reduced: Int32,  # bit i: this pass reduces tensor i's maxima (else the caller gave them)
        mScales: cute.Tensor,  # (B, N, 2) float32
        stream: cuda.CUstream,
    ):
        # (The forward has no dO: v stands in for it, never read.)
        self.launch((mQ, mK, mV, mV), (mQOut, mKOut, mVOut, mVOut), mTops, reduced, mScales, stream)

    @cute.jit
    def launch(self, sources, outs, mTops: cute.Tensor, reduced: Int32, mScales: cute.Tensor,
               stream: cuda.CUstream):
        """Two launches: reduce_tops (the maxima of the tensors `reduced` marks), then
        split_parts (every tensor's halves and the operand scales). sources, outs: q, k, v, dO
        (the forward's dO v, never read)."""
        # (A grid of no CTA does not launch: with every maximum given, one CTA that does nothing.)
        reduce_ctas = launch_ctas([self.reduce_grid(sources[index], index, reduced) for index in range(self.count)])
        self.reduce_tops(*sources, mTops, reduced).launch(
            grid=(cutlass.max(reduce_ctas, Int32(1)), 1, 1), block=[THREADS, 1, 1], stream=stream)
        split_ctas = launch_ctas([self.split_grid(sources[index]) for index, _ in self.parts()])
        self.split_parts(*sources, *outs, mTops, mScales).launch(
            grid=(split_ctas, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @staticmethod
    def head_base(sources, index: int):
        """The first row of tensor `index`'s heads in mTops: q's, k's, v's, dO's one after the
        other. Plain Python."""
        base = 0
        for before in range(index):
            base = base + sources[before].shape[1]
        return base

    @cute.kernel
    def reduce_tops(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mDO: cute.Tensor, mTops: cute.Tensor,
                    reduced: Int32):
        """Each (batch, head) of a reduced tensor in TOP_CHUNKS CTAs of consecutive rows, each
        warp's largest |x| (as bits: the int32 order of non-negative floats, NaN above inf, so
        that a head holding one keeps e = 0 as a max-norm's NaN did) into its own entry of
        mTops: every entry of the tensor's heads written, no zeroing and no atomics, and the
        split CTAs reduce the TOP_PARTIALS entries of their head (top_bits)."""
        sources = (mQ, mK, mV, mDO)
        cta, _, _ = cute.arch.block_idx()
        first = Int32(0)
        for index in cutlass.range_constexpr(self.count):
            grid = self.reduce_grid(sources[index], index, reduced)
            inside, chunk, head, batch = part_coordinates(cta, first, *grid)
            if inside:
                self.reduce_chunk(sources[index], mTops, self.head_base(sources, index) + head, chunk, head, batch)
            first += part_ctas(*grid)

    @cute.jit
    def reduce_chunk(self, src: cute.Tensor, mTops: cute.Tensor, row, chunk, head, batch):
        """The largest |x| bits of chunk `chunk` of (batch, head)'s rows, one entry per warp."""
        tid, _, _ = cute.arch.thread_idx()
        cols = self.head_dim
        seqlen = src.shape[2]
        # Rows per block: 64 up to D = 128 (16 vectors per thread), 16 above, so that a thread's
        # unrolled loads of a block fit its registers (64 x 256 spilled, and 32 x 256 still did).
        block_rows = ROWS if cols <= 128 else ROWS // 4
        threads, load = row_copy(Float32, THREADS, cols, VECTOR, block_rows)
        # Blocks per chunk: TOP_CHUNKS chunks cover the rows (every chunk's entries written,
        # those past the rows with 0).
        blocks = cute.ceil_div(cute.ceil_div(seqlen, block_rows), TOP_CHUNKS)
        top = Int32(0)
        if tid < threads:
            thr = load.get_slice(tid)
            rows = src[batch, head, None, None]
            coords = thr.partition_S(cute.make_identity_tensor((block_rows, cols)))
            for b in cutlass.range(blocks, unroll=1):
                block = chunk * blocks + b
                rows_left = seqlen - block * block_rows
                src_tile = thr.partition_S(cute.local_tile(rows, (block_rows, cols), (block, 0)))
                values = cute.make_rmem_tensor_like(src_tile[None, 0, None])
                for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                    if coords[0, m, 0][0] < rows_left:
                        cute.copy(load, src_tile[None, m, None], values)
                        for i in cutlass.range_constexpr(cute.size(values)):
                            top = cutlass.max(top, bits_of_float(values[i]) & 0x7FFFFFFF)
        top = cute.arch.warp_redux_sync(top, "max")
        if cute.arch.lane_idx() == 0:
            mTops[batch, row, chunk * WARPS + cute.arch.warp_idx()] = top

    @cute.jit
    def top_bits(self, mTops: cute.Tensor, batch, row) -> Int32:
        """The largest |x| bits of the head at mTops row `row`: its TOP_PARTIALS entries, in
        every lane of the warp."""
        lane = cute.arch.lane_idx()
        top = Int32(0)
        for w in cutlass.range_constexpr(TOP_PARTIALS // cute.arch.WARP_SIZE):
            top = cutlass.max(top, mTops[batch, row, w * cute.arch.WARP_SIZE + lane])
        return cute.arch.warp_redux_sync(top, "max")

    @cute.kernel
    def split_parts(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mDO: cute.Tensor, mQOut: cute.Tensor,
                    mKOut: cute.Tensor, mVOut: cute.Tensor, mDOOut: cute.Tensor, mTops: cute.Tensor,
                    mScales: cute.Tensor):
        """ROWS rows of one (batch, head) of one of parts(); the CTAs of q's first row block
        also write their (batch, query head)'s operand scales."""
        sources = (mQ, mK, mV, mDO)
        outs = (mQOut, mKOut, mVOut, mDOOut)
        cta, _, _ = cute.arch.block_idx()
        first = Int32(0)
        for part, (index, piece) in enumerate(self.parts()):
            grid = self.split_grid(sources[index])
            inside, block, head, batch = part_coordinates(cta, first, *grid)
            if inside:
                e = scale_exponent(float_of_bits(self.top_bits(mTops, batch, self.head_base(sources, index) + head)))
                self.split_block(sources[index], outs[index], e, piece, block, head, batch)
                if const_expr(part == 0):
                    if block == 0:
                        self.write_scales(sources, mTops, mScales, e, head, batch)
            first += part_ctas(*grid)

    @cute.jit
    def write_scales(self, sources, mTops: cute.Tensor, mScales: cute.Tensor, e_q: Int32, head, batch):
        """Per (batch, query head) the factors that take the operands' powers of two back out:
        the forward's scores 2^-(e_q + e_k) (k's exponent of its key/value head) and O
        2^-e_v / P_SCALE; the backward's scores, dP 2^-(e_v + e_do), dQ 2^-e_k, dK 2^-e_q and
        dV 2^-e_do / P_SCALE (SCALE_*). e_q: q's exponent, which the caller's split used."""
        # The key/value head of this query head (GQA: a group per K / V head).
        kv_head = head // (sources[0].shape[1] // sources[1].shape[1])
        heads = (head, kv_head, kv_head, head)
        downs = [power_of_two(-e_q)]
        for index in cutlass.range_constexpr(1, self.count):
            top = self.top_bits(mTops, batch, self.head_base(sources, index) + heads[index])
            downs.append(power_of_two(-scale_exponent(float_of_bits(top))))
        tid, _, _ = cute.arch.thread_idx()
        if tid == 0:
            if const_expr(self.backward):
                down_q, down_k, down_v, down_do = downs
                mScales[batch, head, SCALE_SCORES] = down_q * down_k
                mScales[batch, head, SCALE_DP] = down_v * down_do
                mScales[batch, head, SCALE_DQ] = down_k
                mScales[batch, head, SCALE_DK] = down_q
                mScales[batch, head, SCALE_DV] = down_do * Float32(1.0 / P_SCALE)
            else:
                down_q, down_k, down_v = downs
                mScales[batch, head, FWD_SCALE_SCORES] = down_q * down_k
                mScales[batch, head, FWD_SCALE_O] = down_v * Float32(1.0 / P_SCALE)

    @cute.jit
    def split_block(self, src: cute.Tensor, dst: cute.Tensor, e: Int32, piece: cutlass.Constexpr, block, head, batch):
        """ROWS rows (row block `block`) of one (batch, head), the columns of one of pieces(),
        scaled by 2^e and split."""
        tid, _, _ = cute.arch.thread_idx()
        src_col, cols, dst_col, lo_col = piece
        threads, load = row_copy(Float32, THREADS, cols, VECTOR, ROWS)
        store = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float16, num_bits_per_copy=16 * VECTOR),
            cute.make_ordered_layout((threads * VECTOR // cols, cols // VECTOR), order=(1, 0)),
            cute.make_layout((1, VECTOR)))
        if tid < threads:
            factor = power_of_two(e)
            rows_left = src.shape[2] - block * ROWS
            src_rows, dst_rows = src[batch, head, None, None], dst[batch, head, None, None]
            if const_expr(src_col > 0):
                src_rows = cute.domain_offset((0, src_col), src_rows)
            if const_expr(dst_col > 0):
                dst_rows = cute.domain_offset((0, dst_col), dst_rows)
            coords, src_tile, hi_tile, lo_tile = chunk_row_partitions(
                load.get_slice(tid), store.get_slice(tid), src_rows, dst_rows, block, ROWS, cols, lo_col)
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
    count = 4

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D) float32
        mK: cute.Tensor,  # (B, Nkv, Sk, D)
        mV: cute.Tensor,  # (B, Nkv, Sk, D)
        mDO: cute.Tensor,  # (B, N, Sq, D)
        mQOut: cute.Tensor,  # (B, N, Sq, 2T) fp16
        mKOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mVOut: cute.Tensor,  # (B, Nkv, Sk, 2T)
        mDOOut: cute.Tensor,  # (B, N, Sq, 2T)
        mTops: cute.Tensor,  # (B, 2 N + 2 Nkv, TOP_PARTIALS) int32
        reduced: Int32,
        mScales: cute.Tensor,  # (B, N, 5) float32
        stream: cuda.CUstream,
    ):
        self.launch((mQ, mK, mV, mDO), (mQOut, mKOut, mVOut, mDOOut), mTops, reduced, mScales, stream)
