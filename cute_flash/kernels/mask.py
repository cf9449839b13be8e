"""Score masking for one (block_m x block_n) tile: key-length tail and causal triangle.

Causal is the top-left-aligned lower triangle of SDPA's is_causal: query row i sees keys
j <= i. Masked scores become -inf so that exp2 turns them into exact zeros.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.kernels.layouts import acc_as_rows_cols


@cute.jit
def mask_scores(
    acc_s: cute.Tensor,
    thr_mma: cute.ThrMma,
    m_block: Int32,
    n_block: Int32,
    seqlen_k: Int32,
    block_m: cutlass.Constexpr[int],
    block_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):
    coords = acc_as_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((block_m, block_n))))
    s_rows = acc_as_rows_cols(acc_s)
    # Columns are compared in block-local coordinates: one limit per row, no 64-bit math.
    key_limit = seqlen_k - n_block * block_n
    for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
        limit = key_limit
        if cutlass.const_expr(causal):
            row = m_block * block_m + coords[r, 0][0]
            limit = cutlass.min(limit, row + 1 - n_block * block_n)
        for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
            if coords[r, c][1] >= limit:
                s_rows[r, c] = -Float32.inf
