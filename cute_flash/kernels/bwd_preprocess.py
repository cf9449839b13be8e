"""Backward preprocess: per-row statistics the main backward kernel reads, and a zeroed dQ
accumulator.

For each query row i of each (batch, head):
    delta[i]    = sum_d dO[i, d] * O[i, d]              (fp32)
    lse_log2[i] = LSE[i] * log2(e)                       so the main kernel can use exp2
with lse_log2 = +inf for rows whose LSE is -inf (they see no key) and for the padding rows
past Sq: then P = exp2(S * scale * log2(e) - lse_log2) is exactly 0 for them, never NaN.
delta is 0 on the padding rows. dq_accum (the main kernel adds into it with bulk reductions) is
zeroed over the whole padded buffer (a packed sequence's region: the rows of its dQ blocks,
below seqlen_q + TILE_M), and so are two per-(batch, head) counts: main-kernel
CTAs whose dQ additions are complete (the postprocess waits on it, see bwd_postprocess) and
main-kernel CTAs that prepared the head (see bwd_prepare_ahead) -- unless the backward
computes dQ in its own kernel (zero_dq_accum=False; dq_accum and the counts are then never
touched).

Only the first `num_heads_prepared` heads in launch order (j = head + N * batch) are
prepared here; with a fused_preprocess config the main kernel prepares the others (all heads
otherwise: num_heads_prepared = B x N). The counts are zeroed for every head.

One CTA per 128 query rows of one prepared head; the output buffers are padded to a multiple
of 128 rows, so only the reads of O, dO and LSE need a row bound. A packed batch
(kernels/sequences.py): one CTA per 128 rows of a sequence's region of the buffers (its rows
and seqlen_pad.PACKED_ROW_SLACK more), writes clipped to the region (the next sequence's
region follows it). `head_dim` is the tile width
(dq_accum's); O and dO may have fewer columns (a head dim served by a wider tile,
cute_flash.head_dims): then only their first columns are read, the rest count as zeros.
O and dO are read in rows of a power-of-two width (192 columns as 256, the last 64 zeros), so
that a row's threads are whole lanes of one warp for the delta's shuffle reduction.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.kernels import rules
from cute_flash.kernels.layouts import (
    by_first_threads,
    copy_clipped_rows,
    row_copy_threads,
    row_tiled_copy,
    sequence_major,
)
from cute_flash.kernels.optional_arguments import check_given
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.seqlen_pad import PACKED_REGION_EXTRA
from cute_flash.kernels.sequences import PackedBatch, SequenceLayout

TILE_M = 128  # rows per CTA; must equal seqlen_pad.SEQLEN_Q_PAD
NUM_THREADS = 256
# A packed sequence's region (seqlen_pad.PACKED_REGION_EXTRA rows past its own) in TILE_M blocks.
REGION_BLOCKS = PACKED_REGION_EXTRA // TILE_M
LOG2_E = math.log2(math.e)


@cute.jit
def lse_log2_of_lse(lse: Float32) -> Float32:
    """LSE * log2(e), and +inf for a row that sees no key (LSE -inf): P = 0 there, not NaN."""
    return Float32.inf if lse == -Float32.inf else lse * Float32(LOG2_E)


class BackwardPreprocess:
    def __init__(self, dtype, head_dim: int, zero_dq_accum: bool = True, packed: bool = False):
        rules.require("BackwardPreprocess", rules.backward_preprocess(dtype.__name__.lower(), head_dim))
        self.dtype = dtype
        self.head_dim = head_dim
        # O and dO rows as read: the next power of two (see the module docstring).
        self.read_width = 1 << (head_dim - 1).bit_length()
        self.threads_per_row = self.read_width // 8
        # Threads that zero dq_accum: whole rows of 4-float stores (192 of 256 at D = 192).
        self.zeroing_threads = row_copy_threads(NUM_THREADS, head_dim, 4, TILE_M)
        self.zero_dq_accum = zero_dq_accum
        self.packed = packed
        self.sequences = SequenceLayout(AttentionProblem(packed=packed))

    def optional_arguments(self) -> tuple:
        """Which of __call__'s optional arguments (batch) this kernel reads; the others are None
        (optional_arguments.py)."""
        return (self.packed,)

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (B, N, Sq, D)
        mdO: cute.Tensor,  # (B, N, Sq, D)
        mLSE: cute.Tensor,  # (B, N, Sq) fp32
        mLSElog2: cute.Tensor,  # (B, N, Sq_pad) fp32, written
        mDelta: cute.Tensor,  # (B, N, Sq_pad) fp32, written
        mdQaccum: cute.Tensor,  # (B, N, Sq_pad, D) fp32, zeroed
        mdQdone: cute.Tensor,  # (B, N) int32, zeroed
        mPrepared: cute.Tensor,  # (B, N) int32, zeroed
        num_heads_prepared: Int32,  # heads 0 .. num_heads_prepared - 1 in launch order
        batch: PackedBatch | None,  # packed (then B = 1 above), else None (optional_arguments.py)
        stream: cuda.CUstream,
    ):
        check_given("the backward's preprocess", ("batch",), (batch,), self.optional_arguments())
        mO, mdO, mdQaccum, mLSE, mLSElog2, mDelta = [
            sequence_major(t) for t in (mO, mdO, mdQaccum, mLSE, mLSElog2, mDelta)
        ]
        # O / dO: 8 elements (16 bytes) per thread and load. dQaccum: 4 floats per store.
        copy_o = row_tiled_copy(self.dtype, NUM_THREADS, self.read_width, 8, TILE_M)
        copy_acc = row_tiled_copy(Float32, self.zeroing_threads, self.head_dim, 4, TILE_M)
        # Every padded row (not only those below Sq rounded to TILE_M): the main kernel's
        # last query block may read LSE / delta rows up to the buffer's end (a packed
        # sequence's region's end).
        # Heads along x: B x N may pass the 65535 limit of grid y.
        grid = (num_heads_prepared, cute.ceil_div(mLSElog2.shape[0], TILE_M), 1)
        if cutlass.const_expr(self.packed):
            # Heads (num_heads_prepared = N) by the blocks of every sequence's region, numbered
            # without empty ones (SequenceLayout.locate).
            grid = (num_heads_prepared, self.sequences.block_numbers(
                mO.shape[0], TILE_M, batch.cu_seqlens_q.shape[0] - 1, REGION_BLOCKS), 1)
        self.kernel(mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, mdQdone, mPrepared, num_heads_prepared, batch,
                    copy_o, copy_acc).launch(
            grid=grid,
            block=[NUM_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mLSElog2: cute.Tensor,
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdQdone: cute.Tensor,
        mPrepared: cute.Tensor,
        num_heads_prepared: Int32,
        packed: object,  # the PackedBatch of a packed batch, else None
        copy_o: cute.TiledCopy,
        copy_acc: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        linear_head, m_block, _ = cute.arch.block_idx()
        num_heads = mO.shape[2]
        head = linear_head % num_heads
        batch = linear_head // num_heads
        if cutlass.const_expr(self.packed):
            seq, m_block, _ = self.sequences.locate(m_block, TILE_M, False, mO, mO, packed, REGION_BLOCKS)
            batch = seq.index
        else:
            seq = self.sequences.of(batch, mO, mO, packed)
        seqlen_q = seq.seqlen_q
        tile = (TILE_M, self.head_dim)
        read_tile = (TILE_M, self.read_width)
        row_limit = seqlen_q - m_block * TILE_M
        # Rows of this CTA that it writes: all (a dense buffer's padding included), or those
        # in the packed sequence's region.
        region_limit = TILE_M
        if cutlass.const_expr(self.packed):
            region_limit = self.sequences.region_rows(seqlen_q) - m_block * TILE_M

        thr_o = copy_o.get_slice(tidx)
        tOgO = thr_o.partition_S(cute.local_tile(self.sequences.rows(mO, head, seq), read_tile, (m_block, 0)))
        tOgdO = thr_o.partition_S(cute.local_tile(self.sequences.rows(mdO, head, seq), read_tile, (m_block, 0)))
        tOcO = thr_o.partition_S(cute.make_identity_tensor(read_tile))
        r_o = cute.make_rmem_tensor_like(tOgO)
        r_do = cute.make_rmem_tensor_like(tOgdO)
        r_o.fill(0.0)
        r_do.fill(0.0)
        # mO.shape[1]: static, the tensors' head dim, at most the tile's.
        copy_clipped_rows(copy_o, [(tOgO, r_o), (tOgdO, r_do)], tOcO, row_limit, mO.shape[1], self.read_width)

        gDelta = cute.local_tile(self.sequences.padded_stats(mDelta, head, seq), (TILE_M,), (m_block,))
        products = r_o.load().to(Float32) * r_do.load().to(Float32)
        row_partial = cute.make_rmem_tensor(cute.size(tOgO, mode=[1]), Float32)
        row_partial.store(products.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=(0, None, 1)))
        for m in cutlass.range_constexpr(cute.size(row_partial)):
            total = cute.arch.warp_reduction_sum(row_partial[m], threads_in_group=self.threads_per_row)
            # Rows past Sq loaded zeros, so they write delta = 0.
            if tOcO[0, m, 0][1] == 0:
                if self._writes(tOcO[0, m, 0][0], region_limit):
                    gDelta[tOcO[0, m, 0][0]] = total

        if tidx < TILE_M:
            lse = Float32.inf
            if tidx < row_limit:
                lse = mLSE[seq.offset_q + m_block * TILE_M + tidx, head, seq.batch]
            gLSElog2 = cute.local_tile(self.sequences.padded_stats(mLSElog2, head, seq), (TILE_M,), (m_block,))
            if self._writes(tidx, region_limit):
                gLSElog2[tidx] = lse_log2_of_lse(lse)

        if cutlass.const_expr(self.zero_dq_accum):
            zero_limit = region_limit
            if cutlass.const_expr(self.packed):
                # Only the rows of the sequence's dQ blocks are ever summed into and read back:
                # its last block (block_m <= TILE_M rows, rules.backward) ends before row
                # seqlen_q + TILE_M, and the region's rows past that (PACKED_REGION_EXTRA is
                # for the per-row statistics) need no zeros (~140 MB fewer bytes written on a
                # 64k-token batch of 34 sequences and 32 heads).
                zero_limit = cutlass.min(region_limit, row_limit + TILE_M)
            by_first_threads(tidx, self.zeroing_threads, NUM_THREADS, self._zero_dq_accum, mdQaccum, head, seq, m_block,
                             tile, zero_limit, copy_acc, tidx)
            if m_block == 0:
                # The counts of every head, prepared here or not: heads j = linear_head,
                # linear_head + num_heads_prepared, ... spread over this CTA's threads.
                num_batches = mO.shape[3]  # a packed batch counts per head (SequenceLayout.counter_batch)
                total_heads = num_heads * num_batches
                for j in cutlass.range(linear_head + tidx * num_heads_prepared, total_heads,
                                       NUM_THREADS * num_heads_prepared, unroll=1):
                    mdQdone[j // num_heads, j % num_heads] = Int32(0)
                    mPrepared[j // num_heads, j % num_heads] = Int32(0)

    @cute.jit
    def _zero_dq_accum(self, mdQaccum, head, seq, m_block, tile, zero_limit, copy_acc, tidx):
        thr_acc = copy_acc.get_slice(tidx)
        gA = cute.local_tile(self.sequences.padded_rows(mdQaccum, head, seq), tile, (m_block, 0))
        tAgA = thr_acc.partition_D(gA)
        zeros = cute.make_rmem_tensor_like(tAgA)
        zeros.fill(0.0)
        if cutlass.const_expr(self.packed):
            tAcA = thr_acc.partition_D(cute.make_identity_tensor(tile))
            copy_clipped_rows(copy_acc, [(zeros, tAgA)], tAcA, zero_limit, self.head_dim, self.head_dim)
        else:
            cute.copy(copy_acc, zeros, tAgA)

    def _writes(self, row, region_limit):
        """Whether this CTA writes its row `row` (a compile-time True for a dense buffer)."""
        if cutlass.const_expr(self.packed):
            return row < region_limit
        return True
