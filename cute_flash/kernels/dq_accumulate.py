"""How the backward adds a CTA's partial dQ into the shared fp32 accumulator.

Every key block contributes dS K to the dQ of each query block it sees, so the CTAs of one
(batch, head) add into the same rows of dq_accum. Each consumer warpgroup stores its
fragment to shared memory and a dedicated warp of the producer warpgroup (the writer warp)
adds the whole tile with bulk reduce-adds (cp.reduce.async.bulk .add.f32): a few large L2
reductions instead of thousands of 8-byte atomics, and the consumers go back to their GEMMs
as soon as the stores are done. The tile is stored in *fragment order* (see
dq_fragment_copy), so shared-memory stores are conflict-free 16-byte vectors and the bulk
copy is one contiguous range per warpgroup; dq_accum then holds each block_m-row block in
that order, and the postprocess (which builds the same copy and the same dQ MMA) puts it
back in row order.

In deterministic mode the writer warp adds the tiles of one query block in a fixed order of
key blocks, handed on through a per-query-block semaphore.

A mixin of FlashBackwardSm90: it reads the kernel's tile sizes and switches from self.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_flash.config import MAX_DQ_TILE_CHUNKS
from cute_flash.kernels import rules
from cute_flash.kernels.barriers import NUM_NAMED_BARRIERS, BackwardBarrier
from cute_flash.kernels.layouts import (
    by_first_threads,
    copy_clipped_rows,
    row_copy_threads,
    row_tiled_copy,
    transposed_view,
)
from cute_flash.kernels.ptx import (
    bulk_reduce_add_f32,
    count_after_bulk_writes,
    count_completing_after_bulk_writes,
    wait_until_equal,
)
from cute_flash.kernels.wgmma import THREADS_PER_WARPGROUP

# A pair of named barriers per dQ stage s and consumer warpgroup w, "the writer has read the
# tile last staged there" (empty) and "the tile is stored" (full); ids from
# BackwardBarrier.DQ_HANDOFF_FIRST on (see _dq_empty_barrier / _dq_full_barrier).
assert BackwardBarrier.DQ_HANDOFF_FIRST + 2 * MAX_DQ_TILE_CHUNKS <= BackwardBarrier.DQ_CONVERT < NUM_NAMED_BARRIERS
# Threads on each of those barriers: the consumer warpgroup and the writer warp.
DQ_HANDOFF_THREADS = THREADS_PER_WARPGROUP + 32
DQ_FLOATS_PER_STORE = 4  # one 16-byte st.shared / ld.global per thread and step


def dq_fragment_copy(num_mma_warpgroups: int) -> cute.TiledCopy:
    """The register <-> (tile_floats // nwg, nwg) copy of a dQ tile in fragment order:
    consumer thread t of warpgroup w moves its accumulator registers 4 at a time, register
    4k+j going to element k * 512 + 4 t + j of warpgroup w's chunk. Shared by the main
    kernel (registers -> shared memory) and the postprocess (dq_accum -> registers), which
    is what makes the order a private contract of the two."""
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                            num_bits_per_copy=32 * DQ_FLOATS_PER_STORE),
        cute.make_layout((THREADS_PER_WARPGROUP, num_mma_warpgroups)),
        cute.make_layout(DQ_FLOATS_PER_STORE),
    )


def dq_chunk_layout(block_m: int, head_dim: int, num_mma_warpgroups: int) -> cute.Layout:
    """A dQ tile as (floats per warpgroup, warpgroup): each warpgroup's chunk contiguous."""
    return cute.make_layout((block_m * head_dim // num_mma_warpgroups, num_mma_warpgroups))


def dq_staged_layout(block_m: int, head_dim: int, num_mma_warpgroups: int, dq_stages: int) -> cute.Layout:
    """dq_stages dQ tiles one after the other: (floats per warpgroup, warpgroup, stage)."""
    return cute.make_layout((block_m * head_dim // num_mma_warpgroups, num_mma_warpgroups, dq_stages))


def fragment_view(acc: cute.Tensor, partitioned: cute.Tensor) -> cute.Tensor:
    """The accumulator registers in the shape of a dq_fragment_copy partition, in register
    order (register 4k+j is value j of copy k)."""
    assert cute.size(acc) == cute.size(partitioned)
    return cute.make_tensor(acc.iterator, cute.make_layout(partitioned.shape))


CONVERT_VALUES = rules.POSTPROCESS_VALUES  # per thread and row: one 16-byte store of dQ
# dQ tile row padding in shared memory (elements). 16 bytes keep the rows 16-byte aligned
# for the vector reads and shift successive rows by 4 banks.
CONVERT_ROW_PAD = 8


class DqBlockConverter:
    """dQ = dq_accum * softmax_scale for one block_m-row block, converted to fp16 / bf16, by
    the main kernel's consumer thread count: thread t loads exactly the registers consumer
    thread t added (coalesced 16-byte loads through dq_fragment_copy), puts them back in row
    order through shared memory with the dQ MMA's own partition, and the rows go out with
    16-byte stores. The postprocess (bwd_postprocess) converts one block per CTA; a one-launch
    main kernel's last CTA of a head converts the head's blocks itself (fused_postprocess)."""

    def __init__(self, dtype, head_dim: int, block_m: int, num_mma_warpgroups: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_m = block_m
        self.num_mma_warpgroups = num_mma_warpgroups
        self.num_threads = THREADS_PER_WARPGROUP * num_mma_warpgroups
        # Threads that store dQ: whole rows of CONVERT_VALUES-element stores (192 of 256 at D = 192).
        self.store_threads = row_copy_threads(self.num_threads, head_dim, CONVERT_VALUES, block_m)

    def smem_layout(self) -> cute.Layout:
        return cute.make_layout((self.block_m, self.head_dim), stride=(self.head_dim + CONVERT_ROW_PAD, 1))

    def smem_bytes(self) -> int:
        return self.block_m * (self.head_dim + CONVERT_ROW_PAD) * (self.dtype.width // 8)

    def store_copy(self) -> cute.TiledCopy:
        return row_tiled_copy(self.dtype, self.store_threads, self.head_dim, CONVERT_VALUES, self.block_m)

    @cute.jit
    def convert(self, gAccum: cute.Tensor, gdQ: cute.Tensor, row_limit, columns: cutlass.Constexpr[int],
                softmax_scale, tiled_mma_dq, swap_ab: cutlass.Constexpr[bool], store, sdQ, tidx,
                barrier_id: cutlass.Constexpr):
        """gdQ (block_m, D) = gAccum's block (fragment order) x softmax_scale, rows below
        row_limit and columns below `columns` (dQ's head dim). sdQ: smem_layout's tile.
        barrier_id: the named barrier of the converting threads (None: the CTA's). The caller
        orders the loads after the sums' completion, and sdQ's writes after earlier reads."""
        tile = (self.block_m, self.head_dim)
        thr_store = store.get_slice(tidx)
        tQgQ = thr_store.partition_D(gdQ)
        tQcQ = thr_store.partition_D(cute.make_identity_tensor(tile))
        r_dq = cute.make_rmem_tensor_like(tQgQ)
        # The block as the main kernel's writer added it: per-warpgroup chunks of fragments.
        chunks = cute.make_tensor(gAccum.iterator, dq_chunk_layout(self.block_m, self.head_dim,
                                                                   self.num_mma_warpgroups))
        thr_g2r = dq_fragment_copy(self.num_mma_warpgroups).get_slice(tidx)
        thr_mma = tiled_mma_dq.get_slice(tidx)
        # The swapped MMA's accumulator is dQ^T: (D, rows).
        mma_tile = (self.head_dim, self.block_m) if const_expr(swap_ab) else tile
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C(mma_tile), Float32)
        tGg = thr_g2r.partition_S(chunks)
        cute.copy(thr_g2r, tGg, fragment_view(acc, tGg))
        frag = cute.make_rmem_tensor_like(acc, self.dtype)
        frag.store((acc.load() * softmax_scale).to(self.dtype))
        tCsdQ = thr_mma.partition_C(transposed_view(sdQ) if const_expr(swap_ab) else sdQ)
        for i in cutlass.range_constexpr(cute.size(frag)):
            tCsdQ[i] = frag[i]
        self._sync(barrier_id)
        by_first_threads(tidx, self.store_threads, self.num_threads, self._store_rows, store, thr_store, sdQ, r_dq,
                         tQgQ, tQcQ, row_limit, columns)

    @cute.jit
    def _sync(self, barrier_id: cutlass.Constexpr):
        if const_expr(barrier_id is None):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.num_threads)

    @cute.jit
    def _store_rows(self, store, thr_store, sdQ, r_dq, tQgQ, tQcQ, row_limit, columns: cutlass.Constexpr[int]):
        cute.copy(store, thr_store.partition_S(sdQ), r_dq)
        # columns: static, dQ's head dim, at most the tile's.
        copy_clipped_rows(store, [(r_dq, tQgQ)], tQcQ, row_limit, columns, self.head_dim)


class DqAccumulation:
    def _dq_empty_barrier(self, stage, wg):
        return BackwardBarrier.DQ_HANDOFF_FIRST + stage * self.num_mma_warpgroups + wg

    def _dq_full_barrier(self, stage, wg):
        return BackwardBarrier.DQ_HANDOFF_FIRST + (self.dq_stages + stage) * self.num_mma_warpgroups + wg

    @cute.jit
    def _stage_dq(self, acc_dq, sdQ, item, tidx):
        """Hand the tile of step `item` (KeyBlockWork) to the writer warp through shared memory."""
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # Consecutive steps take turns through the stages, on both sides of the hand-off.
        stage = item % self.dq_stages
        thr_r2s = dq_fragment_copy(self.num_mma_warpgroups).get_slice(tidx)
        tRsdQ = thr_r2s.partition_D(sdQ[None, None, stage])
        # The writer's bulk reduction of the tile last staged here has finished reading this
        # warpgroup's chunk.
        cute.arch.barrier(barrier_id=self._dq_empty_barrier(stage, wg), number_of_threads=DQ_HANDOFF_THREADS)
        cute.copy(thr_r2s, fragment_view(acc_dq, tRsdQ), tRsdQ)
        # Generic-proxy stores, read by the bulk copy (async proxy) once the writer is told.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=self._dq_full_barrier(stage, wg), number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def write_dq(self, mdQaccum, sdQ, work, num_n_blocks, mdQsem, mdQdone, seqlen_q, seqlen_k, dq_target=None,
                 sFinished=None):
        """The writer warp: per step (query block of a query head, work: a KeyBlockWork),
        wait for each consumer warpgroup's chunk, add it to dq_accum with one bulk reduction,
        and free the stage for the step that comes dq_stages later once the reductions have
        read it. Lane 0 issues; the warp takes part in the barriers. At the end it counts
        this CTA in mdQdone[batch, head] of each of its query heads once all its reductions
        are performed in global memory (also for a CTA that saw no query block: the
        postprocess waits for every CTA of the head).

        fused_postprocess: a count that reaches dq_target (the CTA is the head's last) sets the
        query head's bit (g of the group) in sFinished[0], which the consumer warpgroups read
        after the DQ_CONVERT barrier (convert_finished_heads); dq_target 0 converts nothing."""
        head, batch, m_block_min, m_block_max = work.head, work.batch, work.m_block_min, work.m_block_max
        num_m_blocks = m_block_max - m_block_min
        num_items = num_m_blocks * work.group
        # The first dq_stages steps find their stages empty.
        for s in cutlass.range_constexpr(self.dq_stages):
            if s < num_items:
                for w in cutlass.range_constexpr(self.num_mma_warpgroups):
                    cute.arch.barrier_arrive(barrier_id=self._dq_empty_barrier((m_block_min + s) % self.dq_stages, w),
                                             number_of_threads=DQ_HANDOFF_THREADS)
        finished = Int32(0)
        if const_expr(self.heads.grouped):
            for g in cutlass.range(work.group, unroll=1):
                last = self._write_dq_head(mdQaccum, sdQ, head * work.group + g, batch, work.seq, m_block_min,
                                           m_block_max, g * num_m_blocks, num_items, work.n_block, num_n_blocks,
                                           mdQsem, mdQdone, seqlen_q, seqlen_k, dq_target)
                if const_expr(self.fused_postprocess):
                    # A branch, not last << g: the host converts in-kernel only for groups of
                    # at most 32 (IN_KERNEL_DQ_MAX_GROUP), and a shift by 32 or more would be
                    # undefined for the larger groups, where last is always 0.
                    if last != 0:
                        finished = finished | (Int32(1) << g)
        else:
            last = self._write_dq_head(mdQaccum, sdQ, head, batch, work.seq, m_block_min, m_block_max, 0, num_items,
                                       work.n_block,
                                       num_n_blocks, mdQsem, mdQdone, seqlen_q, seqlen_k, dq_target)
            if const_expr(self.fused_postprocess):
                finished = last
        if const_expr(self.fused_postprocess):
            if cute.arch.lane_idx() == 0:
                sFinished[0] = finished
            # Its reductions are performed (the counts waited for them): sdQ is free too.
            cute.arch.barrier_arrive(barrier_id=BackwardBarrier.DQ_CONVERT,
                                     number_of_threads=self.num_mma_threads + cute.arch.WARP_SIZE)

    @cute.jit
    def _write_dq_head(self, mdQaccum, sdQ, head, batch, seq, m_block_min, m_block_max, item_base, num_items,
                       n_block, num_n_blocks, mdQsem, mdQdone, seqlen_q, seqlen_k, dq_target):
        """write_dq's steps for query head `head`; its step i is item m_block_min + item_base + i.
        batch indexes the counters, seq (kernels/sequences.py) places the accumulator's rows.
        Returns (lane 0, fused_postprocess) 1 when this CTA's count completed the head, else 0."""
        nwg = self.num_mma_warpgroups
        chunk = self.block_m * self.head_dim // nwg
        lane = cute.arch.lane_idx()
        # dq_accum is (Sq_pad, D) per (batch, head) with D-contiguous rows, so a block of
        # block_m rows is one contiguous range of block_m * D floats.
        gdQaccum = cute.local_tile(
            self.sequences.padded_rows(mdQaccum, head, seq), (self.block_m, self.head_dim), (None, 0)
        )
        sem_row = None  # (mdQsem: None outside deterministic mode)
        if const_expr(self.deterministic):
            sem_row = mdQsem[None, head, batch]
        num_m_blocks = m_block_max - m_block_min
        for i in cutlass.range(num_m_blocks, unroll=1):
            m_block = m_block_min + i
            stage = (m_block + item_base) % self.dq_stages
            gblock = gdQaccum[None, None, m_block].iterator
            sblock = sdQ[None, None, stage].iterator
            if const_expr(self.deterministic):
                if lane == 0:
                    wait_until_equal(sem_row.iterator + m_block,
                                     self._dq_turn(n_block, m_block, num_n_blocks, seqlen_q, seqlen_k))
                    # The previous turn's reductions (async proxy) come before ours.
                    cute.arch.fence_proxy("async.global")
            for w in cutlass.range_constexpr(nwg):
                cute.arch.barrier(barrier_id=self._dq_full_barrier(stage, w), number_of_threads=DQ_HANDOFF_THREADS)
                if lane == 0:
                    bulk_reduce_add_f32(gblock + w * chunk, sblock + w * chunk, chunk * 4)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                if lane == 0:
                    # This turn's sums are in dq_accum before the turn passes on.
                    count_after_bulk_writes(sem_row.iterator + m_block)
            if i + item_base + self.dq_stages < num_items:
                for w in cutlass.range_constexpr(nwg):
                    # Chunk w of this stage is free once its own reduction (committed before
                    # those of chunks w+1.., and followed by the other stages' ones) has read
                    # it: a warpgroup does not wait for the others' chunks.
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(nwg - 1 - w, read=True)
                    cute.arch.sync_warp()
                    cute.arch.barrier_arrive(barrier_id=self._dq_empty_barrier(stage, w),
                                             number_of_threads=DQ_HANDOFF_THREADS)
        completed = Int32(0)
        if lane == 0:
            # Shared memory outlives the last reductions' reads (the count waits for them to
            # be performed), and the count tells the postprocess this CTA's sums are in dq_accum.
            done_ptr = mdQdone.iterator + cute.crd2idx((self.sequences.counter_batch(batch), head), mdQdone.layout)
            if const_expr(self.fused_postprocess):
                completed = count_completing_after_bulk_writes(done_ptr, dq_target)
            else:
                count_after_bulk_writes(done_ptr)
        return completed
