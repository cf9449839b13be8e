"""Which key/value head a query head reads: the same head, or with grouped-query attention
(problem.grouped: k and v have Nkv heads, Nkv dividing N) head h // (N / Nkv), so that
the N / Nkv query heads of a group read one K/V head and no per-query-head copy of k or v
exists. The group size is a run-time value (the tensors' head counts).

With problem.grouped_rows the group is in a tile's rows instead: the kernel's query heads are
the key/value heads, and row r of key/value head h is query head h * group + r % group at query
position r // group (position-major: a tile of block_m rows holds every query head of the
group at block_m / group consecutive positions), Sq and the group read from the LSE's
(S = Sq, N, B) view. The masks and key ranges then see the tile's positions
(`tile_positions`), and the LSE goes to its query head and position (`lse_coords`)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


class HeadMapping:
    def __init__(self, problem: AttentionProblem):
        self.grouped = problem.grouped
        self.grouped_rows = problem.grouped_rows

    @cute.jit
    def kv_head(self, head: Int32, num_heads: Int32, num_kv_heads: Int32):
        """The key/value head of query head `head`."""
        kv = head
        if const_expr(self.grouped):
            kv = head // (num_heads // num_kv_heads)
        return kv

    @cute.jit
    def group_size(self, num_heads: Int32, num_kv_heads: Int32):
        """Query heads per key/value head (1 without grouping, a compile-time 1)."""
        size = 1
        if const_expr(self.grouped):
            size = num_heads // num_kv_heads
        return size

    @cute.jit
    def tile_positions(self, m_block, block_m: cutlass.Constexpr[int], seqlen_q, mLSE: cute.Tensor, num_heads):
        """(first, end, positions, group): the query positions [first, end) of tile m_block's
        rows as the masks and key ranges see them, the query positions (Sq) and the rows per
        position. Without grouped rows the tile's own rows (group 1); with them the positions
        its block_m rows cover (rows past the last position's map past Sq and are never
        written); num_heads: the kernel's query heads (key/value heads with grouped rows)."""
        first, end, positions, group = m_block * block_m, (m_block + 1) * block_m, seqlen_q, Int32(1)
        if const_expr(self.grouped_rows):
            positions = mLSE.shape[0]
            group = mLSE.shape[1] // num_heads
            first = m_block * block_m // group
            end = ((m_block + 1) * block_m + group - 1) // group
        return first, end, positions, group

    def lse_coords(self, row, head, mLSE: cute.Tensor, num_heads):
        """(position, query head) of a tile row's LSE in the (S, N, B) view: (row, head), or
        with grouped rows (row // group, head * group + row % group); num_heads: the kernel's
        query heads (key/value heads with grouped rows)."""
        if const_expr(self.grouped_rows):
            group = mLSE.shape[1] // num_heads
            return row // group, head * group + row % group
        return row, head
