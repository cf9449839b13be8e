"""Which output tile a CTA computes (which key blocks a tile needs: block_ranges.py).

Tiles are numbered m_block-fastest: consecutive tiles share a (head, batch), so the K/V of
one head is read from L2 by all of its query tiles while it is hot. Under causal masking the
tiles near the end of the sequence do the most work; they get the lowest numbers (longest
processing time first) so the short ones fill the tail.

A packed batch (problem.packed) is numbered without the empty tiles a grid over the longest
sequence would have: per head, the block numbers of SequenceLayout.locate (at most one
per sequence left over: its CTA finds no rows and exits).

One CTA per tile (grid.x = number of tiles, limit 2^31 - 1, so any B * N fits).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.sequences import SequenceLayout


class TileScheduler:
    def __init__(self, block_m: int, problem: AttentionProblem):
        self.block_m = block_m
        # Longest first: with a causal mask the last query blocks see the most keys.
        self.reverse_m_blocks = problem.causal
        self.packed = problem.packed
        self.sequences = SequenceLayout(problem)

    def grid(self, seqlen_q, num_heads, batch):
        """seqlen_q: Sq, or a packed batch's total_q (batch: its number of sequences)."""
        if const_expr(self.packed):
            return (self.sequences.block_numbers(seqlen_q, self.block_m, batch) * num_heads, 1, 1)
        return (cute.ceil_div(seqlen_q, self.block_m) * num_heads * batch, 1, 1)

    @cute.jit
    def packed_tile(self, tile: Int32, mQ: cute.Tensor, mK: cute.Tensor, gmem):
        """(m_block, head, Sequence) of a packed grid's tile number (mQ, mK: the kernel's (S, D, N,
        B) views; gmem: its tensors, SequenceLayout.locate). The m_block may lie outside its
        sequence (SequenceLayout.has_rows)."""
        numbers = self.sequences.block_numbers(mQ.shape[0], self.block_m, gmem.cu_seqlens_q.shape[0] - 1)
        seq, m_block, rows = self.sequences.locate(tile % numbers, self.block_m, False, mQ, mK, gmem)
        if const_expr(self.reverse_m_blocks):
            m_block = (rows + self.block_m - 1) // self.block_m - 1 - m_block
        return m_block, tile // numbers, seq

    @cute.jit
    def tile_coords(self, tile: Int32, seqlen_q: Int32, num_heads: Int32):
        """(m_block, head, batch) of a dense grid's tile number (seqlen_q, as for grid)."""
        num_m_blocks = (seqlen_q + self.block_m - 1) // self.block_m
        m_block = tile % num_m_blocks
        head_batch = tile // num_m_blocks
        if cutlass.const_expr(self.reverse_m_blocks):
            m_block = num_m_blocks - 1 - m_block
        return m_block, head_batch % num_heads, head_batch // num_heads
