"""FlashAttention forward for Hopper (sm_90a), written in the CuTe DSL.

Shape of the kernel (one CTA per block_m query rows of one (batch, head)):

* warpgroup 0 is the producer. Its first warp issues TMA bulk-tensor loads of Q once and of
  K and V block by block into multi-stage swizzled shared-memory rings, each stage guarded by
  an mbarrier pair (full: bytes landed; empty: every consumer warp is done reading). It keeps
  only a few registers (setmaxnreg) so the consumers can have more.
* warpgroups 1.. are consumers, 64 query rows each. For every key block they run
  S = Q K^T on WGMMA (both operands in shared memory), mask, run the online softmax in
  registers, convert P to fp16/bf16 in place and run O += P V on WGMMA with P as the register
  A operand. The QK^T of block j is issued before the PV of block j-1 (intra-warpgroup
  overlap), so the tensor cores work while the same warpgroup does the softmax. With
  `pingpong` the consumer warpgroups take turns issuing their GEMMs (named barriers), so one
  warpgroup's softmax hides behind the other's GEMMs.
* Epilogue: O is normalised by 1/l, converted, written to shared memory (reusing Q's buffer)
  with stmatrix (float32 O: plain 8-byte stores), and stored by one TMA bulk store that clips
  the sequence tail. The LSE goes straight from registers to global memory.

Float32 q, k, v run both GEMMs on the TF32 WGMMA (kernels/wgmma.py): P stays in its registers,
rounded to TF32, and V arrives transposed (values_transposed), its keys permuted within groups
of 8 to match P's registers (layouts.acc_as_tf32_operand_a); the host rounds q, k and v to
TF32 (cute_flash.float32). With split_operands (float32 accuracy, 3xTF32) every operand is the
sum of two TF32 parts, hi + lo, stored side by side along its head-dim mode (q and k: (S, 2D)
rows [hi | lo]; V^T: (2D, S), hi rows over lo rows; P split in registers), and each GEMM is
hi hi + hi lo + lo hi (the lo lo term is below float32's rounding). Float32 at float32
accuracy may also come as fp16 parts ("float32x3h", scaled halves: dtype Float16 with split
operands): q, k and V as (S, 2D) rows [hi | lo] of x times a power of two per (batch, head)
(cute_flash.float32), P split in registers after scaling by P_SCALE, the same three products
on the fp16 WGMMA (twice TF32's rate, half its bytes), V read as the 16-bit path reads it; the
scores' power of two joins the softmax's scale and O's (with P_SCALE) its last rescale, both
read per tile from the operand-scales argument; O and the LSE are float32.

Key blocks are walked from the last one down to the first, so the blocks that need masks
(the sequence tail and the causal diagonal) come first and the long unmasked run comes last.
"""

import math
from functools import partial
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_flash.kernels import probability_sums, rules, warp_specialized
from cute_flash.kernels.barriers import ForwardBarrier
from cute_flash.kernels.half_operands import FWD_SCALE_O, FWD_SCALE_SCORES, P_SCALE, store_halves
from cute_flash.kernels.key_pages import KeyPages, box_rows
from cute_flash.kernels.layouts import (
    acc_as_operand_a,
    acc_as_rows_cols,
    acc_as_tf32_operand_a,
    accumulator_store_atom,
    column_halves_transposed,
    row_halves,
    row_major_smem_layout,
    sequence_major,
    store_rounded,
    store_rows_clipped,
    transposed_view,
)
from cute_flash.kernels.mask import mask_scores
from cute_flash.kernels.optional_arguments import check_given
from cute_flash.kernels.probability_sums import ProbabilitySums
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.ptx import round_to_tf32
from cute_flash.kernels.softmax import OnlineSoftmax, rescale_rows, rescale_rows_if_needed
from cute_flash.kernels.stale_keys import zero_rows_past_keys
from cute_flash.kernels.tma_pipeline import (
    SWIZZLED_TILE_ALIGN,
    load_stage,
    multicast_to_cluster,
    shared_storage,
    start_rings,
    store_tile,
    swizzled_tensor,
    tma_tiles,
)
from cute_flash.kernels.query_block_kernel import QueryBlockKernel
from cute_flash.kernels.score_transform import ScoreTransform
from cute_flash.kernels.wgmma import (
    THREADS_PER_WARPGROUP,
    k_slices,
    smem_operands,
    split_products,
    warpgroup_slice,
    wgmma,
    wgmma_groups,
    wgmma_products,
)

# Named barrier ids; 0 is __syncthreads.

# Registers per thread after setmaxnreg, by number of consumer warpgroups. The producer needs
# almost none; the consumers hold S, P and O fragments (block_n + D + block_n/2 floats for a
# 64-row slab) plus the softmax state. Totals stay within the 64K-register file.
REGISTER_SPLIT = {2: (240, 24), 3: (160, 32)}
# One consumer warpgroup (config.rows_fitted's tile of at most 64 query rows, e.g. a decode
# step's group of query heads), paged or not: its producer has room for 40 (at 24, a paged
# D = 256 one spilled 3 registers).
ONE_WARPGROUP_SPLIT = (240, 40)
# One consumer warpgroup on tiles at most NARROW_TILE_COLS wide (Q / K and V / O, without
# split operands) takes half the register file instead (warp_specialized.ctas_per_sm: compiled
# within 128 registers per thread, which those tiles fit without spills), so that the split
# merge's CTAs, launched early as the forward's programmatic dependents, find registers on
# the SMs while it runs: a B = 1 decode step over 4k keys 11.7 -> 10.1 us (perf/NOTES.md,
# thirty-third session). Wider tiles do not fit 128 (D = 256's 64 x 256 O accumulator does
# not compile; 3xTF32 at D = 128 spilled 40 registers).
HALF_FILE_SPLIT = (216, 40)
NARROW_TILE_COLS = 128
# A paged cache whose key block takes PAGED_PRODUCER_BOXES or more TMA boxes (pages of 8 or 16
# rows at block_n = 128): the producer's page shuffles spilled 1-2 registers at 24, none at 32
# (D = 96-256 fit 232 consumer registers without spills; tests/test_sass.py).
PAGED_PRODUCER_BOXES = 8
PAGED_REGISTER_SPLIT = {2: (232, 32), 3: (160, 32)}
OUT_VALUES = 8  # per thread and row in a packed batch's O store: 16 bytes


