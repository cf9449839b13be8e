"""How the backward adds a CTA's partial dQ into the shared fp32 accumulator.

Every key block contributes dS K to the dQ of each query block it sees, so the CTAs of one
(batch, head) add into the same rows of dq_accum. Three ways, chosen by the tile config:
fp32 vector atomics of 2 or 4 floats (dq_red_vector), or the tile through shared memory and
TMA bulk reduce-adds (dq_tma_reduce). In deterministic mode the adds of one query block happen
in a fixed order of key blocks, handed on through a per-query-block semaphore.

A mixin of FlashBackwardSm90: it reads the kernel's tile sizes and switches from self.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.ptx import red_add_f32x2, red_add_f32x4, red_release_add_s32, wait_until_equal

DQ_TURN_BARRIER = 3  # deterministic mode: this CTA's turn to add dQ began / its adds are done
DQ_SMEM_BARRIER = 4  # dq_tma_reduce: every consumer's dQ_partial is in shared memory


class DqAccumulation:
    def _dq_smem_io(self, tiled_mma_dq, tidx, gdQaccum, sdQ, tma_atom_dq):
        """dq_tma_reduce: (register->smem copy, its smem view, TMA atom, TMA smem / gmem views
        with the query block last); None otherwise."""
        if const_expr(not self.dq_tma_reduce):
            return None
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        thr_r2s = cute.make_tiled_copy_C(r2s_atom, tiled_mma_dq).get_slice(tidx)
        tRsdQ = thr_r2s.partition_D(sdQ)
        tTsdQ, tTgdQ = cpasync.tma_partition(
            tma_atom_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
            cute.group_modes(gdQaccum, 0, 2),
        )
        return thr_r2s, tRsdQ, tma_atom_dq, tTsdQ, tTgdQ

    @cute.jit
    def _dq_smem_wait_free(self, tidx):
        """dq_tma_reduce: the thread that issues the reductions waits until the previous one
        has read the dQ buffer; the barrier that follows tells every consumer. Deterministic
        mode waited for full completion already."""
        if const_expr(self.dq_tma_reduce and not self.deterministic):
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _add_dq(self, acc_dq, thr_dq, gdQaccum, dq_io, m_block, n_block, num_n_blocks, sem_row, tidx):
        """dq_accum[m_block] += acc_dq, in turn when deterministic: fp32 vector atomics of
        dq_red_vector floats, or (dq_tma_reduce) through shared memory and TMA reduce-adds."""
        if const_expr(self.dq_tma_reduce):
            self._add_dq_tma(acc_dq, dq_io, m_block, n_block, num_n_blocks, sem_row, tidx)
        else:
            self._add_dq_red(acc_dq, thr_dq, gdQaccum, m_block, n_block, num_n_blocks, sem_row, tidx)

    @cute.jit
    def _add_dq_red(self, acc_dq, thr_dq, gdQaccum, m_block, n_block, num_n_blocks, sem_row, tidx):
        tdQgdQ = thr_dq.partition_C(gdQaccum[None, None, m_block])
        if const_expr(self.deterministic):
            sem_ptr = sem_row.iterator + m_block
            if tidx == 0:
                wait_until_equal(sem_ptr, self._dq_turn(n_block, m_block, num_n_blocks))
            cute.arch.barrier(barrier_id=DQ_TURN_BARRIER, number_of_threads=self.num_mma_threads)
        if const_expr(self.dq_red_vector == 2):
            for i in cutlass.range_constexpr(0, cute.size(acc_dq), 2):
                # Elements 2k and 2k+1 of a WGMMA accumulator are adjacent columns of one row.
                ptr = tdQgdQ.iterator + cute.crd2idx(i, tdQgdQ.layout)
                red_add_f32x2(ptr, acc_dq[i], acc_dq[i + 1])
        else:
            # Elements 4k..4k+3: columns (c, c+1) of row r, then of row r+8; lane l holds
            # c = 8j + 2 * (l % 4). Lanes 2k (c % 4 == 0) and 2k+1 (c % 4 == 2) swap a pair:
            # the even lane sends row r+8 and gets row r, so each lane owns 4 consecutive
            # floats of one row (even: row r from c; odd: row r+8 from c - 2), 16-byte aligned.
            off = lambda i: cute.crd2idx(i, tdQgdQ.layout)  # noqa: E731
            odd_shift = off(2) - off(0) - 2
            for i in cutlass.range_constexpr(0, cute.size(acc_dq), 4):
                assert off(i + 1) - off(i) == 1 and off(i + 2) - off(i) - 2 == odd_shift
            odd = cute.arch.lane_idx() % 2
            is_odd = odd == 1
            base = tdQgdQ.iterator + odd * odd_shift
            for i in cutlass.range_constexpr(0, cute.size(acc_dq), 4):
                a0, a1, b0, b1 = acc_dq[i], acc_dq[i + 1], acc_dq[i + 2], acc_dq[i + 3]
                s0 = a0 if is_odd else b0
                s1 = a1 if is_odd else b1
                r0 = cute.arch.shuffle_sync_bfly(s0, offset=1)
                r1 = cute.arch.shuffle_sync_bfly(s1, offset=1)
                v0 = r0 if is_odd else a0
                v1 = r1 if is_odd else a1
                v2 = b0 if is_odd else r0
                v3 = b1 if is_odd else r1
                red_add_f32x4(base + off(i), v0, v1, v2, v3)
        if const_expr(self.deterministic):
            # Every thread's adds are performed at GPU scope before the turn passes on.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=DQ_TURN_BARRIER, number_of_threads=self.num_mma_threads)
            if tidx == 0:
                red_release_add_s32(sem_ptr, Int32(1))

    @cute.jit
    def _add_dq_tma(self, acc_dq, dq_io, m_block, n_block, num_n_blocks, sem_row, tidx):
        thr_r2s, tRsdQ, tma_atom_dq, tTsdQ, tTgdQ = dq_io
        # The buffer is free: _dq_smem_wait_free ran before the P/dS barrier of this block.
        cute.copy(thr_r2s, thr_r2s.retile(acc_dq), tRsdQ)
        # Generic-proxy stores, read by the TMA (async proxy) after the barrier.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=DQ_SMEM_BARRIER, number_of_threads=self.num_mma_threads)
        if tidx == 0:
            if const_expr(self.deterministic):
                sem_ptr = sem_row.iterator + m_block
                wait_until_equal(sem_ptr, self._dq_turn(n_block, m_block, num_n_blocks))
                # The previous turn's reductions (async proxy) before ours.
                cute.arch.fence_proxy("async.global")
            cute.copy(tma_atom_dq, tTsdQ, tTgdQ[None, m_block])
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                # Wait for the reduction to be performed in global memory (not just for its
                # reads of shared memory), then pass the turn on.
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                cute.arch.fence_proxy("async.global")
                red_release_add_s32(sem_ptr, Int32(1))
