"""The backward preprocess, done inside the main kernel for heads launched later.

The preprocess (bwd_preprocess) is memory-bound: it reads O and dO and writes delta,
LSE * log2(e) and a zeroed dQ accumulator, ~2 bytes of traffic per byte of Q and dO, and it
runs alone before the compute-bound main kernel (~0.7 ms of a 50 ms forward + backward on
(4, 64, 8192, 128)). With `fused_preprocess` the main kernel's two idle producer warps
(warps 2 and 3: warp 0 issues the TMA loads, warp 1 writes dQ) do that work while the
consumers compute, for the (batch, head) that is launched `prep_ahead` heads after their own:

* heads are counted in launch order, j = head + num_heads * batch (blockIdx.y, .z);
* the preprocess kernel prepares heads 0 .. prep_ahead - 1 before the main kernel starts;
* a CTA of head j with key block n < prep_ctas prepares its share of the padded query rows
  of head j + prep_ahead, then adds 1 (release, GPU scope) to prepared[j];
* a CTA of a head j >= prep_ahead waits (acquire) until prepared[j - prep_ahead] ==
  prep_ctas before its first TMA load of LSE / delta (producer warp) and its first bulk add
  into dq_accum (writer warp); both then read through the async proxy, hence the proxy
  fence after the wait.

The wait cannot deadlock: it waits only for CTAs of a lower linear block index, which the
grid launches first (resident or finished), and the preparing warps wait for nothing. With
prep_ahead chosen so that about two waves of CTAs lie between the two heads, the prepared
rows are written long before they are read and the wait is one acquire load. prep_ahead =
B x N disables it at run time (every head prepared by the preprocess, nothing waited for).

prep_ahead = 0 (launch_bwd: grids run as one launch, whose host time a launch more would
lengthen) prepares every head in this kernel, each by its own first prep_ctas CTAs, and no
preprocess runs: a CTA then also waits for CTAs of its head with a higher index (the other
preparing ones), which cannot deadlock while a head's prep_ctas CTAs fit on the GPU at once
(the grid launches in index order, and every earlier head's preparing CTAs come first).
The host chooses it for grids of one wave, where all of it starts together and each CTA
waits only for the rows its head's CTAs prepare meanwhile, and for a few waves of short heads
(config.runs_as_one_launch), where a head that straddles two waves waits until its last CTA
is dispatched. The counts are not zeroed either:
they are kept between calls and go on counting, and the host passes the total they reach
(prepared_count; the postprocess's target likewise). Those kernels (fused_postprocess, built
for one-launch grids only) prepare in their consumer warpgroups before the first step instead
(prepare_own_rows): 256 threads with 16-byte loads, four passes of rows in flight, through
O's and dO's own row strides. The producer warps' 24 registers allow one 8-byte load per
pass and contiguous rows only: at S = 128 one CTA's 64 passes of a D = 128 head took ~20 us,
half the kernel (perf/NOTES.md, sixty-second session).

Grouped-query attention: the grid's heads are key/value heads, each a unit of `group` query
heads; units take the place of heads above (the preprocess kernel prepares the query heads
of units 0 .. prep_ahead - 1), and a unit's prep_ctas preparing CTAs (a multiple of group)
take one query head each, prep_ctas / group shares of its rows.

Causal: only the first prep_ctas key blocks (the CTAs that walk the most query blocks)
prepare, so that short CTAs near the diagonal are not lengthened by the row work; in a grid run
as one launch, whose CTAs all wait for their own head's preparation, every key block prepares.

A mixin of FlashBackwardSm90 (reads self.dtype, self.head_dim, self.heads, self.num_mma_threads).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_flash.kernels.barriers import BackwardBarrier
from cute_flash.kernels.bwd_preprocess import lse_log2_of_lse
from cute_flash.kernels.layouts import row_tiled_copy
from cute_flash.kernels.ptx import block_idx_uncached, count_when_all_stored, thread_idx_x_uncached, wait_until_equal

PREP_WARPS = (2, 3)  # producer warpgroup warps with nothing else to do
PREP_THREADS = 32 * len(PREP_WARPS)
VALUES = 4  # fp16/bf16 elements of O and dO per thread and load (8 bytes: the warps have 24 registers)
# A one-launch kernel's consumers preparing their own head (prepare_own_rows): two warpgroups'
# threads (a power of two, so that a pass's rows divide the 128-row padding) with 16-byte loads.
OWN_ROWS_THREADS = 256
OWN_ROWS_VALUES = 8
OWN_ROWS_IN_FLIGHT = 4  # passes whose loads are issued together


def share_of_passes(padded, share, shares, rows_per_pass, uniform=lambda value: value):
    """(first_row, num_passes): share `share` of `shares` of a head's `padded` rows, each
    share a whole number of passes of rows_per_pass rows (padded is a multiple of 128, hence
    of rows_per_pass), the last shares fewer or none. `uniform` marks the values warp-uniform
    where the caller's registers are few (prepare_ahead's warps)."""
    rows_per_share = (padded + shares * rows_per_pass - 1) // (shares * rows_per_pass) * rows_per_pass
    first_row = uniform(share * rows_per_share)
    return first_row, uniform(cutlass.max(cutlass.min(padded - first_row, rows_per_share), 0) // rows_per_pass)


class PrepareAhead:
    @cute.jit
    def _prepared_ptr(self, mPrepared, batch, head):
        return mPrepared.iterator + cute.crd2idx((batch, head), mPrepared.layout)

    @cute.jit
    def wait_prepared(self, mPrepared, head, batch, num_heads, prep_ahead, prepared_count):
        """Called by a whole warp; returns once this CTA's head is prepared (lane 0 polls
        the count of the head prep_ahead before it, whose CTAs prepared this one, until it
        reads prepared_count)."""
        linear_head = head + num_heads * batch
        if linear_head >= prep_ahead:
            if cute.arch.lane_idx() == 0:
                preparer = linear_head - prep_ahead
                wait_until_equal(self._prepared_ptr(mPrepared, preparer // num_heads, preparer % num_heads),
                                 prepared_count)
                # Written by generic stores elsewhere, read next by TMA / bulk reductions.
                cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()

    @cute.jit
    def _delta_pass(self, o_passes, do_passes, mDelta_h, p, rows_per_pass, seqlen_q,
                    masked: cutlass.Constexpr[bool]):
        """delta of the rows_per_pass rows of pass p (rows past Sq: 0 when masked)."""
        # The thread index is read afresh: values derived from it would otherwise stay live
        # (and spill) through the loops around this pass.
        tid = thread_idx_x_uncached() - 32 * PREP_WARPS[0]
        copy_o = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=VALUES * self.dtype.width),
            cute.make_layout(PREP_THREADS), cute.make_layout(VALUES),
        )
        thr_o = copy_o.get_slice(tid)
        threads_per_row = self.head_dim // VALUES
        row = p * rows_per_pass + tid // threads_per_row
        tOgO = thr_o.partition_S(o_passes[None, p])
        tOgdO = thr_o.partition_S(do_passes[None, p])
        r_o = cute.make_rmem_tensor_like(tOgO)
        r_do = cute.make_rmem_tensor_like(tOgdO)
        if const_expr(masked):
            r_o.fill(0.0)
            r_do.fill(0.0)
            if row < seqlen_q:
                cute.copy(copy_o, tOgO, r_o)
                cute.copy(copy_o, tOgdO, r_do)
        else:
            cute.copy(copy_o, tOgO, r_o)
            cute.copy(copy_o, tOgdO, r_do)
        products = r_o.load().to(Float32) * r_do.load().to(Float32)
        partial = products.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        total = cute.arch.warp_reduction_sum(partial, threads_in_group=threads_per_row)
        if tid % threads_per_row == 0:
            mDelta_h[row] = total

    @cute.jit
    def prepare_ahead(self, mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, mPrepared, n_block, head, batch,
                      prep_ahead, prep_ctas, tid, num_units, group):
        """Warps PREP_WARPS (tid in [0, PREP_THREADS)): the preprocess of key block n_block's
        share of the rows of unit j + prep_ahead. A unit is a grid head: a query head, or with
        grouped-query attention a key/value head, whose `group` query heads are all prepared
        (num_units per batch). Tensors are sequence-major: mO, mdO (Sq, D, N, B); mLSE (Sq, N,
        B); mLSElog2, mDelta (Sq_pad, N, B); mdQaccum (Sq_pad, D, N, B); mPrepared (B, N)."""
        if const_expr(not self.heads.grouped):
            # The same count (a unit is a query head), read from O as before grouped heads
            # existed: the shipped kernels' SASS stays as measured.
            num_units = mO.shape[2]
        target = head + num_units * batch + prep_ahead
        if target < num_units * mO.shape[3] and n_block < prep_ctas:
            # Every index below is the same in all lanes: said so, ptxas may keep them in
            # uniform registers, out of the 24.
            uniform = cute.arch.make_warp_uniform
            t_unit = uniform(target % num_units)
            t_batch = uniform(target // num_units)
            if const_expr(self.heads.grouped):
                # The unit's prep_ctas CTAs (a multiple of group) split as prep_ctas / group
                # shares of each of its query heads' rows: one head per CTA, no loop (these
                # warps have 24 registers, and a loop over the heads spills).
                self._prepare_head(mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, uniform(n_block // group),
                                   uniform(t_unit * group + n_block % group), t_batch, prep_ctas // group, tid)
            else:
                self._prepare_head(mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, n_block, t_unit, t_batch, prep_ctas,
                                   tid)

            # Counted under this CTA's own unit, whose index is read again rather than kept
            # live through the loops; the waiting CTAs read the rows by TMA (async proxy).
            count_when_all_stored(
                lambda: self._prepared_ptr(mPrepared, block_idx_uncached("z"), block_idx_uncached("y")),
                BackwardBarrier.PREPARE_AHEAD, PREP_THREADS, tid == 0, True,
            )

    @cute.jit
    def _prepare_head(self, mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, n_block, t_head, t_batch, prep_ctas, tid):
        """Share n_block of prep_ctas of the rows of query head t_head of batch t_batch."""
        uniform = cute.arch.make_warp_uniform
        seqlen_q = mO.shape[0]
        padded = mLSElog2.shape[0]
        rows_per_pass = PREP_THREADS * VALUES // self.head_dim
        first_row, num_passes = share_of_passes(padded, n_block, prep_ctas, rows_per_pass, uniform)

        end_row = uniform(first_row + num_passes * rows_per_pass)
        mLSE_h = mLSE[None, t_head, t_batch]
        mLSElog2_h = mLSElog2[None, t_head, t_batch]
        mDelta_h = mDelta[None, t_head, t_batch]
        # Three loops, each with few live addresses: the warps have 24 registers.
        tile = (rows_per_pass, self.head_dim)
        first_pass = uniform(first_row // rows_per_pass)
        copy_acc = row_tiled_copy(Float32, PREP_THREADS, self.head_dim, 4, rows_per_pass)
        thr_acc = copy_acc.get_slice(tid)
        mAcc_h = mdQaccum[None, None, t_head, t_batch]
        for p in cutlass.range(first_pass, first_pass + num_passes, unroll=1):
            tAgA = thr_acc.partition_D(cute.local_tile(mAcc_h, tile, (p, 0)))
            zeros = cute.make_rmem_tensor_like(tAgA)
            zeros.fill(0.0)
            cute.copy(copy_acc, zeros, tAgA)
        for row in cutlass.range(first_row + tid, end_row, PREP_THREADS, unroll=1):
            lse = Float32.inf  # padding rows, as in the preprocess
            if row < seqlen_q:
                lse = mLSE_h[row]
            mLSElog2_h[row] = lse_log2_of_lse(lse)

        # O and dO rows are contiguous (the host runs this only then): a pass is one
        # contiguous range of rows_per_pass * D elements, thread t reading VALUES of them
        # at t * VALUES, so its addresses move by a constant per pass (24 registers).
        pass_elems = rows_per_pass * self.head_dim
        # (pass_elems, pass) views: a static pass stride keeps the 16-byte alignment known.
        passes = cute.make_layout((pass_elems, (seqlen_q + rows_per_pass - 1) // rows_per_pass),
                                  stride=(1, pass_elems))
        o_passes = cute.make_tensor(mO[None, None, t_head, t_batch].iterator, passes)
        do_passes = cute.make_tensor(mdO[None, None, t_head, t_batch].iterator, passes)
        # Passes wholly below Sq, then at most one that Sq cuts, then padding rows only.
        rows_below_sq = cutlass.max(cutlass.min(seqlen_q - first_row, num_passes * rows_per_pass), 0)
        full_passes = uniform(rows_below_sq // rows_per_pass)
        cut_passes = uniform((rows_below_sq - full_passes * rows_per_pass + rows_per_pass - 1) // rows_per_pass)
        for row in cutlass.range(first_row + (full_passes + cut_passes) * rows_per_pass + tid, end_row,
                                 PREP_THREADS, unroll=1):
            mDelta_h[row] = Float32(0.0)  # their LSE is +inf: P = 0
        end_full = uniform(first_pass + full_passes)
        for p in cutlass.range(first_pass, end_full, unroll=1):
            self._delta_pass(o_passes, do_passes, mDelta_h, p, rows_per_pass, seqlen_q, False)
        if cut_passes > 0:
            self._delta_pass(o_passes, do_passes, mDelta_h, end_full, rows_per_pass, seqlen_q, True)

    @cute.jit
    def prepare_own_rows(self, mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, mPrepared, n_block, head, batch,
                         prep_ahead, prep_ctas, tidx, group):
        """A one-launch kernel's (fused_postprocess) consumer warpgroups before their first step,
        tidx in [0, num_mma_threads): with prep_ahead 0 (launch_bwd's counted one-launch path;
        else the preprocess prepared every head), key block n_block < prep_ctas prepares its
        share of its own unit's rows (a query head; with grouped heads one of the group's, as
        prepare_ahead shares them) and counts itself in prepared[batch, head]. Their registers
        allow 16-byte loads through O's and dO's own row strides (the producer warps' 24 do
        not), several passes in flight: every CTA of the head waits for this before its first
        step. Tensors as prepare_ahead's."""
        if prep_ahead == 0 and n_block < prep_ctas:
            if tidx < OWN_ROWS_THREADS:
                if const_expr(self.heads.grouped):
                    self._prepare_own_head(mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, n_block // group,
                                           head * group + n_block % group, batch, prep_ctas // group, tidx)
                else:
                    self._prepare_own_head(mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, n_block, head, batch,
                                           prep_ctas, tidx)
            count_when_all_stored(lambda: self._prepared_ptr(mPrepared, batch, head), BackwardBarrier.EPILOGUE,
                                  self.num_mma_threads, tidx == 0, True)

    @cute.jit
    def _prepare_own_head(self, mO, mdO, mLSE, mLSElog2, mDelta, mdQaccum, share, t_head, t_batch, shares, tid):
        """Share `share` of `shares` of the padded rows of query head t_head of batch t_batch,
        in passes of OWN_ROWS_THREADS * OWN_ROWS_VALUES / D rows (a divisor of 128)."""
        seqlen_q = mO.shape[0]
        padded = mLSElog2.shape[0]
        threads_per_row = self.head_dim // OWN_ROWS_VALUES
        rows_per_pass = OWN_ROWS_THREADS // threads_per_row
        first_row, num_passes = share_of_passes(padded, share, shares, rows_per_pass)
        first_pass = first_row // rows_per_pass
        tile = (rows_per_pass, self.head_dim)
        copy_acc = row_tiled_copy(Float32, OWN_ROWS_THREADS, self.head_dim, OWN_ROWS_VALUES, rows_per_pass)
        thr_acc = copy_acc.get_slice(tid)
        mO_h = mO[None, None, t_head, t_batch]
        mdO_h = mdO[None, None, t_head, t_batch]
        mAcc_h = mdQaccum[None, None, t_head, t_batch]
        mLSE_h = mLSE[None, t_head, t_batch]
        mLSElog2_h = mLSElog2[None, t_head, t_batch]
        mDelta_h = mDelta[None, t_head, t_batch]
        zeros = cute.make_rmem_tensor_like(thr_acc.partition_D(cute.local_tile(mAcc_h, tile, (0, 0))))
        zeros.fill(0.0)
        end_pass = first_pass + num_passes
        # OWN_ROWS_IN_FLIGHT passes at a time, every load issued before any store (which might
        # alias O and dO for all the compiler knows) and none under a branch: a row past Sq (or
        # past the share) loads row Sq - 1 and its product is dropped, so the loads of all the
        # passes are in flight together.
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                   num_bits_per_copy=OWN_ROWS_VALUES * self.dtype.width)
        chunk = tid % threads_per_row
        for p0 in cutlass.range(first_pass, end_pass, OWN_ROWS_IN_FLIGHT, unroll=1):
            loaded = []
            for j in cutlass.range_constexpr(OWN_ROWS_IN_FLIGHT):
                row = (p0 + j) * rows_per_pass + tid // threads_per_row
                source = cutlass.min(row, seqlen_q - 1)
                r_o = cute.make_rmem_tensor((OWN_ROWS_VALUES,), self.dtype)
                r_do = cute.make_rmem_tensor((OWN_ROWS_VALUES,), self.dtype)
                cute.copy(load, cute.local_tile(mO_h[source, None], (OWN_ROWS_VALUES,), (chunk,)), r_o)
                cute.copy(load, cute.local_tile(mdO_h[source, None], (OWN_ROWS_VALUES,), (chunk,)), r_do)
                loaded.append((r_o, r_do))
            for j in cutlass.range_constexpr(OWN_ROWS_IN_FLIGHT):
                p = p0 + j
                if p < end_pass:
                    row = p * rows_per_pass + tid // threads_per_row
                    r_o, r_do = loaded[j]
                    cute.copy(copy_acc, zeros, thr_acc.partition_D(cute.local_tile(mAcc_h, tile, (p, 0))))
                    products = r_o.load().to(Float32) * r_do.load().to(Float32)
                    partial = products.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
                    contribution = Float32(0.0)
                    if row < seqlen_q:
                        contribution = partial
                    total = cute.arch.warp_reduction_sum(contribution, threads_in_group=threads_per_row)
                    if tid % threads_per_row == 0:
                        mDelta_h[row] = total
                        lse = Float32.inf
                        if row < seqlen_q:
                            lse = mLSE_h[row]
                        mLSElog2_h[row] = lse_log2_of_lse(lse)
