"""Issuing one warpgroup GEMM (WGMMA) over the K slices of its operand fragments."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

THREADS_PER_WARPGROUP = 128  # four warps issue one WGMMA together
K_MAJOR = cute.nvgpu.OperandMajorMode.K
MN_MAJOR = cute.nvgpu.OperandMajorMode.MN


def stacked_tiled_mma(dtype, num_warpgroups: int, n: int, b_major=K_MAJOR, a_from_registers: bool = False):
    """The attention kernels' GEMM shape: num_warpgroups warpgroups stacked along M, 64 rows
    and n columns each, fp32 accumulators, A K-major (from shared memory, or from registers
    that an accumulator was converted into), B `b_major`."""
    source = warpgroup.OperandSource.RMEM if a_from_registers else warpgroup.OperandSource.SMEM
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, K_MAJOR, b_major, Float32, atom_layout_mnk=(num_warpgroups, 1, 1), tiler_mn=(64, n),
        a_source=source,
    )


def warpgroup_slice(tiled_mma, wg_idx):
    """WGMMA operands are described per warpgroup: the slice of the warpgroup's first thread."""
    return tiled_mma.get_slice(wg_idx * THREADS_PER_WARPGROUP)


def smem_operands(wg_mma, a, b):
    """The A and B fragments (shared-memory descriptors) of a warpgroup's GEMM on tiles a, b."""
    return wg_mma.make_fragment_A(wg_mma.partition_A(a)), wg_mma.make_fragment_B(wg_mma.partition_B(b))


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
