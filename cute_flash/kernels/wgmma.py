"""Issuing one warpgroup GEMM (WGMMA) over the K slices of its operand fragments.

Float32 tiles run on the TF32 WGMMA (m64nNk8): the tensor cores read each float32 operand's
sign, exponent and top 10 mantissa bits (TF32) and accumulate in float32. The DSL has no op
for it (its helpers build the fp16/bf16 and 8-bit ones), so MmaTF32Op describes it to the
same MLIR atom type; both of its operands must be K-major.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup.mma as warpgroup_mma
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, TFloat32
from cutlass.cute.nvgpu import warpgroup

THREADS_PER_WARPGROUP = 128  # four warps issue one WGMMA together
K_MAJOR = cute.nvgpu.OperandMajorMode.K
MN_MAJOR = cute.nvgpu.OperandMajorMode.MN


@dataclass(frozen=True)
class MmaTF32Op(warpgroup_mma.MmaOp):
    """The TF32 warpgroup MMA (A and B TF32, float32 accumulators, K = 8 per instruction)."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, instruction_shape, a_src, a_major_mode, b_major_mode):
        super().__init__(TFloat32, TFloat32, Float32, instruction_shape, a_src, a_major_mode, b_major_mode)
        if a_major_mode != K_MAJOR or b_major_mode != K_MAJOR:
            raise ValueError("the TF32 WGMMA reads both operands K-major")

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        shape_mnk = warpgroup_mma._pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = warpgroup_mma._cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute, self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type, self.a_src._to_ir(),
        )
        # The trait class only carries the atom (the fp16/bf16 one has no dtype-specific fields).
        return warpgroup_mma.MmaF16BF16Trait(
            warpgroup_mma.make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)
        )


def stacked_tiled_mma(dtype, num_warpgroups: int, n: int, b_major=K_MAJOR, a_from_registers: bool = False):
    """The attention kernels' GEMM shape: num_warpgroups warpgroups stacked along M, 64 rows
    and n columns each, fp32 accumulators, A K-major (from shared memory, or from registers
    that an accumulator was converted into), B `b_major`. Float32 tiles: the TF32 WGMMA."""
    source = warpgroup.OperandSource.RMEM if a_from_registers else warpgroup.OperandSource.SMEM
    if dtype is Float32:
        atom = cute.make_mma_atom(MmaTF32Op((64, n, 8), source, K_MAJOR, b_major))
        return cute.make_tiled_mma(atom, (num_warpgroups, 1, 1))
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, K_MAJOR, b_major, Float32, atom_layout_mnk=(num_warpgroups, 1, 1), tiler_mn=(64, n),
        a_source=source,
    )


def side_by_side_tiled_mma(dtype, num_warpgroups: int, n: int, a_major=K_MAJOR, b_major=K_MAJOR):
    """num_warpgroups warpgroups side by side along N, each 64 rows (M) and n columns, A and B
    from shared memory, fp32 accumulators: the backward's GEMMs when the warpgroups split the
    queries of S^T and the head dim of dK / dV (bwd_sm90, split_head_dim)."""
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, a_major, b_major, Float32, atom_layout_mnk=(1, num_warpgroups, 1), tiler_mn=(64, n),
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
    wgmma_products(tiled_mma, acc, k_slices(tCrA, tCrB), zero_init, wait_group)


def k_slices(a, b, *b_stage):
    """The (A, B) fragment k slices of one GEMM, in order (wgmma_products' products); b_stage:
    B's trailing (stage) coordinate, indexed with each k (slicing the stage first compiled to
    other descriptor arithmetic). A generator: each k's slices are made just before their GEMM,
    as the loop that was in wgmma made them (a list made first compiled to other SASS)."""
    return ((a[None, None, k], b[(None, None, k, *b_stage)]) for k in range(cute.size(a.shape[2])))


def wgmma_products(tiled_mma, acc, products, zero_init: bool, wait_group: int):
    """acc (+)= the sum of A B over `products`, an iterable of (A, B) fragment k slices, committed
    as one WGMMA group (then wgmma's wait): wgmma's k slices in order, or the split-operand
    (3xTF32) GEMMs' pairs of high and low parts (kernels/fwd_sm90.py). Plain Python, unrolled
    where the kernel calls it."""
    wgmma_groups(((tiled_mma, acc, products, zero_init),), wait_group)


def wgmma_groups(gemms, wait_group: int):
    """Several GEMMs, each (tiled_mma, acc, products, zero_init) as wgmma_products takes them,
    committed as one WGMMA group, in order (the forward's P V and P's row sums,
    kernels/probability_sums.py: one wait covers both)."""
    warpgroup.fence()
    for tiled_mma, acc, products, zero_init in gemms:
        # A fresh atom per GEMM: its ACCUMULATE flag is changed below, and the flag of a shared
        # atom would otherwise leak across calls.
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for a, b in products:
            cute.gemm(atom, acc, a, b, acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if wait_group >= 0:
        warpgroup.wait_group(wait_group)


def split_products(a, b, a_lo=None, b_lo=None):
    """The k slices of a 3xTF32 GEMM, hi lo + lo hi, then hi hi (wgmma_products): each
    operand's parts are its fragment's first and second half of k steps (q and k: [hi | lo]
    along D), or a fragment of their own (a_lo, b_lo: P's low part, V^T's low half; the
    backward's P^T, dS^T, dS and their Q^T, dO^T, K^T halves). The small
    terms go first: the tensor cores' float32 accumulation drops low bits relative to the
    running sum (perf/NOTES.md, eighteenth session), so they join it while it is small."""
    steps = cute.size(a.shape[2]) if a_lo is not None else cute.size(a.shape[2]) // 2
    a_hi, b_hi = (lambda k: a[None, None, k]), (lambda k: b[None, None, k])
    a_low = (lambda k: a_lo[None, None, k]) if a_lo is not None else (lambda k: a[None, None, k + steps])
    b_low = (lambda k: b_lo[None, None, k]) if b_lo is not None else (lambda k: b[None, None, k + steps])
    products = []
    for k in range(steps):
        products += [(a_hi(k), b_low(k)), (a_low(k), b_hi(k))]
    return products + [(a_hi(k), b_hi(k)) for k in range(steps)]


def wgmma_k_major(tiled_mma, acc, a, b, split_operands: bool, wait_group: int):
    """acc = A B of two K-major shared-memory operands (the backward's S = Q K^T, dP = dO V^T
    and their transposes), committed and waited for as wgmma; split operands (3xTF32): each
    operand hi | lo along K (split_products). Plain Python."""
    if split_operands:
        wgmma_products(tiled_mma, acc, split_products(a, b), True, wait_group)
    else:
        wgmma(tiled_mma, acc, a, b, True, wait_group)
