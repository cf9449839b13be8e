"""Which key/value head a query head reads: the same head, or with grouped-query attention
(problem.grouped: k and v have Nkv heads, Nkv dividing N) head h // (N / Nkv), so that
the N / Nkv query heads of a group read one K/V head and no per-query-head copy of k or v
exists. The group size is a run-time value (the tensors' head counts).

With problem.grouped_rows the group is in a tile's rows instead: the kernel's query heads are
the key/value heads, and row r of key/value head h is query head h * group + r // Sq at query
position r % Sq (group-major), Sq and the group read from the LSE's (S = Sq, N, B) view. The
masks and key ranges then see positions (`band`), and the LSE goes to its query head and
position (`lse_coords`)."""

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

    def band(self, m_block, seqlen_q, mLSE: cute.Tensor):
        """(query block, query positions) as the masks and key ranges see a tile: (m_block,
        seqlen_q), or with grouped rows (0, Sq): every tile of at least Sq rows holds rows of
        every position, so the positions' block 0 bounds its keys (a superset where a tile
        holds fewer; the mask, which maps each row to its position, is exact)."""
        if const_expr(self.grouped_rows):
            return Int32(0), mLSE.shape[0]
        return m_block, seqlen_q

    def lse_coords(self, row, head, mLSE: cute.Tensor, num_heads):
        """(position, query head) of a tile row's LSE in the (S, N, B) view: (row, head), or
        with grouped rows (row % Sq, head * group + row // Sq); num_heads: the kernel's query
        heads (key/value heads with grouped rows)."""
        if const_expr(self.grouped_rows):
            positions = mLSE.shape[0]
            return row % positions, head * (mLSE.shape[1] // num_heads) + row // positions
        return row, head
