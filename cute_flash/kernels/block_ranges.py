"""Which blocks of the other sequence a block sees, and which of those need a mask: the one
place that knows the mask's shape in block terms (the forward and the dQ kernel walk key
blocks for a query block; the backward's main kernel walks query blocks for a key block).

The mask is a band (kernels/problem.py): query i sees key j iff
    i + offset - left <= j <= i + offset + right  and  j < Sk,
offset = 0 (top-left) or Sk - Sq (bottom-right, a run-time value). A block pair entirely
outside the band is skipped; a pair the band's edges cross, or that contains the key tail
(keys past Sk), runs with mask.py's element mask; every other pair runs unmasked. The two
directions' ranges are exact duals (key block n is in query block m's range iff m is in n's),
which the deterministic backward's turn counts rely on.

Numerators that may be negative (a bottom-right offset, a window reaching before key 0)
are clamped to 0 before dividing: a clamped bound only ever lands outside the range it is
then clamped to anyway.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


class BlockRanges:
    def __init__(self, block_m: int, block_n: int, problem: AttentionProblem):
        self.block_m = block_m  # query rows per block
        self.block_n = block_n  # keys per block
        self.left = problem.left  # None: unbounded
        self.right = problem.right  # None: unbounded; 0: causal
        self.bottom_right = problem.bottom_right
        # The key range of a query block may be empty (rows that see no key): bottom-right
        # alignment with Sq > Sk, a left bound with Sq > Sk + left, or a packed sequence or a
        # cache's without keys (Sk = 0: the host handles that of a dense batch). A split part
        # (split_key_blocks) starts anywhere in its tile's range, possibly past the blocks the
        # band's right edge leaves unmasked: unmasked_key_blocks' clamp to the range's start
        # keeps its masked and unmasked runs within the blocks the producer loads.
        self.may_have_no_keys = problem.packed or problem.cached_keys
        self.may_be_empty = (problem.bottom_right or self.left is not None or self.may_have_no_keys
                             or problem.split_keys)
        # (The masks that reach a block's start from below 0: a negative numerator.)
        self.right_may_go_negative = problem.bottom_right or (self.right is not None and self.right > 0)

    @cute.jit
    def offset(self, seqlen_q: Int32, seqlen_k: Int32):
        """Key index of query 0's diagonal."""
        off = 0
        if const_expr(self.bottom_right):
            off = seqlen_k - seqlen_q
        return off

    # Key blocks of a query block (forward, dQ kernel).

    @cute.jit
    def key_blocks(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[start, end) of the key blocks any row of query block m_block sees. Where no row
        sees a key, one block anyway (its element mask hides every key): the kernels' first
        block always runs, and a row that sees nothing ends with O = 0 and LSE = -inf."""
        off = self.offset(seqlen_q, seqlen_k)
        keys = seqlen_k
        if const_expr(self.right is not None):
            keys = cutlass.min(seqlen_k, (m_block + 1) * self.block_m + off + self.right)
        if const_expr(self.bottom_right):
            keys = cutlass.max(keys, 0)
        end = (keys + self.block_n - 1) // self.block_n
        start = 0
        if const_expr(self.left is not None):
            start = cutlass.max(m_block * self.block_m + off - self.left, 0) // self.block_n
        if const_expr(self.may_be_empty):
            last = (seqlen_k + self.block_n - 1) // self.block_n - 1
            if const_expr(self.may_have_no_keys):
                last = cutlass.max(last, 0)  # block 0, every key of it masked (past Sk = 0)
            start = cutlass.min(start, last)
            end = cutlass.max(end, start + 1)
        return start, end

    @cute.jit
    def split_key_blocks(self, start: Int32, end: Int32, seqlen_k: Int32, split: Int32, splits: Int32):
        """Split keys (problem.split_keys): (keys, lo, hi), part `split` of `splits` of a tile's
        key blocks [start, end), nearly equal runs of consecutive blocks (sizes differ by at
        most one; the products stay within int32 below 2^31 / splits blocks). keys is
        seqlen_k, or 0 for a part without blocks, which then walks block 0 with every key
        masked as past its end: its rows end with O = 0 and LSE = -inf, weight 0 in the
        merge."""
        count = end - start
        lo = start + split * count // splits
        hi = start + (split + 1) * count // splits
        has_blocks = cutlass.min(hi - lo, 1)
        return seqlen_k * has_blocks, lo * has_blocks, cutlass.max(hi * has_blocks, lo * has_blocks + 1)

    @cute.jit
    def unmasked_key_blocks(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, start: Int32, last: Int32):
        """(lo, hi): key blocks [lo, hi) need no mask for query block m_block, with
        start <= lo <= hi <= last (the caller's bound: the forward runs the range's last
        block on its own, always masked)."""
        off = self.offset(seqlen_q, seqlen_k)
        hi = seqlen_k // self.block_n
        if const_expr(self.right is not None):
            # The first row sees keys up to m_block * block_m + off + right.
            first_row_keys = m_block * self.block_m + off + self.right + 1
            if const_expr(self.right_may_go_negative):
                first_row_keys = cutlass.max(first_row_keys, 0)
            hi = cutlass.min(hi, first_row_keys // self.block_n)
        hi = cutlass.min(hi, last)
        lo = start  # 0 unless a left bound or a split part moves the range's start
        if const_expr(self.may_be_empty):
            hi = cutlass.max(hi, start)
        if const_expr(self.left is not None):
            # The last row sees keys from (m_block + 1) * block_m - 1 + off - left on.
            last_row_first_key = cutlass.max((m_block + 1) * self.block_m - 1 + off - self.left, 0)
            lo = cutlass.min(cutlass.max((last_row_first_key + self.block_n - 1) // self.block_n, start), hi)
        return lo, hi

    # Query blocks of a key block (backward main kernel).

    @cute.jit
    def query_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[min, max) of the query blocks that see key block n_block (may be empty)."""
        off = self.offset(seqlen_q, seqlen_k)
        m_block_max = (seqlen_q + self.block_m - 1) // self.block_m
        if const_expr(self.left is not None):
            # Rows up to the block's last key - off + left see it.
            rows = cutlass.max((n_block + 1) * self.block_n - 1 - off + self.left + self.block_m, 0)
            m_block_max = cutlass.min(m_block_max, rows // self.block_m)
        m_block_min = Int32(0)
        if const_expr(self.right is not None):
            # Rows from the block's first key - off - right on see it.
            first_row = n_block * self.block_n - off - self.right
            if const_expr(self.right_may_go_negative):
                first_row = cutlass.max(first_row, 0)
            m_block_min = cutlass.min(first_row // self.block_m, m_block_max)
        return m_block_min, m_block_max

    @cute.jit
    def masked_query_blocks(self, n_block, m_block_min, m_block_max, seqlen_q, seqlen_k):
        """(num_head, num_unmasked_end), counted from m_block_min: of that range, the first
        num_head query blocks need a mask (the band's right edge, or all of them with the key
        tail), those up to num_unmasked_end none, and the rest a mask again (the left edge)."""
        off = self.offset(seqlen_q, seqlen_k)
        total = m_block_max - m_block_min
        num = Int32(0)
        if const_expr(self.right is not None):
            # Blocks whose first row sees the block's last key need no right mask.
            first_row = (n_block + 1) * self.block_n - off - self.right + self.block_m - 1
            if const_expr(self.right_may_go_negative):
                first_row = cutlass.max(first_row, 0)
            num = cutlass.min(total, first_row // self.block_m - m_block_min)
        # The key tail is masked in every query block.
        has_tail = (n_block + 1) * self.block_n > seqlen_k
        num = total if has_tail else num
        unmasked_end = total
        if const_expr(self.left is not None):
            # Blocks whose last row still sees the block's first key need no left mask.
            rows = cutlass.max(n_block * self.block_n - off + self.left + 1, 0)
            unmasked_end = cutlass.max(cutlass.min(total, rows // self.block_m - m_block_min), num)
        return num, unmasked_end

    @cute.jit
    def key_turn(self, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k, descending: cutlass.Constexpr[bool]):
        """Deterministic backward: the position of key block n_block among the key blocks that
        see query block m_block, counted from the first (ascending) or the last (descending)."""
        off = self.offset(seqlen_q, seqlen_k)
        turn = n_block
        if const_expr(descending):
            last = num_n_blocks - 1
            if const_expr(self.right is not None):
                keys = (m_block + 1) * self.block_m - 1 + off + self.right
                if const_expr(self.bottom_right):
                    keys = cutlass.max(keys, 0)
                last = cutlass.min(keys // self.block_n, num_n_blocks - 1)
            turn = last - n_block
        elif const_expr(self.left is not None):
            turn = n_block - cutlass.max(m_block * self.block_m + off - self.left, 0) // self.block_n
        return turn
