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
from cutlass import Float32, const_expr

from cute_flash.config import MAX_DQ_TILE_CHUNKS
from cute_flash.kernels.barriers import NUM_NAMED_BARRIERS, BackwardBarrier
from cute_flash.kernels.ptx import bulk_reduce_add_f32, count_after_bulk_writes, wait_until_equal
from cute_flash.kernels.wgmma import THREADS_PER_WARPGROUP

# A pair of named barriers per dQ stage s and consumer warpgroup w, "the writer has read the
# tile last staged there" (empty) and "the tile is stored" (full); ids from
# BackwardBarrier.DQ_HANDOFF_FIRST on (see _dq_empty_barrier / _dq_full_barrier).
assert BackwardBarrier.DQ_HANDOFF_FIRST + 2 * MAX_DQ_TILE_CHUNKS <= NUM_NAMED_BARRIERS
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
    def write_dq(self, mdQaccum, sdQ, work, num_n_blocks, mdQsem, mdQdone, seqlen_q, seqlen_k):
        """The writer warp: per step (query block of a query head, work: a KeyBlockWork),
        wait for each consumer warpgroup's chunk, add it to dq_accum with one bulk reduction,
        and free the stage for the step that comes dq_stages later once the reductions have
        read it. Lane 0 issues; the warp takes part in the barriers. At the end it counts
        this CTA in mdQdone[batch, head] of each of its query heads once all its reductions
        are performed in global memory (also for a CTA that saw no query block: the
        postprocess waits for every CTA of the head)."""
        head, batch, m_block_min, m_block_max = work.head, work.batch, work.m_block_min, work.m_block_max
        num_m_blocks = m_block_max - m_block_min
        num_items = num_m_blocks * work.group
        # The first dq_stages steps find their stages empty.
        for s in cutlass.range_constexpr(self.dq_stages):
            if s < num_items:
                for w in cutlass.range_constexpr(self.num_mma_warpgroups):
                    cute.arch.barrier_arrive(barrier_id=self._dq_empty_barrier((m_block_min + s) % self.dq_stages, w),
                                             number_of_threads=DQ_HANDOFF_THREADS)
        if const_expr(self.heads.grouped):
            for g in cutlass.range(work.group, unroll=1):
                self._write_dq_head(mdQaccum, sdQ, head * work.group + g, batch, work.seq, m_block_min, m_block_max,
                                    g * num_m_blocks, num_items, work.n_block, num_n_blocks, mdQsem, mdQdone,
                                    seqlen_q, seqlen_k)
        else:
            self._write_dq_head(mdQaccum, sdQ, head, batch, work.seq, m_block_min, m_block_max, 0, num_items,
                                work.n_block,
                                num_n_blocks, mdQsem, mdQdone, seqlen_q, seqlen_k)

    @cute.jit
    def _write_dq_head(self, mdQaccum, sdQ, head, batch, seq, m_block_min, m_block_max, item_base, num_items,
                       n_block, num_n_blocks, mdQsem, mdQdone, seqlen_q, seqlen_k):
        """write_dq's steps for query head `head`; its step i is item m_block_min + item_base + i.
        batch indexes the counters, seq (kernels/sequences.py) places the accumulator's rows."""
        nwg = self.num_mma_warpgroups
        chunk = self.block_m * self.head_dim // nwg
        lane = cute.arch.lane_idx()
        # dq_accum is (Sq_pad, D) per (batch, head) with D-contiguous rows, so a block of
        # block_m rows is one contiguous range of block_m * D floats.
        gdQaccum = cute.local_tile(
            self.sequences.padded_rows(mdQaccum, head, seq), (self.block_m, self.head_dim), (None, 0)
        )
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
        if lane == 0:
            # Shared memory outlives the last reductions' reads (the count waits for them to
            # be performed), and the count tells the postprocess this CTA's sums are in dq_accum.
            count_after_bulk_writes(mdQdone.iterator + cute.crd2idx((self.sequences.counter_batch(batch), head),
                                                                    mdQdone.layout))
