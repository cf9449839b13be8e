"""Which output tile a CTA computes (which key blocks a tile needs: block_ranges.py).

Tiles are numbered m_block-fastest: consecutive tiles share a (head, batch), so the K/V of
one head is read from L2 by all of its query tiles while it is hot. Under causal masking the
tiles near the end of the sequence do the most work; they get the lowest numbers (longest
processing time first) so the short ones fill the tail.

A packed batch (problem.packed, kernels/sequences.py) is numbered without the empty tiles a
grid over the longest sequence would have: per head, sequence b owns the block numbers
[s_b, s_b + ceil(len_b / block_m)) with s_b = (cu_seqlens_q[b] + b * block_m) // block_m,
disjoint ranges that end by total_q // block_m + B, a bound the host has without reading the
offsets. A CTA finds its sequence by a search over the s_b (a warp's 32 lanes narrow the
range 32-fold per round); at most one number per sequence and head is left over (its CTA
finds no rows and exits).

One CTA per tile (grid.x = number of tiles, limit 2^31 - 1, so any B * N fits).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


class TileScheduler:
    def __init__(self, block_m: int, problem: AttentionProblem):
        self.block_m = block_m
        # Longest first: with a causal mask the last query blocks see the most keys.
        self.reverse_m_blocks = problem.causal
        self.packed = problem.packed

    def grid(self, seqlen_q, num_heads, batch):
        """seqlen_q: Sq, or a packed batch's total_q (batch: its number of sequences)."""
        if const_expr(self.packed):
            return ((seqlen_q // self.block_m + batch) * num_heads, 1, 1)
        return (cute.ceil_div(seqlen_q, self.block_m) * num_heads * batch, 1, 1)

    @cute.jit
    def tile_coords(self, tile: Int32, seqlen_q: Int32, num_heads: Int32, cu_seqlens_q=None):
        """(m_block, head, batch) of a tile number (seqlen_q, cu_seqlens_q: as for grid). A
        packed tile's m_block may lie outside its sequence (SequenceLayout.has_rows)."""
        if const_expr(self.packed):
            num_batches = cu_seqlens_q.shape[0] - 1
            numbers = seqlen_q // self.block_m + num_batches
            number = tile % numbers
            batch = self._sequence_of(number, cu_seqlens_q, num_batches, seqlen_q)
            start = self._first_number(batch, cu_seqlens_q, seqlen_q)
            m_block = number - start
            if const_expr(self.reverse_m_blocks):
                rows = self._clamped(cu_seqlens_q[batch + 1], seqlen_q) - self._clamped(cu_seqlens_q[batch], seqlen_q)
                m_block = (rows + self.block_m - 1) // self.block_m - 1 - m_block
            return m_block, tile // numbers, batch
        num_m_blocks = (seqlen_q + self.block_m - 1) // self.block_m
        m_block = tile % num_m_blocks
        head_batch = tile // num_m_blocks
        if cutlass.const_expr(self.reverse_m_blocks):
            m_block = num_m_blocks - 1 - m_block
        return m_block, head_batch % num_heads, head_batch // num_heads

    def _clamped(self, offset, total):
        # As SequenceLayout.of clamps them: offsets outside the tensor give wrong rows, never
        # accesses outside it.
        return cutlass.min(cutlass.max(offset, 0), total)

    @cute.jit
    def _first_number(self, batch, cu_seqlens_q, total):
        return (self._clamped(cu_seqlens_q[batch], total) + batch * self.block_m) // self.block_m

    @cute.jit
    def _sequence_of(self, number, cu_seqlens_q, num_batches, total):
        """The last sequence b whose first number s_b is <= number (s_b non-decreasing): each
        round the warp's lanes test 32 evenly spaced candidates of the range left."""
        lane = cute.arch.lane_idx()
        lo = Int32(0)
        count = num_batches
        # 32-fold narrowing: ceil(bits(B) / 5) rounds.
        rounds = (32 - Int32(cute.arch.clz(num_batches)) + 4) // 5
        for _ in cutlass.range(rounds, unroll=1):
            stride = (count + 31) // 32
            candidate = lo + lane * stride
            at_or_below = cutlass.Boolean(False)
            if candidate < lo + count:
                at_or_below = self._first_number(candidate, cu_seqlens_q, total) <= number
            below = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(at_or_below)))
            step = cutlass.max(below - 1, 0) * stride
            lo = lo + step
            count = cutlass.min(stride, count - step)
        return lo
