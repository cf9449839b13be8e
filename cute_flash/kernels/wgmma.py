"""Issuing one warpgroup GEMM (WGMMA) over the K slices of its operand fragments."""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup

THREADS_PER_WARPGROUP = 128  # four warps issue one WGMMA together


@cute.jit
def wgmma(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr[bool], wait_group: cutlass.Constexpr[int]):
    """acc (+)= A B, committed as one WGMMA group; then wait until at most `wait_group` groups
    are in flight (no wait when negative, so the caller can overlap work with the GEMM)."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE flag is changed below, and the flag of a shared
    # atom would otherwise leak across calls.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait_group >= 0):
        warpgroup.wait_group(wait_group)
