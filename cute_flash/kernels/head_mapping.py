"""Which key/value head a query head reads: the same head, or with grouped-query attention
(problem.grouped: k and v have Nkv heads, Nkv dividing N) head h // (N / Nkv), so that
the N / Nkv query heads of a group read one K/V head and no per-query-head copy of k or v
exists. The group size is a run-time value (the tensors' head counts).

With problem.grouped_rows the group is in a tile's rows instead: the kernel's query heads are
the key/value heads, and row r of key/value head h is query head h * group + r // Sq at query
position r % Sq (group-major), Sq and the group read from the LSE's (S = Sq, N, B) view. The
masks and key ranges then see positions (`band`), and the LSE goes to its query head and
position (`lse_coords`).

With problem.row_heads = G the group is in the rows position-major: row r of key/value head h
is query head h * G + r % G at position r // G. q and O stay (B, N, S, D) tensors; the kernel
views their rows as two modes, ((G, S), D, N / G, B) (`rows_view`), so that a TMA box of
(G, block_m / G) rows reads a tile's positions for the whole group. The key ranges see
block_m / G positions per tile (`positions_per_tile`)."""

import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


class HeadMapping:
    def __init__(self, problem: AttentionProblem):
        self.grouped = problem.grouped
        self.grouped_rows = problem.grouped_rows
        self.row_heads = problem.row_heads

    def positions_per_tile(self, block_m: int) -> int:
        """Query positions a tile of block_m rows covers (rules.row_heads: G divides block_m)."""
        return block_m // self.row_heads if self.row_heads else block_m

    def row_tile(self, block_m: int):
        """A tile's rows as the TMA boxes and local tiles of rows_view take them."""
        return (self.row_heads, block_m // self.row_heads) if self.row_heads else block_m

    def rows_view(self, t: cute.Tensor) -> cute.Tensor:
        """A kernel-side (S, D, N, B) view of q or O as its tiles' rows: with row_heads
        ((G, S), D, N / G, B), position-major (row r: head r % G of the group, position r // G);
        else t."""
        if const_expr(not self.row_heads):
            return t
        g = self.row_heads
        (s, d, n, b), (ss, sd, sn, sb) = t.shape, t.stride
        return cute.make_tensor(t.iterator, cute.make_layout(((g, s), d, n // g, b),
                                                             stride=((sn, ss), sd, sn * g, sb)))

    def positions(self, mQ: cute.Tensor):
        """Sq of a kernel-side q view (rows_view's)."""
        if const_expr(self.row_heads):
            return mQ.shape[0][1]
        return mQ.shape[0]

    def query_rows(self, mQ: cute.Tensor):
        """Rows of a (head, batch)'s tiles in a kernel-side q view (rows_view's): the grid's."""
        return self.row_count(self.positions(mQ))

    def row_count(self, positions):
        """Rows of a (head, batch)'s tiles: positions x G with row_heads."""
        if const_expr(self.row_heads):
            return positions * self.row_heads
        return positions

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
        with grouped rows (row % Sq, head * group + row // Sq), with row_heads (row // G,
        head * G + row % G); num_heads: the kernel's query heads (key/value heads with grouped
        rows)."""
        if const_expr(self.grouped_rows):
            positions = mLSE.shape[0]
            return row % positions, head * (mLSE.shape[1] // num_heads) + row // positions
        if const_expr(self.row_heads):
            return row // self.row_heads, head * self.row_heads + row % self.row_heads
        return row, head
