"""Score masking for one tile, in both orientations: S (rows = queries, the forward and the
dQ kernel) and S^T (rows = keys, the backward's main kernel); the key-length tail and the
band (problem.py: causal, windows, either alignment). Which block pairs need it at all:
block_ranges.py. Masked scores become -inf so that exp2 turns them into exact zeros.

Cost matters: the first key block of every tile is masked. In the WGMMA accumulator layout a
thread's columns are thread 0's columns shifted by a per-thread offset, so each element's test
is written as (compile-time column of thread 0) >= (run-time limit - this thread's offset): one
compare with an immediate and one select per element, no per-element index arithmetic. With
both band edges (a window: every block of a narrow band is masked) a row's kept range becomes a
bit mask over its elements' indices instead, one bit test and one select per element.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64

from cute_flash.kernels.layouts import acc_as_rows_cols
from cute_flash.kernels.problem import AttentionProblem


@cute.jit
def mask_scores(
    acc_s: cute.Tensor,
    tiled_mma: cute.TiledMma,
    tidx: Int32,
    m_block: Int32,
    n_block: Int32,
    seqlen_k: Int32,
    block_m: cutlass.Constexpr[int],
    block_n: cutlass.Constexpr[int],
    problem: cutlass.Constexpr[AttentionProblem],
    transposed: cutlass.Constexpr[bool] = False,
    seqlen_q: Int32 = None,
):
    """-inf where the key is past Sk or outside the row's band (problem.py), in a fragment of
    S (block_m queries x block_n keys), or with transposed=True of S^T (block_n keys x
    block_m queries: the backward's main kernel). Either way a column's test compares thread
    0's compile-time column with per-row run-time limits. seqlen_q: needed with bottom-right
    alignment and with problem.grouped_rows (then Sq, the query positions: row r is position
    r % Sq, head_mapping.py); with problem.row_heads = G row r is position r // G."""
    left, right = problem.left, problem.right
    off = 0
    if cutlass.const_expr(problem.bottom_right):
        off = seqlen_k - seqlen_q
    tile = cute.make_identity_tensor((block_m, block_n))
    if cutlass.const_expr(transposed):
        tile = cute.make_identity_tensor((block_n, block_m))
    coords = acc_as_rows_cols(tiled_mma.get_slice(tidx).partition_C(tile))
    coords_t0 = acc_as_rows_cols(tiled_mma.get_slice(0).partition_C(tile))
    s_rc = acc_as_rows_cols(acc_s)
    col_offset = coords[0, 0][1]
    if cutlass.const_expr(transposed):
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            key = n_block * block_n + coords[r, 0][0]
            # Columns (queries, as thread 0's) below `limit`, or from `end` on, are masked.
            limit = Int32(0)
            if cutlass.const_expr(right is not None):
                limit = key - off - right - m_block * block_m - col_offset
            limit = Int32(block_m) if key >= seqlen_k else limit
            if cutlass.const_expr(left is not None):
                end = key - off + left + 1 - m_block * block_m - col_offset
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    col = coords_t0[0, c][1]
                    s_rc[r, c] = -Float32.inf if col < limit or col >= end else s_rc[r, c]
            else:
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    s_rc[r, c] = -Float32.inf if coords_t0[0, c][1] < limit else s_rc[r, c]
    else:
        # Columns (keys, as thread 0's) at or past `limit`, or below `start`, are masked;
        # limits are block-local and already shifted by this thread's column offset.
        key_limit = seqlen_k - n_block * block_n - col_offset
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            limit = key_limit
            row = m_block * block_m + coords[r, 0][0]
            if cutlass.const_expr(problem.grouped_rows):
                row = row % seqlen_q  # the row's query position
            if cutlass.const_expr(problem.row_heads):
                row = row // problem.row_heads  # the row's query position (position-major rows)
            if cutlass.const_expr(right is not None):
                limit = cutlass.min(limit, row + off + right + 1 - n_block * block_n - col_offset)
            if cutlass.const_expr(left is not None):
                # Both edges: a row's elements kept in [start, limit) as a bit mask of the
                # elements' indices, one bit test (R2P) and one select per element instead of
                # two compares and a select (1.12x on gpt-oss's 128-key window forward, where
                # every block is masked). The index arithmetic assumes the WGMMA layout.
                ncols = cute.size(s_rc, mode=[1])
                if cutlass.const_expr(not _octet_pairs(coords_t0, ncols)):
                    raise ValueError("the band's bit masks assume the WGMMA accumulator's columns")
                start = row + off - left - n_block * block_n - col_offset
                first, end = _elements_below(start, ncols), _elements_below(limit, ncols)
                for chunk in cutlass.range_constexpr((ncols + 31) // 32):
                    keep = _low_bits(end - 32 * chunk) & ~_low_bits(first - 32 * chunk)
                    for j in cutlass.range_constexpr(min(32, ncols - 32 * chunk)):
                        c = 32 * chunk + j
                        s_rc[r, c] = s_rc[r, c] if (keep >> j) & Uint32(1) != Uint32(0) else -Float32.inf
            else:
                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    # A select expression, not an `if` statement: a dynamic `if` around the
                    # store makes the DSL carry the whole fragment through each branch.
                    s_rc[r, c] = -Float32.inf if coords_t0[0, c][1] >= limit else s_rc[r, c]


def _octet_pairs(coords_t0, ncols: int) -> bool:
    """Whether thread 0's columns are the WGMMA accumulator's: two of every eight, column
    8 (c // 2) + c % 2 for element c (compile-time)."""
    return all(coords_t0[0, c][1] == 8 * (c // 2) + c % 2 for c in range(ncols))


@cute.jit
def _elements_below(limit: Int32, ncols: cutlass.Constexpr[int]):
    """How many of a row's ncols elements (_octet_pairs' columns) lie below column `limit`."""
    clamped = cutlass.max(cutlass.min(limit, Int32(4 * ncols)), Int32(0))
    return 2 * (clamped >> 3) + cutlass.min(clamped & 7, Int32(2))


@cute.jit
def _low_bits(count: Int32):
    """A 32-bit mask of the lowest `count` bits (count clamped to [0, 32]; shifted in 64 bits:
    a 32-bit shift by 32 is undefined in LLVM)."""
    bits = cutlass.max(cutlass.min(count, Int32(32)), Int32(0))
    return Uint32((Uint64(1) << Uint64(bits)) - Uint64(1))
