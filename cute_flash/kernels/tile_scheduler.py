"""Which output tile a CTA computes (which key blocks a tile needs: block_ranges.py).

Tiles are numbered m_block-fastest: consecutive tiles share a (head, batch), so the K/V of
one head is read from L2 by all of its query tiles while it is hot. Under causal masking the
tiles near the end of the sequence do the most work; they get the lowest numbers (longest
processing time first) so the short ones fill the tail.

One CTA per tile (grid.x = number of tiles, limit 2^31 - 1, so any B * N fits).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_flash.kernels.problem import AttentionProblem


class TileScheduler:
    def __init__(self, block_m: int, problem: AttentionProblem):
        self.block_m = block_m
        # Longest first: with a causal mask the last query blocks see the most keys.
        self.reverse_m_blocks = problem.causal

    def grid(self, seqlen_q, num_heads, batch):
        return (cute.ceil_div(seqlen_q, self.block_m) * num_heads * batch, 1, 1)

    @cute.jit
    def tile_coords(self, tile: Int32, seqlen_q: Int32, num_heads: Int32):
        """(m_block, head, batch) of a tile number."""
        num_m_blocks = (seqlen_q + self.block_m - 1) // self.block_m
        m_block = tile % num_m_blocks
        head_batch = tile // num_m_blocks
        if cutlass.const_expr(self.reverse_m_blocks):
            m_block = num_m_blocks - 1 - m_block
        return m_block, head_batch % num_heads, head_batch // num_heads
