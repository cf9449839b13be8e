"""What the forward and the separate dQ kernel share: one CTA per block_m query rows of one
(batch, head) (TileScheduler), walking the key blocks those rows see (BlockRanges) with K and
V in num_stages-deep TMA rings; 64 query rows per consumer warpgroup."""

import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels import warp_specialized
from cute_flash.kernels.block_ranges import BlockRanges
from cute_flash.kernels.head_mapping import HeadMapping
from cute_flash.kernels.key_pages import KeyPages
from cute_flash.kernels.layouts import row_major_smem_layout
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.score_transform import ScoreTransform
from cute_flash.kernels.sequences import SequenceLayout
from cute_flash.kernels.tile_scheduler import TileScheduler
from cute_flash.kernels.wgmma import K_MAJOR, MN_MAJOR, stacked_tiled_mma


class QueryBlockKernel:
    MMAS: type  # the subclass's NamedTuple of the two GEMMs (see _tiled_mmas)

    def __init__(self, dtype, head_dim: int, problem: AttentionProblem, config, register_split: dict,
                 value_head_dim: int | None = None, pair_row_bytes: int = 0):
        """register_split: consumer warpgroups -> (consumer, producer) registers per thread.
        value_head_dim: the columns of the second GEMM's B tile (V: v's head dim, of its own
        in the forward of a (D, Dv) pair) and of its output; default head_dim.
        pair_row_bytes: TileScheduler's (0: tiles in per-pair order)."""
        self.dtype = dtype
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim or head_dim
        self.problem = problem
        self.block_m = config.block_m
        self.block_n = config.block_n
        self.num_stages = config.num_stages
        self.num_mma_warpgroups = config.num_mma_warpgroups
        self.num_mma_threads, self.num_threads, self.mma_regs, self.producer_regs = warp_specialized.warp_roles(
            self.num_mma_warpgroups, register_split)
        self.ctas_per_sm = warp_specialized.ctas_per_sm(self.num_mma_warpgroups, register_split)
        # Query heads per thread-block cluster (TileConfig.cluster_heads; the dQ kernel's config has none).
        self.cluster_heads = getattr(config, "cluster_heads", 1)
        self.scheduler = TileScheduler(self.block_m, problem, pair_row_bytes, self.cluster_heads)
        self.heads = HeadMapping(problem)
        # Key ranges by query positions: block_m / G of them per tile with row_heads.
        self.ranges = BlockRanges(self.heads.positions_per_tile(self.block_m), self.block_n, problem)
        self.scores = ScoreTransform(problem)
        self.sequences = SequenceLayout(problem)
        self.pages = KeyPages(problem, self.block_n, head_dim)
        self.value_pages = KeyPages(problem, self.block_n, self.value_head_dim)
        # Float32 tiles run P V on the TF32 WGMMA, whose B operand must be K-major: V arrives
        # transposed, (D, Sk) with the keys contiguous (kernels/tf32_operands.py).
        self.values_transposed = dtype is Float32

    def _tiled_mmas(self):
        """S = Q K^T (both operands K-major in shared memory), and X += A B where A is an
        S-shaped accumulator converted to 16 bits in registers (P, dS) and B a (block_n, Dv)
        tile with Dv contiguous (V, K), which as the B operand (N = Dv, K = block_n) is MN-major
        (K-major where V arrives transposed: values_transposed)."""
        nwg = self.num_mma_warpgroups
        b_major = K_MAJOR if self.values_transposed else MN_MAJOR
        return self.MMAS(stacked_tiled_mma(self.dtype, nwg, self.block_n),
                         stacked_tiled_mma(self.dtype, nwg, self.value_head_dim, b_major, a_from_registers=True))

    def _tile_layouts(self):
        """Swizzled shared-memory layouts of a query tile and of the num_stages-deep K ring
        (and V's, where V has K's width)."""
        q = row_major_smem_layout(self.dtype, self.block_m, self.head_dim)
        return q, row_major_smem_layout(self.dtype, self.block_n, self.head_dim, self.num_stages)

    def _rings(self, layouts) -> dict:
        """(num_stages, bytes per stage) of each ring: the subclass's query-side ring
        (_query_ring), then K and V."""
        def stage_bytes(ring):
            return cute.size_in_bytes(self.dtype, cute.select(ring, mode=[0, 1]))
        return dict(self._query_ring(layouts), k=(self.num_stages, stage_bytes(layouts.k)),
                    v=(self.num_stages, stage_bytes(layouts.v)))
