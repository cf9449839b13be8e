"""The row sums of the 16-bit probabilities that P V reads, on the tensor cores.

With bounded scores (OnlineSoftmax's fixed offset, a bf16 softcap) no probability is exactly
1, so O must be divided by the sum of P as rounded for P V, not by the float32 sum: otherwise
a row that sees one key returns v times (1 + that key's rounding). Summed by the softmax, that
rounded sum took one pack, two unpacks and two adds per pair of scores, ~100 instructions per
thread and key block, and the consumer warps of the three-warpgroup tiles are short of issue
slots. Summed here, the bf16 softcap forward (4, 32, 8192) took 1.12 / 1.14 (causal / full)
of the time without a softcap at D = 128, against 1.22 / 1.24; 1.38 / 1.42 against 1.49 /
1.53 at D = 64 (H200, same rounds; perf/NOTES.md, sixty-fourth session).

Here the same P fragment that P V reads is multiplied by a tile of ones in the same WGMMA
group: each row's sum over the block's keys lands in an accumulator of its own, in float32 as
O's products do, for WGMMA's narrowest N (8) per k step of 16 keys. The ones are one k step's
B tile (8 x 16, 256 bytes), read again for every k step of the block.
"""

import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.layouts import row_major_smem_layout
from cute_flash.kernels.wgmma import K_MAJOR, THREADS_PER_WARPGROUP, stacked_tiled_mma, warpgroup_slice

ONES_COLS = 8  # WGMMA's narrowest N
ONES_KEYS = 16  # one k step of the 16-bit WGMMA
ROWS_PER_THREAD = 2  # of a warpgroup's 64-row accumulator
# The sums' accumulator (4 registers) and the ones' descriptor need room beside a consumer
# thread's fragments (S, P and O: block_n / 2 + block_n / 4 + Dv / 2 registers): with 32 or
# more of its registers left over they compiled without spills (bf16 192 x 128 at D = 64 and
# 192 x 80 at D = 128 on 160 registers, every variant), with 28 the 192 x 112 tile at D = 96
# spilled 12-16 (SASS, sixty-fourth session): there the softmax sums.
MIN_FREE_REGISTERS = 32
# The A/B switch of perf/experiments/softcap_tiles.py (False: the softmax sums the rounded
# probabilities itself, OnlineSoftmax.rounded_sum).
ON_TENSOR_CORES = True


def fits(num_warpgroups: int, registers: int, block_n: int, value_head_dim: int) -> bool:
    """Whether a tile sums on the tensor cores: not with two consumer warpgroups (the wide
    head dims' tiles: their GEMMs bound them, and the N = 8 GEMM cost more than the
    instructions it saved: D = 256 causal 1.039 against 0.998 of the forward without a
    softcap, full level), and only where a consumer thread of `registers` registers has room
    (MIN_FREE_REGISTERS)."""
    fragments = block_n // 2 + block_n // 4 + value_head_dim // 2
    return ON_TENSOR_CORES and num_warpgroups != 2 and registers - fragments >= MIN_FREE_REGISTERS


class ProbabilitySums:
    def __init__(self, dtype, num_warpgroups: int, block_m: int):
        self.dtype = dtype
        self.num_warpgroups = num_warpgroups
        self.block_m = block_m

    def ones_layout(self):
        """The ones tile as a K-major B operand: (N, K) = (8, 16), one 32-byte swizzle atom."""
        return row_major_smem_layout(self.dtype, ONES_COLS, ONES_KEYS)

    def tiled_mma(self):
        """P (registers, as P V reads it) times the ones: 64 rows per warpgroup, N = 8."""
        return stacked_tiled_mma(self.dtype, self.num_warpgroups, ONES_COLS, K_MAJOR, a_from_registers=True)

    @cute.jit
    def fill_ones(self, sOnes: cute.Tensor, tidx):
        """The first ONES_COLS x ONES_KEYS consumer threads write one 1 each; the caller fences
        (generic -> async proxy) and syncs the consumers before the first P V."""
        if tidx < ONES_COLS * ONES_KEYS:
            sOnes[tidx % ONES_COLS, tidx // ONES_COLS] = self.dtype(1.0)

    def operands(self, tiled_mma, wg_idx, sOnes: cute.Tensor):
        """(the ones' B fragment of one k step, this thread's sums accumulator; the caller
        zeroes it with O's)."""
        wg_mma = warpgroup_slice(tiled_mma, wg_idx)
        ones = wg_mma.make_fragment_B(wg_mma.partition_B(sOnes))[None, None, 0]
        acc = cute.make_rmem_tensor(wg_mma.partition_shape_C((self.block_m, ONES_COLS)), Float32)
        return ones, acc

    @staticmethod
    def products(tOrP: cute.Tensor, ones: cute.Tensor):
        """The k slices of P times the ones (wgmma.wgmma_groups' products)."""
        return ((tOrP[None, None, k], ones) for k in range(cute.size(tOrP.shape[2])))

    @staticmethod
    def row_sums(acc: cute.Tensor) -> cute.Tensor:
        """Each of this thread's two rows' whole sum, in the order of OnlineSoftmax's rows
        (layouts.acc_as_rows_cols of O): an N = 8 accumulator holds (row, column pair) as
        values (row r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1), each column the sum."""
        sums = cute.make_rmem_tensor(ROWS_PER_THREAD, Float32)
        for r in range(ROWS_PER_THREAD):  # plain Python: unrolled where the kernel calls it
            sums[r] = acc[2 * r]
        return sums


assert ONES_COLS * ONES_KEYS <= THREADS_PER_WARPGROUP  # fill_ones: one element per thread