# The kernel's arguments, grouped. The DSL flattens a NamedTuple argument into its fields in
# order, so the kernel's parameter list (and its SASS) is that of the fields one by one.
class ForwardTensors(NamedTuple):
    """Global memory, kernel-side (S, D, N, B) / (S, N, B) views: TMA views of q, k, v, o (o
    plain for a packed batch: stored with per-row predicates)."""
    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor
    # O's plain view where a dense batch's tiles end at the last query (tiles_end_aligned): the
    # first tile, whose rows start before row 0, stores row by row; None otherwise.
    o_rows: object
    lse: cute.Tensor  # plain fp32 view, written from registers
    sink: object  # (N,) fp32 per-head sink logits, or None (problem.sink false)
    # A packed batch's sequence bounds (kernels/sequences.py); None for a dense batch.
    cu_seqlens_q: object  # (B + 1,) int32
    cu_seqlens_k: object  # (B + 1,) int32
    seqused_k: object  # (B,) int32, or None (problem.keys_used false)
    page_table: object  # (B, max_pages) int32 of a paged cache (kernels/key_pages.py), or None
    # (B, N, 2) float32 of scaled halves (cute_flash.float32): per (batch, query head) the
    # factor of its scores and of O; None for other kernels.
    operand_scales: object
    # A dense grid's tile-number divisors, made on the host (TileScheduler.divisors); None for
    # a packed batch.
    tile_divisors: object


class ForwardTiles(NamedTuple):
    """One entry per tile: its TMA atom, or its shared-memory layout (host side) or tensor
    (kernel side)."""
    q: object
    k: object  # num_stages deep in shared memory
    v: object  # num_stages deep in shared memory
    o: object  # a TMA store; aliases q in shared memory


class ForwardPipes(NamedTuple):
    q: object  # PipelineTmaAsync, 1 stage
    k: object
    v: object


class ForwardMmas(NamedTuple):
    qk: cute.TiledMma  # S = Q K^T
    pv: cute.TiledMma  # O += P V, P from registers


