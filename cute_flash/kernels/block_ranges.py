"""Which blocks of the other sequence a block sees, and which of those need a mask: the one
place that knows the mask's shape in block terms (the forward and the dQ kernel walk key
blocks for a query block; the backward's main kernel walks query blocks for a key block).

Today's masks: none, or causal (top-left aligned: query i sees key j iff j <= i). A block
pair entirely outside the mask is skipped; a block pair the mask crosses, or that contains
the key tail (keys past Sk), runs with mask.py's element mask; every other pair runs unmasked.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


class BlockRanges:
    def __init__(self, block_m: int, block_n: int, problem: AttentionProblem):
        self.block_m = block_m  # query rows per block
        self.block_n = block_n  # keys per block
        self.causal = problem.causal

    # Key blocks of a query block (forward, dQ kernel).

    @cute.jit
    def key_blocks_end(self, m_block: Int32, seqlen_k: Int32) -> Int32:
        """One past the last key block that any row of query block m_block can see."""
        keys = seqlen_k
        if const_expr(self.causal):
            keys = cutlass.min(seqlen_k, (m_block + 1) * self.block_m)
        return (keys + self.block_n - 1) // self.block_n

    @cute.jit
    def key_blocks_unmasked_end(self, m_block: Int32, seqlen_k: Int32) -> Int32:
        """Key blocks below this index need no mask at all for query block m_block."""
        end = seqlen_k // self.block_n
        if const_expr(self.causal):
            end = cutlass.min(end, (m_block * self.block_m + 1) // self.block_n)
        return end

    # Query blocks of a key block (backward main kernel).

    @cute.jit
    def query_block_range(self, n_block: Int32, seqlen_q: Int32):
        """[min, max) of the query blocks that see key block n_block (may be empty)."""
        m_block_max = (seqlen_q + self.block_m - 1) // self.block_m
        m_block_min = Int32(0)
        if const_expr(self.causal):
            # Query i sees key j iff j <= i: the first row that sees this block's first key.
            m_block_min = cutlass.min(n_block * self.block_n // self.block_m, m_block_max)
        return m_block_min, m_block_max

    @cute.jit
    def num_masked_query_blocks(self, n_block, m_block_min, m_block_max, seqlen_k):
        """How many of the first query blocks of that range need a mask (key tail or causal
        diagonal); the rest of the range runs unmasked."""
        total = m_block_max - m_block_min
        num = Int32(0)
        if const_expr(self.causal):
            # Blocks whose first row is above the key block's last key cross the diagonal.
            diag_end = ((n_block + 1) * self.block_n + self.block_m - 1) // self.block_m
            num = cutlass.min(total, diag_end - m_block_min)
        # The key tail is masked in every query block.
        has_tail = (n_block + 1) * self.block_n > seqlen_k
        return total if has_tail else num

    @cute.jit
    def last_key_block(self, m_block, num_n_blocks):
        """The last key block that query block m_block sees."""
        last = num_n_blocks - 1
        if const_expr(self.causal):
            last = cutlass.min(((m_block + 1) * self.block_m - 1) // self.block_n, num_n_blocks - 1)
        return last