class FlashForwardSm90(QueryBlockKernel):
    """Forward kernel for one (dtype, head_dim, value_head_dim, causal, tile config) combination."""

    MMAS = ForwardMmas

    def __init__(self, dtype, head_dim: int, problem: AttentionProblem, config, split_operands: bool = False,
                 value_head_dim: int | None = None):
        """split_operands: float32 q, k, v as TF32 hi | lo pairs (cute_flash.float32,
        "float32x3"): three TF32 GEMMs per GEMM. value_head_dim: the V and O tiles' columns
        (default head_dim; a narrower value tile of its own, e.g. (192, 128), saves P V's
        work and registers)."""
        # Split fp16 operands are float32 inputs' scaled halves (see the module docstring): O in float32.
        self.scaled_halves = split_operands and dtype.width == 16
        self.out_dtype = Float32 if self.scaled_halves else dtype
        dtype_name = rules.SCALED_HALVES if self.scaled_halves else dtype.__name__.lower()
        rules.require("FlashForwardSm90", rules.forward(dtype_name, head_dim, config, value_head_dim))
        split = REGISTER_SPLIT
        if dtype is Float32:  # (the scaled halves read V as the 16-bit kernels do: any batch)
            rules.require("FlashForwardSm90", rules.float32_problem(problem))
        rules.require("FlashForwardSm90", rules.cluster_heads(problem, getattr(config, "cluster_heads", 1)))
        rules.require("FlashForwardSm90", rules.row_heads(problem, dtype_name, config.block_m))
        if problem.page_size:
            rules.require("FlashForwardSm90", rules.paged_keys(problem.page_size, config.block_n))
            if config.block_n // box_rows(problem.page_size, config.block_n) >= PAGED_PRODUCER_BOXES:
                split = PAGED_REGISTER_SPLIT
        narrow = not split_operands and max(head_dim, value_head_dim or head_dim) <= NARROW_TILE_COLS
        split = {**split, 1: HALF_FILE_SPLIT if narrow else ONE_WARPGROUP_SPLIT}
        # Causal tiles longest first across sections of heads (TileScheduler): the tiles of a
        # (head, batch) share its K and V.
        key_row_bytes = (2 if split_operands else 1) * (head_dim + (value_head_dim or head_dim)) * dtype.width // 8
        super().__init__(dtype, head_dim, problem, config, split, value_head_dim, key_row_bytes)
        self.pingpong = config.pingpong
        self.split_operands = split_operands
        # Band tiles end at each sequence's last query (SequenceLayout.aligned_to_end), 16-bit
        # inputs only: float32's kernels keep their tiles aligned to the start (unmeasured).
        self.tiles_end_aligned = self.sequences.tiles_end_aligned and not (split_operands or dtype is Float32)
        # O's rescale one block late, in the shadow of the next S = Q K^T (TileConfig).
        self.rescale_before_pv = config.rescale_before_pv
        # O's rescale on every block, or only where a row of the warp moved (TileConfig).
        self.rescale_o = rescale_rows if config.rescale_every_block else rescale_rows_if_needed
        # Unmasked blocks of a softcap hand the transform to the softmax (OnlineSoftmax.step):
        # the row maximum need not wait for every score's tanh, and a quarter of the exp2 runs
        # on the FMA pipe (kernels/score_transform.py): 2-6 % faster at D = 128 (perf/NOTES.md,
        # twenty-first session). Only with two consumer warpgroups (240 registers): with three
        # (160) the raw scores held beside their tanh spilled (17 registers at fp16 D = 64 with
        # every variant). Capped bf16 scores need no maximum at all (OnlineSoftmax's bounded
        # scores), so their softmax takes the transform on any number of warpgroups.
        self.softmax_offset_log2 = self.scores.bounded_offset_log2(dtype)
        # Bounded scores divide O by the sum of P as P V reads it, summed by the tensor cores
        # where that pays and the registers allow (else by the softmax).
        self.probability_sums = None
        if self.softmax_offset_log2 is not None and probability_sums.fits(
                config.num_mma_warpgroups, self.mma_regs, self.block_n, self.value_head_dim):
            self.probability_sums = ProbabilitySums(dtype, config.num_mma_warpgroups, config.block_m)
        self.softmax_takes_transform = bool(problem.softcap) and (
            config.num_mma_warpgroups == 2 or self.softmax_offset_log2 is not None)
        # Columns of the q and k tiles (rows of V^T's): both parts with split operands; and of
        # V's tile (the scaled halves': [hi | lo] rows too).
        self.operand_cols = 2 * head_dim if split_operands else head_dim
        self.value_operand_cols = 2 * self.value_head_dim if self.scaled_halves else self.value_head_dim
        if split_operands:
            self.pages = KeyPages(problem, self.block_n, self.operand_cols)
            if self.scaled_halves:
                self.value_pages = KeyPages(problem, self.block_n, self.value_operand_cols)
            self.scores = ScoreTransform(problem, float32_accurate=True)

    def optional_arguments(self) -> tuple:
        """Which of __call__'s optional arguments (sink, cu_seqlens_q, cu_seqlens_k, seqused_k,
        page_table, operand_scales) this kernel reads; the others are None (optional_arguments.py)."""
        problem = self.problem
        return (problem.sink, problem.packed, problem.packed or problem.cached_keys, problem.keys_used,
                self.pages.paged, self.scaled_halves)

    def _softmax_fma_columns(self):
        """OnlineSoftmax's fma_columns: the transform's share, where the softmax takes it."""
        if not self.softmax_takes_transform:
            return None
        return self.scores.fma_exp2_columns(self.head_dim, self.softmax_offset_log2 is not None)

    def _smem_layouts(self) -> ForwardTiles:
        q, kv = self._tile_layouts()
        o, v = q, kv
        if const_expr(self.value_head_dim != self.head_dim):
            o = row_major_smem_layout(self.dtype, self.block_m, self.value_head_dim)
            v = row_major_smem_layout(self.dtype, self.block_n, self.value_head_dim, self.num_stages)
        if const_expr(self.split_operands):
            q = row_major_smem_layout(self.dtype, self.block_m, self.operand_cols)
            kv = row_major_smem_layout(self.dtype, self.block_n, self.operand_cols, self.num_stages)
            v = kv
            if const_expr(self.value_head_dim != self.head_dim):
                v = row_major_smem_layout(self.dtype, self.block_n, self.value_operand_cols, self.num_stages)
        if const_expr(self.values_transposed):
            v = row_major_smem_layout(self.dtype, self.operand_cols, self.block_n, self.num_stages)
        if const_expr(self.scaled_halves):
            # float32 O in Q's buffer (block_m x 2D fp16: the same bytes).
            o = row_major_smem_layout(Float32, self.block_m, self.value_head_dim)
        return ForwardTiles(q, kv, v, o)

    def _query_ring(self, layouts: ForwardTiles) -> dict:
        return {"q": (1, cute.size_in_bytes(self.dtype, layouts.q))}

    def _shared_storage(self, layouts: ForwardTiles):
        # O reuses Q's buffer (no larger: rules.forward keeps the value tile at most Q's width).
        tiles = dict(sQ=layouts.q, sK=layouts.k, sV=layouts.v)
        if const_expr(self.probability_sums is not None):
            tiles["sOnes"] = self.probability_sums.ones_layout()
        return shared_storage(self._rings(layouts), {
            name: (self.dtype, cute.cosize(layout), SWIZZLED_TILE_ALIGN) for name, layout in tiles.items()
        }, ("k", "v") if self.cluster_heads > 1 else ())

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D), last mode contiguous
        mK: cute.Tensor,  # (B, N, Sk, D)
        mV: cute.Tensor,  # (B, N, Sk, Dv); values_transposed: (B, N, D, Sk), keys permuted in groups of 8
        mO: cute.Tensor,  # (B, N, Sq, Dv)
        mLSE: cute.Tensor,  # (B, N, Sq) float32
        # The optional arguments (optional_arguments): None where this kernel does not read them.
        mSink: cute.Tensor | None,  # (N,) float32 sink logits
        mCuSeqlensQ: cute.Tensor | None,  # (B + 1,) int32 (packed: then B = 1 above)
        mCuSeqlensK: cute.Tensor | None,  # (B + 1,) int32
        mSeqUsedK: cute.Tensor | None,  # (B,) int32
        mPageTable: cute.Tensor | None,  # (B, max_pages) int32 (paged: k and v are the pages)
        mOperandScales: cute.Tensor | None,  # (B, N, 2) float32
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        check_given("the forward", ("sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "operand_scales"),
                    (mSink, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, mOperandScales), self.optional_arguments())
        # Kernel-side views: (S, D, N, B) so that a (head, batch) slice is a 2-D (S, D) matrix.
        mQ, mK, mV, mO, mLSE = [sequence_major(t) for t in (mQ, mK, mV, mO, mLSE)]
        # With row_heads, q's and O's rows as (G, S) pairs of a key/value head (HeadMapping).
        mQ, mO = self.heads.rows_view(mQ), self.heads.rows_view(mO)
        rows = self.heads.row_tile(self.block_m)

        mmas = self._tiled_mmas()
        layouts = self._smem_layouts()
        sQ_layout, sK_layout, sV_layout, sO_layout = layouts
        warp_specialized.check_shared_memory(self._shared_storage(layouts), "forward",
                                             "fewer stages or a smaller block_n")

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, sQ_layout, (rows, self.operand_cols)
        )
        # K and V: one TMA box per stage, or per page of a paged cache (kernels/key_pages.py);
        # with cluster_heads, each CTA's part of the stage, multicast to the cluster.
        kv_load, mcast = tma_load, dict()
        if const_expr(self.cluster_heads > 1):
            kv_load, mcast = cpasync.CopyBulkTensorTileG2SMulticastOp(), dict(num_multicast=self.cluster_heads)
        kv_box = (self.pages.box_rows, self.operand_cols)
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(kv_load, mK, self.pages.box_layout(sK_layout), kv_box, **mcast)
        if const_expr(self.values_transposed):
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
                kv_load, mV, cute.select(sV_layout, mode=[0, 1]), (self.operand_cols, self.block_n), **mcast)
        else:
            value_cols = self.value_operand_cols
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
                kv_load, mV, self.value_pages.box_layout(sV_layout), (self.value_pages.box_rows, value_cols), **mcast)
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (rows, self.value_head_dim)
        )

        scale_log2 = softmax_scale * Float32(math.log2(math.e))
        packed = const_expr(self.problem.packed)
        # The grid's rows per (head, batch) and batches: its size and, dense, its tiles' divisors.
        query_rows, batches = self.heads.query_rows(mQ), self.sequences.output_batches(mQ, mLSE, mCuSeqlensQ)
        gmem = ForwardTensors(
            tma_q, tma_k, tma_v, mO if packed else tma_o,
            mO if const_expr(self.tiles_end_aligned and not packed) else None, mLSE,
            mSink, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, mOperandScales,
            None if packed else self.scheduler.divisors(query_rows, mQ.shape[2], batches, mK.shape[0]),
        )
        grid = self.scheduler.grid(query_rows, mQ.shape[2], batches)
        warp_specialized.launch(
            self.kernel(gmem, ForwardTiles(tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o), scale_log2, layouts, mmas),
            grid, self.num_threads, stream, self.ctas_per_sm, self.cluster_heads,
        )

    @cute.kernel
    def kernel(self, gmem: ForwardTensors, atoms: ForwardTiles, scale_log2: Float32, layouts: ForwardTiles,
               mmas: ForwardMmas):
        if const_expr(self.problem.split_keys):
            # The parts' merge (kernels/split_merge.py) may launch once every CTA of this grid
            # runs: it waits for the grid's end at its entry, and its launch latency overlaps
            # this kernel instead of following it.
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = warp_specialized.start(atoms)
        storage = cutlass.memory.SmemAllocator().allocate(self._shared_storage(layouts))
        pipes = start_rings(storage, ForwardPipes, self._rings(layouts), self.num_mma_threads, self.cluster_heads)
        # O reuses Q's buffer: Q is dead once the tile's last S = Q K^T has completed.
        buffers = ForwardTiles(storage.sQ, storage.sK, storage.sV, storage.sQ)
        smem = ForwardTiles(*(swizzled_tensor(b, layout) for b, layout in zip(buffers, layouts)))
        if const_expr(self.scaled_halves):
            smem = smem._replace(o=cute.make_tensor(
                cute.recast_ptr(storage.sQ.data_ptr(), layouts.o.inner, dtype=Float32), layouts.o.outer))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(gmem, smem, atoms, pipes)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            tidx, _, _ = cute.arch.thread_idx()
            sOnes = None
            if const_expr(self.probability_sums is not None):
                sOnes = swizzled_tensor(storage.sOnes, self.probability_sums.ones_layout())
            self.consume(mmas, gmem, smem, atoms, pipes, tidx - THREADS_PER_WARPGROUP, scale_log2, sOnes)

    @cute.jit
    def _tile(self, tile, gmem: ForwardTensors):
        """(m_block, head, Sequence) of a tile number (TileScheduler, SequenceLayout)."""
        if const_expr(self.problem.packed):
            m_block, head, seq = self.scheduler.packed_tile(tile, gmem.q, gmem.k, gmem)
        else:
            m_block, head, batch = self.scheduler.tile_coords(tile, gmem.tile_divisors)
            seq = self.sequences.of(batch, gmem.q, gmem.k, gmem)
        if const_expr(self.tiles_end_aligned):
            seq = self.sequences.aligned_to_end(seq, self.heads.positions_per_tile(self.block_m))
        return m_block, head, seq

    @cute.jit
    def _key_range(self, m_block, seq, gmem: ForwardTensors):
        """(seq, start, end, band_block, positions): the key blocks [start, end) the tile
        walks, the sequence as its masks see it (with split keys its part's blocks; a part
        without blocks: a sequence without keys, BlockRanges.split_key_blocks), and the band
        as the masks see it (query positions, HeadMapping.band)."""
        band_block, positions = self.heads.band(m_block, seq.seqlen_q, gmem.lse)
        start, end = self.ranges.key_blocks(band_block, positions, seq.seqlen_k)
        if const_expr(self.problem.split_keys):
            keys, start, end = self.ranges.split_key_blocks(start, end, seq.seqlen_k, seq.split, seq.splits)
            seq = seq._replace(seqlen_k=keys)
        return seq, start, end, band_block, positions

    @cute.jit
    def produce(self, gmem: ForwardTensors, smem: ForwardTiles, atoms: ForwardTiles, pipes: ForwardPipes):
        mQ, mK, mV = gmem.q, gmem.k, gmem.v
        sQ, sK, sV = smem.q, smem.k, smem.v
        tma_atom_q, tma_atom_k, tma_atom_v = atoms.q, atoms.k, atoms.v
        q_pipe, k_pipe, v_pipe = pipes
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        # One tile per CTA, in a loop of one iteration (see consume).
        bid, _, _ = cute.arch.block_idx()
        for tile in cutlass.range(bid, bid + 1, 1, unroll=1):
            m_block, head, seq = self._tile(tile, gmem)
            if self.sequences.has_rows(m_block, self.block_m, seq):
                seq, n_block_min, n_block_max, _, _ = self._key_range(m_block, seq, gmem)
                kv_head = self.heads.kv_head(head, mQ.shape[2], mK.shape[2])
                gQ = cute.local_tile(self.sequences.rows(mQ, head, seq),
                                     (self.heads.row_tile(self.block_m), self.operand_cols), (m_block, 0))
                gK = self.pages.gmem_tiles(self.sequences.rows(mK, kv_head, seq, keys=True))
                tQsQ, tQgQ = tma_tiles(tma_atom_q, sQ, gQ)
                # With cluster_heads, this CTA's part of each K / V stage, multicast to the cluster.
                mcast = multicast_to_cluster(self.cluster_heads)
                tKsK, tKgK = tma_tiles(tma_atom_k, self.pages.smem_boxes(sK), gK, cluster_size=self.cluster_heads)
                pages = self.pages.table_row(gmem.page_table, seq.index)
                load_k = partial(self.pages.load_stage, k_pipe, tma_atom_k, tKgK, tKsK, **mcast)
                if const_expr(self.values_transposed):
                    # V^T: (D, block_n) tiles along the keys (dense batches only: rules.float32_problem).
                    gVt = cute.local_tile(self.sequences.rows(mV, kv_head, seq, keys=True),
                                          (self.operand_cols, self.block_n), (0, None))
                    tVsV, tVgV = tma_tiles(tma_atom_v, sV, gVt, cluster_size=self.cluster_heads)
                    load_v = lambda n_block, state, *_: load_stage(  # noqa: E731
                        v_pipe, tma_atom_v, tVgV, tVsV, n_block, state, **mcast)
                else:
                    gV = self.value_pages.gmem_tiles(self.sequences.rows(mV, kv_head, seq, keys=True))
                    tVsV, tVgV = tma_tiles(tma_atom_v, self.value_pages.smem_boxes(sV), gV,
                                           cluster_size=self.cluster_heads)
                    load_v = partial(self.value_pages.load_stage, v_pipe, tma_atom_v, tVgV, tVsV, **mcast)
                # Issue order mirrors the order the consumers need the tiles in: K of the first
                # block together with Q, then K of block j ahead of V of block j + 1.
                k_state = load_k(n_block_max - 1, k_state, pages, gK.shape[2])
                q_pipe.producer_acquire(q_state)
                cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                q_state.advance()
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    n_block = n_block_max - 2 - i
                    k_state = load_k(n_block, k_state, pages, gK.shape[2])
                    v_state = load_v(n_block + 1, v_state, pages, gK.shape[2])
                v_state = load_v(n_block_min, v_state, pages, gK.shape[2])

    @cute.jit
    def consume(self, mmas: ForwardMmas, gmem: ForwardTensors, smem: ForwardTiles, atoms: ForwardTiles,
                pipes: ForwardPipes, tidx, scale_log2, sOnes):
        tiled_mma_qk, tiled_mma_pv = mmas
        sQ, sK, sV = smem.q, smem.k, smem.v
        q_pipe, k_pipe, v_pipe = pipes
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # WGMMA operands are described per warpgroup, so A/B fragments come from the slice of
        # the warpgroup's first thread.
        wg_mma_qk = warpgroup_slice(tiled_mma_qk, wg_idx)
        wg_mma_pv = warpgroup_slice(tiled_mma_pv, wg_idx)
        tSrQ, tSrK = smem_operands(wg_mma_qk, sQ, sK)
        sVt = sV if const_expr(self.values_transposed) else transposed_view(sV)
        tOrVt_lo, tOrP_lo = None, None
        if const_expr(self.split_operands):
            if const_expr(self.scaled_halves):
                # V's stages as (block_n, D) hi and lo column halves, each the MN-major B operand.
                sVt, sVt_lo = column_halves_transposed(sV, self.block_n, self.value_head_dim)
            else:
                # V^T's stages as (D, block_n) hi and lo halves.
                sVt, sVt_lo = row_halves(sV, self.head_dim, self.block_n)
            tOrVt_lo = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt_lo))
            tOrP_lo = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.block_m, self.block_n)))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_shape_s = wg_mma_qk.partition_shape_C((self.block_m, self.block_n))
        acc_o = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.block_m, self.value_head_dim)), Float32)
        # Split operands: each key block's P V in an accumulator of its own, added to O in
        # float32 (collect_pv): accumulated by the tensor cores across a long sequence's
        # blocks, O lost low bits at every step, on TF32 and on fp16 parts alike (6e-6 relative
        # at 1000 keys, 2.8e-5 at 8191; perf/NOTES.md, forty-fifth session).
        acc_pv = cute.make_rmem_tensor_like(acc_o) if const_expr(self.split_operands) else None
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.block_m, self.block_n)))
        o_scale = None
        if const_expr(self.scaled_halves):
            # The tile's powers of two (one tile per CTA): its scores' joins the softmax's scale.
            bid, _, _ = cute.arch.block_idx()
            _, scaled_head, scaled_seq = self._tile(bid, gmem)
            scale_log2 = scale_log2 * gmem.operand_scales[scaled_seq.batch, scaled_head, FWD_SCALE_SCORES]
            o_scale = gmem.operand_scales[scaled_seq.batch, scaled_head, FWD_SCALE_O]
        softmax = OnlineSoftmax.create(self.scores.softmax_scale_log2(scale_log2),
                                       cute.size(acc_as_rows_cols(acc_o), mode=[0]), self._softmax_fma_columns(),
                                       self.softmax_offset_log2, self.probability_sums is not None)
        ones, acc_sums, tiled_mma_sums = None, None, None
        if const_expr(self.probability_sums is not None):
            tiled_mma_sums = self.probability_sums.tiled_mma()
            ones, acc_sums = self.probability_sums.operands(tiled_mma_sums, wg_idx, sOnes)
            self.probability_sums.fill_ones(sOnes, tidx)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=ForwardBarrier.ONES, number_of_threads=self.num_mma_threads)

        if const_expr(self.pingpong):
            # The first consumer warpgroup goes first: pre-arrive on its own turn barrier.
            if wg_idx == 0:
                cute.arch.barrier_arrive(
                    barrier_id=ForwardBarrier.FIRST_PINGPONG,
                    number_of_threads=2 * THREADS_PER_WARPGROUP,
                )

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        # The CTA's one tile, in a loop of one iteration: what is left of the deleted persistent
        # grid's tile loop (git history). Written straight, the kernel compiles to other SASS
        # (ptxas allocates registers differently), and the shipped kernels were measured with
        # this code.
        bid, _, _ = cute.arch.block_idx()
        for tile in cutlass.range(bid, bid + 1, 1, unroll=1):
            m_block, head, seq = self._tile(tile, gmem)
            if self.sequences.has_rows(m_block, self.block_m, seq):
                seq, n_block_min, n_block_max, band_block, positions = self._key_range(m_block, seq, gmem)
                seqlen_k = seq.seqlen_k
                mask = partial(
                    mask_scores, tiled_mma=tiled_mma_qk, tidx=tidx, m_block=m_block, seqlen_k=seqlen_k,
                    block_m=self.block_m, block_n=self.block_n, seqlen_q=positions,
                )

                # (Defined inside the loop: the DSL does not let staged loops call closures defined
                # outside them.)
                def gemm_qk(stage, wait_group: cutlass.Constexpr[int]):
                    acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
                    if const_expr(self.split_operands):
                        wgmma_products(tiled_mma_qk, acc_s, split_products(tSrQ, tSrK[None, None, None, stage]),
                                       True, wait_group)
                    else:
                        wgmma(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, stage], True, wait_group)
                    return acc_s

                def gemm_pv(stage, wait_group: cutlass.Constexpr[int]):
                    if const_expr(self.split_operands):
                        products = split_products(tOrP, tOrVt[None, None, None, stage], tOrP_lo,
                                                  tOrVt_lo[None, None, None, stage])
                        wgmma_products(tiled_mma_pv, acc_pv, products, True, wait_group)
                    elif const_expr(self.probability_sums is not None):
                        # P's row sums in the same group: P V's wait covers them.
                        pv = k_slices(tOrP, tOrVt, stage)
                        wgmma_groups(((tiled_mma_pv, acc_o, pv, False),
                                      (tiled_mma_sums, acc_sums, ProbabilitySums.products(tOrP, ones), False)),
                                     wait_group)
                    else:
                        wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, stage], False, wait_group)

                def store_p(acc_s):
                    if const_expr(self.values_transposed):
                        # Rounded, not left to the GEMM's truncation (ptx.round_to_tf32); with
                        # split operands P = hi + lo, lo the exact rest, rounded.
                        acc_lo = cute.make_rmem_tensor(acc_shape_s, Float32)
                        for i in cutlass.range_constexpr(cute.size(acc_s)):
                            hi = round_to_tf32(acc_s[i])
                            if const_expr(self.split_operands):
                                acc_lo[i] = round_to_tf32(acc_s[i] - hi)
                            acc_s[i] = hi
                        tOrP.store(acc_as_tf32_operand_a(acc_s).load().to(tOrP.element_type))
                        if const_expr(self.split_operands):
                            tOrP_lo.store(acc_as_tf32_operand_a(acc_lo).load().to(tOrP_lo.element_type))
                    elif const_expr(self.scaled_halves):
                        # P_SCALE P = hi + lo in fp16.
                        store_halves(tOrP, tOrP_lo, acc_as_operand_a(acc_s).load() * Float32(P_SCALE))
                    else:
                        # Pairs rounded straight into P's fragment (layouts.store_rounded): the
                        # DSL's tensor conversion made ptxas serialise P V (perf/NOTES.md).
                        store_rounded(tOrP, acc_as_operand_a(acc_s))

                acc_o.fill(0.0)
                if const_expr(self.probability_sums is not None):
                    acc_sums.fill(0.0)
                q_pipe.consumer_wait(q_state)

                # First key block: it carries the tail and/or diagonal mask.
                k_pipe.consumer_wait(k_state)
                acc_s = gemm_qk(k_state.index, 0)
                k_pipe.consumer_release(k_state)
                k_state.advance()
                self.scores.transform(acc_s, scale_log2)
                mask(acc_s, n_block=n_block_max - 1, problem=self.problem)
                pending_scale = softmax.step(acc_s, is_first=True)
                store_p(acc_s)
                self._zero_stale_values(sV, v_pipe, v_state, seqlen_k - (n_block_max - 1) * self.block_n, tidx)

                step = partial(
                    self._mainloop_step, gemm_qk=gemm_qk, gemm_pv=gemm_pv, store_p=store_p, softmax=softmax,
                    acc_o=acc_o, acc_pv=acc_pv, k_pipe=k_pipe, v_pipe=v_pipe, wg_idx=wg_idx,
                    scale_log2=scale_log2, pending_scale=pending_scale,
                )
                # Blocks that still need a mask (the band's right edge), the unmasked run, then
                # the blocks the band's left edge crosses.
                unmasked_start, unmasked_end = self.ranges.unmasked_key_blocks(
                    band_block, positions, seqlen_k, n_block_min, n_block_max - 1)
                for i in cutlass.range(n_block_max - 1 - unmasked_end, unroll=1):
                    n_block = n_block_max - 2 - i
                    k_state, v_state = step(k_state, v_state,
                                            mask_fn=partial(mask, n_block=n_block, problem=self.problem))
                for i in cutlass.range(unmasked_end - unmasked_start, unroll=1):
                    k_state, v_state = step(k_state, v_state, mask_fn=None)
                if const_expr(self.problem.left is not None):
                    for i in cutlass.range(unmasked_start - n_block_min, unroll=1):
                        n_block = unmasked_start - 1 - i
                        k_state, v_state = step(k_state, v_state,
                                                mask_fn=partial(mask, n_block=n_block, problem=self.problem))
                # Every S = Q K^T of the tile has completed.
                q_pipe.consumer_release(q_state)
                q_state.advance()

                # The P of the last block is still waiting for its P V.
                if const_expr(self.rescale_before_pv and softmax.rescales):
                    self.rescale_o(acc_o, pending_scale)
                v_pipe.consumer_wait(v_state)
                gemm_pv(v_state.index, 0)
                v_pipe.consumer_release(v_state)
                v_state.advance()
                self._collect_pv(acc_o, acc_pv)

                sink_log2, row_sinks_log2 = None, None
                # With split keys the merge adds the sink, once (kernels/split_merge.py).
                if const_expr(self.problem.sink and not self.problem.split_keys):
                    if const_expr(self.problem.grouped_rows or self.problem.row_heads):
                        row_sinks_log2 = self._row_sinks_log2(softmax, tiled_mma_pv, gmem, tidx, m_block, head, seq)
                    else:
                        sink_log2 = gmem.sink[head] * Float32(math.log2(math.e))
                rounded_sums = None
                if const_expr(self.probability_sums is not None):
                    rounded_sums = ProbabilitySums.row_sums(acc_sums)
                inv_sum = softmax.finalize(sink_log2, row_sinks_log2, rounded_sums)
                rescale_rows(acc_o, inv_sum)
                if const_expr(self.scaled_halves):
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        acc_o[i] = acc_o[i] * o_scale
                self.epilogue(acc_o, softmax.row_sum, tiled_mma_pv, gmem, smem.o, atoms.o, tidx,
                              m_block, head, seq)
        if tidx < cute.arch.WARP_SIZE:
            # The CTA's shared memory must outlive the bulk store's reads of it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _mainloop_step(
        self, k_state, v_state, gemm_qk, gemm_pv, store_p, softmax, acc_o, acc_pv, k_pipe, v_pipe,
        wg_idx, scale_log2, mask_fn, pending_scale,
    ):
        """S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together, softmax of S_j after."""
        k_pipe.consumer_wait(k_state)
        self._pingpong_wait(wg_idx)
        acc_s = gemm_qk(k_state.index, -1)
        if const_expr(self.rescale_before_pv and softmax.rescales):
            # O to block j - 1's maxima (pending_scale), before P_{j-1} V_{j-1} adds to it.
            self.rescale_o(acc_o, pending_scale)
        v_pipe.consumer_wait(v_state)
        gemm_pv(v_state.index, -1)
        self._pingpong_pass(wg_idx)
        warpgroup.wait_group(1)  # S_j is ready; P V may still run
        k_pipe.consumer_release(k_state)
        k_state.advance()
        if const_expr(mask_fn is None and self.softmax_takes_transform):
            row_scale = softmax.step(acc_s, is_first=False, transform=self.scores, transform_scale=scale_log2)
        else:
            self.scores.transform(acc_s, scale_log2)
            if const_expr(mask_fn is not None):
                mask_fn(acc_s)
            row_scale = softmax.step(acc_s, is_first=False)
        warpgroup.wait_group(0)  # P_{j-1} registers are free again
        v_pipe.consumer_release(v_state)
        v_state.advance()
        self._collect_pv(acc_o, acc_pv)
        store_p(acc_s)
        if const_expr(softmax.rescales and self.rescale_before_pv):
            pending_scale.store(row_scale.load())
        elif const_expr(softmax.rescales):
            self.rescale_o(acc_o, row_scale)
        return k_state, v_state

    @cute.jit
    def _zero_stale_values(self, sV, v_pipe, v_state, keys_in_block, tidx):
        """Zero the rows of the first walked block's V stage from keys_in_block on, where that
        block runs past its sequence's keys, before any P V reads it (kernels/stale_keys.py;
        K needs none here: its scores are masked). Every consumer warpgroup reads the stage,
        so all of them pass the barrier before any P V (ahead of the main loop: a pingpong
        turn never waits on it)."""
        if const_expr((self.problem.packed or self.problem.cached_keys) and not self.values_transposed):
            if keys_in_block < self.block_n:
                v_pipe.consumer_wait(v_state)
                zero_rows_past_keys(self.dtype, [sV[None, None, v_state.index]], keys_in_block, tidx,
                                    self.num_mma_threads, ForwardBarrier.STALE_KEYS)

    @cute.jit
    def _row_sinks_log2(self, softmax, tiled_mma_pv, gmem: ForwardTensors, tidx, m_block, head, seq):
        """The sink logit (times log2(e)) of each row this thread holds, grouped rows: a tile's
        rows belong to several query heads (HeadMapping.lse_coords); rows past the tile's
        last one read the last row's head (their results are never written)."""
        sinks = cute.make_rmem_tensor_like(softmax.row_sum, Float32)
        coords = acc_as_rows_cols(tiled_mma_pv.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.block_m, self.value_head_dim))))
        for r in cutlass.range_constexpr(cute.size(sinks)):
            row = cutlass.min(m_block * self.block_m + coords[r, 0][0], self.heads.row_count(seq.seqlen_q) - 1)
            _, query_head = self.heads.lse_coords(row, head, gmem.lse, gmem.q.shape[2])
            sinks[r] = gmem.sink[query_head] * Float32(math.log2(math.e))
        return sinks

    def _collect_pv(self, acc_o, acc_pv):
        """O += the block's P V where it has an accumulator of its own (split operands)."""
        if self.split_operands:  # plain Python, unrolled where the kernel calls it
            for i in range(cute.size(acc_o)):
                acc_o[i] = acc_o[i] + acc_pv[i]

    def _pingpong_wait(self, wg_idx):
        if const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=ForwardBarrier.FIRST_PINGPONG + wg_idx,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    def _pingpong_pass(self, wg_idx):
        if const_expr(self.pingpong):
            next_wg = (wg_idx + 1) % self.num_mma_warpgroups
            cute.arch.barrier_arrive(
                barrier_id=ForwardBarrier.FIRST_PINGPONG + next_wg,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    @cute.jit
    def epilogue(self, acc_o, lse, tiled_mma_pv, gmem: ForwardTensors, sO, tma_atom_o, tidx,
                 m_block, head, seq):
        mO = gmem.o
        seqlen_q = seq.seqlen_q
        r_o = cute.make_rmem_tensor_like(acc_o, self.out_dtype)
        r_o.store(acc_o.load().to(self.out_dtype))
        if tidx < cute.arch.WARP_SIZE:
            # No bulk store of this CTA can still be reading sO (one tile per CTA): a no-op kept
            # from the persistent grid, since without it the SASS changes (see consume).
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        # sO aliases sQ: every consumer warpgroup must be past its last read of Q.
        cute.arch.barrier(barrier_id=ForwardBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        thr_copy_o = cute.make_tiled_copy_C(accumulator_store_atom(self.out_dtype), tiled_mma_pv).get_slice(tidx)
        cute.copy(thr_copy_o, thr_copy_o.retile(r_o), thr_copy_o.partition_D(sO))

        # LSE: the thread holding column 0 of a row writes it; rows past Sq are skipped, and
        # those before the sequence's first query in a tile aligned to its end.
        first_row = self.heads.row_count(seq.skipped) if const_expr(self.tiles_end_aligned) else 0
        thr_mma = tiled_mma_pv.get_slice(tidx)
        coords = thr_mma.partition_C(cute.make_identity_tensor((self.block_m, self.value_head_dim)))
        coords_rc = acc_as_rows_cols(coords)
        if coords_rc[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.block_m + coords_rc[r, 0][0]
                stored = row < self.heads.row_count(seqlen_q)
                if const_expr(self.tiles_end_aligned):
                    stored = stored and row >= first_row
                if stored:
                    position, query_head = self.heads.lse_coords(row, head, gmem.lse, gmem.q.shape[2])
                    gmem.lse[seq.offset_q + position, query_head, seq.out_batch] = lse[r]

        # stmatrix writes are generic-proxy stores; the TMA engine reads through the async
        # proxy, hence the fence before the barrier that hands sO to the storing thread.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=ForwardBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        tile = (self.heads.row_tile(self.block_m), self.value_head_dim)
        if const_expr(self.problem.packed):
            # The rows past the sequence's end are the next sequence's: per-row predicated
            # 16-byte stores by every consumer thread instead of a bulk store.
            gO = cute.local_tile(self.sequences.output_rows(mO, head, seq), tile, (m_block, 0))
            store_rows_clipped(self.out_dtype, sO, gO, tidx, self.num_mma_threads,
                               self.heads.row_count(seqlen_q) - m_block * self.block_m, mO.shape[1], OUT_VALUES,
                               first_row - m_block * self.block_m
                               if const_expr(self.tiles_end_aligned) else None)
        elif const_expr(self.tiles_end_aligned):
            # A dense tile aligned to the end whose rows start before row 0 (the first tile when
            # Sq is not a multiple of the tile's rows) stores row by row: a bulk store of it
            # faulted (illegal instruction, H200, sixtieth session), and storing every tile row
            # by row cost the D = 128 forward 0.4-0.8 %.
            if m_block * self.block_m < first_row:
                gO = cute.local_tile(self.sequences.output_rows(gmem.o_rows, head, seq), tile, (m_block, 0))
                store_rows_clipped(self.out_dtype, sO, gO, tidx, self.num_mma_threads,
                                   self.heads.row_count(seqlen_q) - m_block * self.block_m, gmem.o_rows.shape[1],
                                   OUT_VALUES, first_row - m_block * self.block_m)
            else:
                self._store_o_bulk(tma_atom_o, sO, mO, tile, m_block, head, seq, tidx)
        else:
            self._store_o_bulk(tma_atom_o, sO, mO, tile, m_block, head, seq, tidx)

    @cute.jit
    def _store_o_bulk(self, tma_atom_o, sO, mO, tile, m_block, head, seq, tidx):
        """O's tile from shared memory by one bulk (TMA) store, issued by the first warp; TMA
        clips the rows past the tensor's end."""
        if tidx < cute.arch.WARP_SIZE:
            gO = cute.local_tile(self.sequences.output_rows(mO, head, seq), tile, (m_block, 0))
            store_tile(tma_atom_o, sO, gO)
