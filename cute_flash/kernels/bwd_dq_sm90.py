"""dQ of the FlashAttention backward as its own kernel, for Hopper (sm_90a), in the CuTe DSL.

The fused backward (bwd_sm90.py) adds every key block's partial dQ into an fp32 buffer as
large as two copies of Q. For very long sequences that buffer is the backward's one large
allocation (256 MiB for 1 x 4 x 131072 x 128), so the backward can instead run the main
kernel for dK and dV only and this kernel for dQ: one CTA per block_m query rows of one
(batch, head) walks the key blocks that its rows can see -- the forward's loop -- and keeps
dQ in registers until it writes it once, in the output dtype. The price is recomputing
S = Q K^T and dP = dO V^T (7 GEMMs instead of 5 per tile pair).

* warpgroup 0 is the producer: its first warp TMA-loads Q and dO once and K, V block by
  block into num_stages-deep swizzled rings guarded by mbarriers.
* warpgroups 1.. are consumers, 64 query rows each. Per key block j, with fp32 accumulators:
      S  = Q K_j^T,  dP = dO V_j^T         (WGMMA, operands in shared memory)
      P  = exp2(S * scale * log2(e) - LSE * log2(e))
      dS = P * (dP - delta)
      dQ += dS K_j                          (WGMMA, dS converted in registers as the A operand,
                                             K_j in shared memory as the MN-major B operand)
  V_j's stage is released once dP is done, K_j's once the dQ GEMM is.
* Epilogue: dQ * softmax_scale is converted, staged in Q's (dead) buffer with stmatrix and
  written by one TMA store that clips the sequence tail.

Float32 tiles (cute_flash.float32, "high" precision) run the three GEMMs on the TF32 WGMMA, as
the forward does: dS is rounded to TF32 and handed over in the TF32 A order
(layouts.acc_as_tf32_operand_a), and K arrives also as K^T, (D, Sk8) with the keys permuted
within groups of 8 to match (kernels/tf32_operands.py), loaded beside K on K's barrier; Q is
read into registers once (query_in_registers) and S = Q K^T takes it from there; dQ
leaves as float32 column pairs where stmatrix moves 16-bit elements. With split_operands
("highest", 3xTF32) every operand is its two TF32 parts, as in the forward (Q, dO, K, V
[hi | lo] along D, K^T hi rows over lo rows, dS split in registers), and each key block's dS K
goes into an accumulator of its own, added to dQ in float32. With a 16-bit dtype and
split_operands the operands are float32 inputs' scaled fp16 halves ("float32x3h",
kernels/half_operands.py, docs/DESIGN.md): K's column halves read MN-major (no K^T), dS split
after a power of two per row (split_rows_scaled) that each block's product takes back out, and
the operand scales (scores, dP, dQ) per (batch, query head).

Tails need no extra masks beyond the forward's: TMA zero-fills rows past Sq / Sk, so dP is 0
there; keys past Sk (and, causal, after the query) are masked to -inf so P = 0; rows past Sq
read LSE*log2(e) = +inf (P = 0) and delta = 0 from the preprocess's padded buffers.

Packed batches (problem.packed; the scaled halves' backward of cute_flash.varlen): the forward's
compact grid over the sequences' query blocks (TileScheduler.packed_tile), each sequence's rows
and keys as shifted views of the packed tensors and its LSE / delta in its own region of the
padded buffers (kernels/sequences.py); a tile's rows past its sequence belong to the next one,
so dQ leaves by per-row predicated stores instead of a bulk store that clips only at the
tensor's end. (Not TF32 tiles: their K^T has its keys permuted from a dense sequence's start.)
"""

import math
from functools import partial
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_flash.kernels import rules, warp_specialized
from cute_flash.kernels.barriers import DqKernelBarrier
from cute_flash.kernels.half_operands import SCALE_DP, SCALE_DQ, SCALE_SCORES, split_rows_scaled
from cute_flash.kernels.layouts import (
    acc_as_operand_a,
    acc_as_rows_cols,
    accumulator_store_atom,
    column_halves_transposed,
    row_halves,
    row_major_smem_layout,
    sequence_major,
    store_rows_clipped,
    store_tf32_operand_a,
    store_tf32_split_operand_a,
    transposed_view,
)
from cute_flash.kernels.mask import mask_scores
from cute_flash.kernels.optional_arguments import check_given
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.sequences import PackedBatch
from cute_flash.kernels.stale_keys import zero_rows_past_keys
from cute_flash.kernels.tma_pipeline import SWIZZLED_TILE_ALIGN, load_stage, load_stage_of_tiles, shared_storage, start_rings, store_tile, swizzled_tensor, tma_tiles
from cute_flash.kernels.query_block_kernel import QueryBlockKernel
from cute_flash.kernels.score_transform import ScoreTransform
from cute_flash.kernels.wgmma import (
    K_MAJOR,
    THREADS_PER_WARPGROUP,
    smem_operands,
    split_products,
    stacked_tiled_mma,
    warpgroup_slice,
    wgmma,
    wgmma_k_major,
    wgmma_products,
)

# Registers per thread after setmaxnreg (consumers, producer). A consumer thread holds S, dP
# and dQ (block_n / 2 + block_n / 2 + D / 2 floats for its 64-row slab) plus dS in 16 bits.
# One consumer warpgroup (64 query rows): float32x3 at D = 128, whose Q and dO tiles hold both
# parts (rules.separate_dq).
REGISTER_SPLIT = {1: (256, 24), 2: (240, 24)}
DQ_VALUES = 8  # per thread and row in a packed batch's dQ store (as the forward's O store)


# The kernel's arguments and per-CTA state, grouped. The DSL flattens a NamedTuple argument
# into its fields in order, so the kernel's parameter list (and its SASS) is that of the
# fields one by one.
class DqTensors(NamedTuple):
    """Global memory, kernel-side (S, D, N, B) / (S, N, B) views."""
    q: cute.Tensor  # TMA loads
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    lse: cute.Tensor  # plain views: LSE * log2(e) and delta, padded rows
    delta: cute.Tensor
    dq: cute.Tensor  # TMA store (a packed batch: plain, stored by rows)
    k_t: object = None  # float32: K^T (TMA loads); None otherwise
    scales: object = None  # scaled halves: (B, N, SCALES) float32 operand scales; None otherwise
    # A packed batch's offsets (kernels/sequences.py); None for a dense batch.
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    seqused_k: object = None


class DqTmaAtoms(NamedTuple):
    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    do: cute.CopyAtom
    dq: cute.CopyAtom  # store
    k_t: object = None  # float32


class DqSmem(NamedTuple):
    """Shared-memory tensors (or layouts) of the tiles."""
    q: object  # dQ's staging buffer in the epilogue
    do: object
    k: object  # num_stages deep
    v: object  # num_stages deep
    k_t: object = None  # float32: K^T, (D, block_n) num_stages deep; None otherwise
    dq: object = None  # split operands: dQ's staging view of Q's (2D-wide) buffer, (block_m, D)


class DqPipes(NamedTuple):
    qdo: object  # PipelineTmaAsync: Q and dO on one barrier
    k: object
    v: object


class DqMmas(NamedTuple):
    sdp: cute.TiledMma  # S = Q K^T, dP = dO V^T
    dq: cute.TiledMma  # dQ += dS K, dS from registers
    s: object = None  # query_in_registers: S = Q K^T with Q from registers; None otherwise


class QueryBlockWork(NamedTuple):
    """A CTA's work: query block m_block of (batch, head), key blocks [n_block_min,
    n_block_max) of key/value head kv_head, of sequence seq (a sequences.Sequence: a dense
    batch's entry, or a packed batch's sequence, batch then its index along the tensors'
    batch mode, 0)."""
    m_block: object
    head: object
    batch: object
    n_block_min: object
    n_block_max: object
    kv_head: object
    seq: object


class DqStepOperands(NamedTuple):
    """A consumer thread's WGMMA operand fragments, fixed for the CTA's life."""
    q: cute.Tensor  # S = Q K^T
    k: cute.Tensor
    do: cute.Tensor  # dP = dO V^T
    v: cute.Tensor
    ds: cute.Tensor  # dQ += dS K
    k_t: cute.Tensor
    # Split operands: dS's low TF32 part and K^T's low half; None otherwise.
    ds_lo: object = None
    k_t_lo: object = None


class FlashBackwardDqSm90(QueryBlockKernel):
    """dQ kernel for one (dtype, head_dim, causal, SeparateDqConfig) combination.

    Call with (q, k, v, dout, lse_log2, delta, dq, softmax_scale, stream): q, dout, dq
    (B, N, Sq, D); k, v (B, N, Sk, D); lse_log2, delta (B, N, Sq_pad) fp32 from the backward
    preprocess (Sq_pad = seqlen_pad.padded_seqlen_q(Sq)).
    """

    # S = Q K^T and dP = dO V^T (every operand K-major); dQ += dS K, dS from registers.
    MMAS = DqMmas

    def __init__(self, dtype, head_dim: int, problem: AttentionProblem, config, split_operands: bool = False,
                 grad_columns: tuple | None = None):
        """split_operands: float32 operands as TF32 hi | lo pairs (3xTF32, "float32x3"), or with
        a 16-bit dtype as fp16 scaled halves ("float32x3h"); see the module docstring.
        grad_columns: (first column, columns) of dQ that this launch computes, the scaled halves
        above D = 128 (rules.gradient_chunks): S and dP still contract over every column, dS K
        reads those columns of K; None: all of them."""
        # fp16 split operands: float32 inputs' scaled halves (kernels/half_operands.py).
        self.scaled_halves = split_operands and dtype.width == 16
        dtype_name = (rules.SCALED_HALVES if self.scaled_halves else
                      rules.SPLIT_FLOAT32 if split_operands else dtype.__name__.lower())
        rules.require("FlashBackwardDqSm90", rules.separate_dq(dtype_name, head_dim, config, grad_columns))
        if dtype is Float32:  # (the scaled halves read K as the 16-bit kernels do: any batch)
            rules.require("FlashBackwardDqSm90", rules.float32_problem(problem))
        # dQ's columns: the second GEMM's N and its output's (QueryBlockKernel's value tile).
        self.grad_columns = grad_columns
        self.dq_cols = grad_columns[1] if grad_columns else head_dim
        super().__init__(dtype, head_dim, problem, config, REGISTER_SPLIT, value_head_dim=self.dq_cols)
        self.split_operands = split_operands
        self.out_dtype = Float32 if self.scaled_halves else dtype
        # Columns of the Q, dO, K and V tiles (rows of K^T's): both parts when split.
        self.operand_cols = 2 * head_dim if split_operands else head_dim
        if split_operands:
            self.scores = ScoreTransform(problem, float32_accurate=True)
        # TF32 tiles: S = Q K^T takes Q from registers, loaded once per CTA (D / 2 floats per
        # thread, at most 64), so that per key block only K is read from shared memory: the
        # kernel is shared-memory bound there (3 KiB per 8-column step at 32 keys with both
        # operands in shared memory; perf/NOTES.md, twenty-second and twenty-third sessions).
        self.query_in_registers = self.values_transposed and not split_operands

    def _smem_layouts(self) -> DqSmem:
        q, kv = self._tile_layouts()
        if const_expr(self.split_operands):
            # Q, dO, K, V with both parts side by side, K^T hi rows over lo rows (TF32; the
            # halves read K's column halves MN-major); dQ staged D wide in the output dtype.
            q = row_major_smem_layout(self.dtype, self.block_m, self.operand_cols)
            kv = row_major_smem_layout(self.dtype, self.block_n, self.operand_cols, self.num_stages)
            dq = row_major_smem_layout(self.out_dtype, self.block_m, self.dq_cols)
            if const_expr(self.scaled_halves):
                return DqSmem(q, q, kv, kv, None, dq)
            k_t = row_major_smem_layout(self.dtype, self.operand_cols, self.block_n, self.num_stages)
            return DqSmem(q, q, kv, kv, k_t, dq)
        if const_expr(self.values_transposed):
            # K^T: (D, block_n) with the keys contiguous, the K-major B operand of dQ += dS K.
            return DqSmem(q, q, kv, kv, row_major_smem_layout(self.dtype, self.head_dim, self.block_n,
                                                              self.num_stages))
        return DqSmem(q, q, kv, kv)

    def _query_ring(self, layouts: DqSmem) -> dict:
        # Q and dO arrive on one barrier: the consumers need both before their first block.
        return {"qdo": (1, 2 * cute.size_in_bytes(self.dtype, layouts.q))}

    def _rings(self, layouts: DqSmem) -> dict:
        rings = super()._rings(layouts)
        if const_expr(self.values_transposed):
            # K^T's stage arrives on K's barrier.
            stages, k_bytes = rings["k"]
            rings["k"] = (stages, k_bytes + cute.size_in_bytes(self.dtype, cute.select(layouts.k_t, mode=[0, 1])))
        return rings

    def _shared_storage(self, layouts: DqSmem):
        tiles = dict(sQ=layouts.q, sdO=layouts.do, sK=layouts.k, sV=layouts.v)
        if self.values_transposed:
            tiles["sKt"] = layouts.k_t
        return shared_storage(self._rings(layouts), {
            name: (self.dtype, cute.cosize(layout), SWIZZLED_TILE_ALIGN) for name, layout in tiles.items()
        })

    def optional_arguments(self) -> tuple:
        """Which of __call__'s optional arguments (mKt, mScales, mPacked) this kernel reads; the
        others are None (optional_arguments.py)."""
        return (self.values_transposed, self.scaled_halves, self.problem.packed)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mdQ: cute.Tensor, mKt: cute.Tensor | None, mScales: cute.Tensor | None,
                 mPacked: PackedBatch | None, softmax_scale: Float32, stream: cuda.CUstream):
        """The shapes: see the class docstring (mLSE holds LSE * log2(e), +inf for padded rows);
        mKt: float32 kernels' K^T (B, Nkv, D, Sk8), keys permuted (kernels/tf32_operands.py).
        mScales: the scaled halves' (B, N, SCALES) operand scales. mPacked: a packed batch's
        offsets (then B = 1 above, and mLSE, mDelta hold each sequence's region,
        kernels/sequences.py). Each of these three is None where the kernel does not read it
        (optional_arguments)."""
        check_given("the backward's dQ kernel", ("k_t", "scales", "batch"), (mKt, mScales, mPacked),
                    self.optional_arguments())
        mQ, mK, mV, mdO, mLSE, mDelta, mdQ = [
            sequence_major(t) for t in (mQ, mK, mV, mdO, mLSE, mDelta, mdQ)
        ]
        mmas = self._tiled_mmas()
        if const_expr(self.query_in_registers):
            mmas = mmas._replace(s=stacked_tiled_mma(self.dtype, self.num_mma_warpgroups, self.block_n, K_MAJOR,
                                                     a_from_registers=True))
        layouts = self._smem_layouts()
        sQ_layout, sKV_layout = layouts.q, layouts.k

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        q_tile = (self.block_m, self.operand_cols)
        kv_tile = (self.block_n, self.operand_cols)
        kv_stage = cute.select(sKV_layout, mode=[0, 1])
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(tma_load, mQ, sQ_layout, q_tile)
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(tma_load, mdO, sQ_layout, q_tile)
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, kv_stage, kv_tile)
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mV, kv_stage, kv_tile)
        tma_atom_dq, tma_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdQ, layouts.dq if const_expr(self.split_operands) else sQ_layout,
            (self.block_m, self.dq_cols)  # (a gradient chunk's: the caller's view of its columns)
        )
        tma_atom_kt, tma_kt = None, None
        if const_expr(self.values_transposed):
            tma_atom_kt, tma_kt = cpasync.make_tiled_tma_atom(
                tma_load, sequence_major(mKt), cute.select(layouts.k_t, mode=[0, 1]), (self.operand_cols, self.block_n))

        scale_log2 = softmax_scale * Float32(math.log2(math.e))
        packed = const_expr(self.problem.packed)
        gmem = DqTensors(tma_q, tma_k, tma_v, tma_do, mLSE, mDelta, mdQ if packed else tma_dq, tma_kt,
                         mScales)
        if const_expr(packed):
            gmem = gmem._replace(cu_seqlens_q=mPacked.cu_seqlens_q, cu_seqlens_k=mPacked.cu_seqlens_k,
                                 seqused_k=mPacked.seqused_k if const_expr(self.problem.keys_used) else None)
        warp_specialized.launch(
            self.kernel(
                gmem, DqTmaAtoms(tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_dq, tma_atom_kt),
                scale_log2, softmax_scale, layouts, mmas,
            ),
            self.scheduler.grid(mQ.shape[0], mQ.shape[2], self.sequences.output_batches(
                mQ, mLSE, mPacked.cu_seqlens_q if const_expr(packed) else None)),
            self.num_threads, stream, self.ctas_per_sm,
        )

    @cute.kernel
    def kernel(self, gmem: DqTensors, atoms: DqTmaAtoms, scale_log2: Float32, softmax_scale: Float32,
               layouts: DqSmem, mmas: DqMmas):
        warp_idx = warp_specialized.start(atoms)
        storage = cutlass.memory.SmemAllocator().allocate(self._shared_storage(layouts))
        pipes = start_rings(storage, DqPipes, self._rings(layouts), self.num_mma_threads)
        buffers = DqSmem(storage.sQ, storage.sdO, storage.sK, storage.sV)
        if const_expr(self.values_transposed):
            buffers = buffers._replace(k_t=storage.sKt)
        if const_expr(self.split_operands and not self.scaled_halves):
            buffers = buffers._replace(dq=storage.sQ)
        smem = DqSmem(*(swizzled_tensor(b, layout) for b, layout in zip(buffers, layouts) if b is not None))
        if const_expr(self.scaled_halves):
            # dQ in float32, staged in a float32 view of Q's (2D fp16 wide: as many bytes) buffer.
            smem = smem._replace(dq=cute.make_tensor(
                cute.recast_ptr(storage.sQ.data_ptr(), layouts.dq.inner, dtype=Float32), layouts.dq.outer))

        tile, _, _ = cute.arch.block_idx()
        if const_expr(self.problem.packed):
            # (Every thread: locating the sequence takes whole warps.)
            m_block, head, seq = self.scheduler.packed_tile(tile, gmem.q, gmem.k, gmem)
            n_block_min, n_block_max = self.ranges.key_blocks(m_block, seq.seqlen_q, seq.seqlen_k)
            kv_head = self.heads.kv_head(head, gmem.q.shape[2], gmem.k.shape[2])
            work = QueryBlockWork(m_block, head, seq.batch, n_block_min, n_block_max, kv_head, seq)
            # A tile past its sequence's rows (the compact grid has some to spare) does nothing.
            if self.sequences.has_rows(m_block, self.block_m, seq):
                self._run(warp_idx, mmas, gmem, smem, atoms, pipes, scale_log2, softmax_scale, work)
        else:
            m_block, head, batch = self.scheduler.tile_coords_divided(tile, gmem.q.shape[0], gmem.q.shape[2])
            n_block_min, n_block_max = self.ranges.key_blocks(m_block, gmem.q.shape[0], gmem.k.shape[0])
            kv_head = self.heads.kv_head(head, gmem.q.shape[2], gmem.k.shape[2])
            work = QueryBlockWork(m_block, head, batch, n_block_min, n_block_max, kv_head,
                                  self.sequences.of(batch, gmem.q, gmem.k, gmem))
            self._run(warp_idx, mmas, gmem, smem, atoms, pipes, scale_log2, softmax_scale, work)

    @cute.jit
    def _run(self, warp_idx, mmas: DqMmas, gmem: DqTensors, smem: DqSmem, atoms: DqTmaAtoms, pipes: DqPipes,
             scale_log2, softmax_scale, work: QueryBlockWork):
        """The warp roles: the producer's first warp loads, the consumers compute."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(gmem, smem, atoms, pipes, work)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            tidx, _, _ = cute.arch.thread_idx()
            self.consume(mmas, gmem, smem, atoms, pipes, tidx - THREADS_PER_WARPGROUP, scale_log2, softmax_scale,
                         work)

    @cute.jit
    def produce(self, gmem: DqTensors, smem: DqSmem, atoms: DqTmaAtoms, pipes: DqPipes, work: QueryBlockWork):
        mQ, mK, mV, mdO = gmem.q, gmem.k, gmem.v, gmem.do
        sQ, sdO, sK, sV = smem.q, smem.do, smem.k, smem.v
        qdo_pipe, k_pipe, v_pipe = pipes
        m_block, head, batch, n_block_min, n_block_max, kv_head = work[:6]
        q_tile = (self.block_m, self.operand_cols)
        kv_tile = (self.block_n, self.operand_cols)
        rows = partial(self.sequences.rows, seq=work.seq)  # the CTA's sequence's (S, D) matrix of a head
        tQsQ, tQgQ = tma_tiles(atoms.q, sQ, cute.local_tile(rows(mQ, head), q_tile, (m_block, 0)))
        tdOsdO, tdOgdO = tma_tiles(
            atoms.do, sdO, cute.local_tile(rows(mdO, head), q_tile, (m_block, 0))
        )
        tKsK, tKgK = tma_tiles(atoms.k, sK, cute.local_tile(rows(mK, kv_head, keys=True), kv_tile, (None, 0)))
        tVsV, tVgV = tma_tiles(atoms.v, sV, cute.local_tile(rows(mV, kv_head, keys=True), kv_tile, (None, 0)))
        load_k = partial(load_stage, k_pipe, atoms.k, tKgK, tKsK)
        if const_expr(self.values_transposed):
            gKt = cute.local_tile(gmem.k_t[None, None, kv_head, batch], (self.operand_cols, self.block_n), (0, None))
            tKtsKt, tKtgKt = tma_tiles(atoms.k_t, smem.k_t, gKt)

            load_k = partial(load_stage_of_tiles, k_pipe, ((atoms.k, tKgK, tKsK), (atoms.k_t, tKtgKt, tKtsKt)))

        qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        # Issue order follows first use: K with Q for S, then V with dO for dP.
        k_state = load_k(n_block_max - 1, k_state)
        qdo_pipe.producer_acquire(qdo_state)
        bar = qdo_pipe.producer_get_barrier(qdo_state)
        cute.copy(atoms.q, tQgQ, tQsQ, tma_bar_ptr=bar)
        cute.copy(atoms.do, tdOgdO, tdOsdO, tma_bar_ptr=bar)
        v_state = load_stage(v_pipe, atoms.v, tVgV, tVsV, n_block_max - 1, v_state)
        for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
            n_block = n_block_max - 2 - i
            k_state = load_k(n_block, k_state)
            v_state = load_stage(v_pipe, atoms.v, tVgV, tVsV, n_block, v_state)

    @cute.jit
    def consume(self, mmas: DqMmas, gmem: DqTensors, smem: DqSmem, atoms: DqTmaAtoms, pipes: DqPipes, tidx,
                scale_log2, softmax_scale, work: QueryBlockWork):
        tiled_mma_sdp, tiled_mma_dq = mmas[:2]
        mQ, mK, mLSE, mDelta = gmem.q, gmem.k, gmem.lse, gmem.delta
        sQ, sdO, sK, sV = smem.q, smem.do, smem.k, smem.v
        m_block, head, batch, n_block_min, n_block_max = work[:5]
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # WGMMA operands are described per warpgroup: slice at the warpgroup's first thread.
        wg_sdp = warpgroup_slice(tiled_mma_sdp, wg_idx)
        wg_dq = warpgroup_slice(tiled_mma_dq, wg_idx)
        tSrQ, tSrK = smem_operands(wg_sdp, sQ, sK)
        tdPrdO, tdPrV = smem_operands(wg_sdp, sdO, sV)
        # K^T: the transposed view of K's stages (MN-major), or float32's own K^T copy.
        sKt = smem.k_t if const_expr(self.values_transposed) else transposed_view(sK)
        tdQrKt_lo, tdQrdS_lo = None, None
        if const_expr(self.split_operands):
            # K^T's stages as (D, block_n) hi and lo halves; dS's low part.
            if const_expr(self.scaled_halves):
                # K's column halves, each the MN-major B operand (as the forward's V).
                # (A gradient chunk's columns of them: grad_columns.)
                sKt, sKt_lo = column_halves_transposed(sK, self.block_n, self.head_dim, self.grad_columns)
            else:
                sKt, sKt_lo = row_halves(sKt, self.head_dim, self.block_n)
            tdQrKt_lo = wg_dq.make_fragment_B(wg_dq.partition_B(sKt_lo))
            tdQrdS_lo = wg_dq.make_fragment_A(wg_dq.partition_shape_A((self.block_m, self.block_n)))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))
        acc_shape_s = wg_sdp.partition_shape_C((self.block_m, self.block_n))
        acc_dq = cute.make_rmem_tensor(wg_dq.partition_shape_C((self.block_m, self.dq_cols)), Float32)
        acc_dq.fill(0.0)
        dp_scale = None
        if const_expr(self.scaled_halves):
            # The (batch, head)'s powers of two: the scores' joins their scale, dP's its dS.
            scale_log2 = scale_log2 * gmem.scales[batch, head, SCALE_SCORES]
            dp_scale = gmem.scales[batch, head, SCALE_DP]
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_shape_A((self.block_m, self.block_n)))

        # LSE*log2(e) and delta of the rows this thread's fragments hold (the buffers are
        # padded to 128 rows; rows past them, possible when block_m does not divide 128,
        # read as rows that see nothing).
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        if const_expr(self.problem.packed):
            seqlen_q, seqlen_k = work.seq.seqlen_q, work.seq.seqlen_k
            # The sequence's region of the padded buffers, from its row 0.
            mLSE = self.sequences.padded_stats(mLSE, head, work.seq)
            mDelta = self.sequences.padded_stats(mDelta, head, work.seq)
        rows = acc_as_rows_cols(
            tiled_mma_sdp.get_slice(tidx).partition_C(cute.make_identity_tensor((self.block_m, self.block_n)))
        )
        num_rows = cute.size(rows, mode=[0])
        row_lse = cute.make_rmem_tensor(num_rows, Float32)
        row_delta = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = m_block * self.block_m + rows[r, 0][0]
            row_lse[r] = Float32.inf
            row_delta[r] = Float32(0.0)
            if row < seqlen_q:
                if const_expr(self.problem.packed):
                    row_lse[r] = mLSE[row]
                    row_delta[r] = mDelta[row]
                else:
                    row_lse[r] = mLSE[row, head, batch]
                    row_delta[r] = mDelta[row, head, batch]

        mask = partial(
            mask_scores, tiled_mma=tiled_mma_sdp, tidx=tidx, m_block=m_block, seqlen_k=seqlen_k,
            block_m=self.block_m, block_n=self.block_n, problem=self.problem, seqlen_q=seqlen_q,
        )
        qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        pipes.qdo.consumer_wait(qdo_state)
        if const_expr(self.query_in_registers):
            # This thread's share of Q as the A operand of S = Q K^T, read from shared memory once
            # (rounded to TF32 already by the operand pass).
            thr_s = mmas.s.get_slice(tidx)
            tSrQ = thr_s.make_fragment_A(thr_s.partition_shape_A((self.block_m, self.head_dim)))
            tSrQ.store(thr_s.partition_A(sQ).load())
        operands = DqStepOperands(tSrQ, tSrK, tdPrdO, tdPrV, tdQrdS, tdQrKt, tdQrdS_lo, tdQrKt_lo)

        if const_expr(self.problem.packed and not self.values_transposed):
            # The first key block's rows past the sequence's keys: another sequence's or a
            # cache's free slots (NaN possible); dP = dO V^T and dQ = dS K would carry them.
            keys_in_block = seqlen_k - (n_block_max - 1) * self.block_n
            if keys_in_block < self.block_n:
                pipes.k.consumer_wait(k_state)
                pipes.v.consumer_wait(v_state)
                zero_rows_past_keys(self.dtype, [sK[None, None, k_state.index], sV[None, None, v_state.index]],
                                    keys_in_block, tidx, self.num_mma_threads, DqKernelBarrier.STALE_KEYS)
        # Key blocks from the last down: those needing a mask (key tail, the band's right
        # edge) come first, then the unmasked run, then those the band's left edge crosses.
        unmasked_start, unmasked_end = self.ranges.unmasked_key_blocks(
            m_block, seqlen_q, seqlen_k, n_block_min, n_block_max)
        for i in cutlass.range(n_block_max - unmasked_end, unroll=1):
            n_block = n_block_max - 1 - i
            k_state, v_state = self.step(
                k_state, v_state, mmas, operands, acc_shape_s, acc_dq, rows, row_lse, row_delta, scale_log2, pipes,
                mask_fn=partial(mask, n_block=n_block), dp_scale=dp_scale,
            )
        for i in cutlass.range(unmasked_end - unmasked_start, unroll=1):
            k_state, v_state = self.step(
                k_state, v_state, mmas, operands, acc_shape_s, acc_dq, rows, row_lse, row_delta, scale_log2, pipes,
                mask_fn=None, dp_scale=dp_scale,
            )
        if const_expr(self.problem.left is not None):
            for i in cutlass.range(unmasked_start - n_block_min, unroll=1):
                n_block = unmasked_start - 1 - i
                k_state, v_state = self.step(
                    k_state, v_state, mmas, operands, acc_shape_s, acc_dq, rows, row_lse, row_delta, scale_log2,
                    pipes, mask_fn=partial(mask, n_block=n_block), dp_scale=dp_scale,
                )
        self.epilogue(acc_dq, softmax_scale, tiled_mma_dq, gmem, smem, atoms, tidx, work)

    @cute.jit
    def step(
        self, k_state, v_state, mmas: DqMmas, operands: DqStepOperands, acc_shape_s, acc_dq, rows, row_lse,
        row_delta, scale_log2, pipes: DqPipes, mask_fn, dp_scale=None,
    ):
        """One key block: S and dP, then P and dS in registers, then dQ += dS K."""
        tiled_mma_sdp, tiled_mma_dq = mmas[:2]
        tSrQ, tSrK, tdPrdO, tdPrV, tdQrdS, tdQrKt = operands[:6]
        k_pipe, v_pipe = pipes.k, pipes.v
        k_pipe.consumer_wait(k_state)
        acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
        wgmma_k_major(mmas.s if const_expr(self.query_in_registers) else tiled_mma_sdp, acc_s, tSrQ,
                      tSrK[None, None, None, k_state.index], self.split_operands, -1)
        v_pipe.consumer_wait(v_state)
        acc_dp = cute.make_rmem_tensor(acc_shape_s, Float32)
        wgmma_k_major(tiled_mma_sdp, acc_dp, tdPrdO, tdPrV[None, None, None, v_state.index], self.split_operands,
                      1)

        # S is ready (dP may still run).
        self.scores.transform(acc_s, scale_log2)
        if const_expr(mask_fn is not None):
            mask_fn(acc_s)
        p_rows = acc_as_rows_cols(acc_s)
        p_scale_log2 = self.scores.softmax_scale_log2(scale_log2)
        if const_expr(self.problem.softcap):
            # P times the softcap's gradient factor: only dS reads P here.
            for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
                    t = p_rows[r, c]
                    p_rows[r, c] = cute.math.exp2(t * p_scale_log2 - row_lse[r], fastmath=True) * self.scores.grad(t)
        else:
            for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
                p_rows[r, None].store(
                    cute.math.exp2(p_rows[r, None].load() * p_scale_log2 - row_lse[r], fastmath=True))

        warpgroup.wait_group(0)  # dP is ready: V's stage is free
        v_pipe.consumer_release(v_state)
        v_state.advance()
        dp_rows = acc_as_rows_cols(acc_dp)
        for r in cutlass.range_constexpr(cute.size(dp_rows, mode=[0])):
            if const_expr(self.scaled_halves):
                dp_rows[r, None].store(p_rows[r, None].load() * (dp_rows[r, None].load() * dp_scale - row_delta[r]))
            else:
                dp_rows[r, None].store(p_rows[r, None].load() * (dp_rows[r, None].load() - row_delta[r]))
        if const_expr(self.scaled_halves):
            # dS's fp16 parts after a power of two per row (its values span P's range:
            # unscaled, their low parts would go subnormal); this block's dS K in an accumulator
            # of its own, added to dQ row by row with the inverse power.
            row_down = split_rows_scaled(operands.ds, operands.ds_lo, acc_dp)
            dq_part = cute.make_rmem_tensor_like(acc_dq)
            products = split_products(tdQrdS, tdQrKt[None, None, None, k_state.index], operands.ds_lo,
                                      operands.k_t_lo[None, None, None, k_state.index])
            wgmma_products(tiled_mma_dq, dq_part, products, True, 0)
            dq_rows, part_rows = acc_as_rows_cols(acc_dq), acc_as_rows_cols(dq_part)
            for r in cutlass.range_constexpr(cute.size(dq_rows, mode=[0])):
                dq_rows[r, None].store(dq_rows[r, None].load() + part_rows[r, None].load() * row_down[r])
        elif const_expr(self.split_operands):
            # dS's TF32 parts; this block's dS K in an accumulator of its own, added to dQ in
            # float32 (summed by the tensor cores over a long sequence's key blocks, dQ would
            # lose low bits at every step, as the forward's O did).
            store_tf32_split_operand_a(tdQrdS, operands.ds_lo, acc_dp)
            dq_part = cute.make_rmem_tensor_like(acc_dq)
            products = split_products(tdQrdS, tdQrKt[None, None, None, k_state.index], operands.ds_lo,
                                      operands.k_t_lo[None, None, None, k_state.index])
            wgmma_products(tiled_mma_dq, dq_part, products, True, 0)
            acc_dq.store(acc_dq.load() + dq_part.load())
        else:
            if const_expr(self.values_transposed):
                store_tf32_operand_a(tdQrdS, acc_dp)  # in the TF32 A order, which K^T's keys match
            else:
                tdQrdS.store(acc_as_operand_a(acc_dp).load().to(self.dtype))
            wgmma(tiled_mma_dq, acc_dq, tdQrdS, tdQrKt[None, None, None, k_state.index], False, 0)
        k_pipe.consumer_release(k_state)
        k_state.advance()
        return k_state, v_state

    @cute.jit
    def epilogue(self, acc_dq, softmax_scale, tiled_mma_dq, gmem: DqTensors, smem: DqSmem, atoms: DqTmaAtoms, tidx,
                 work: QueryBlockWork):
        mdQ, sQ, tma_atom_dq = gmem.dq, smem.q, atoms.dq
        if const_expr(self.split_operands):
            sQ = smem.dq  # a D-wide view of the (2D-wide) Q buffer
        m_block, head, batch = work.m_block, work.head, work.batch
        r_dq = cute.make_rmem_tensor_like(acc_dq, self.out_dtype)
        if const_expr(self.scaled_halves):
            softmax_scale = softmax_scale * gmem.scales[batch, head, SCALE_DQ]  # K's power of two
        r_dq.store((acc_dq.load() * softmax_scale).to(self.out_dtype))
        # dQ is staged in Q's buffer: every warpgroup must be past its last S = Q K^T.
        cute.arch.barrier(barrier_id=DqKernelBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        thr_copy = cute.make_tiled_copy_C(accumulator_store_atom(self.out_dtype), tiled_mma_dq).get_slice(tidx)
        cute.copy(thr_copy, thr_copy.retile(r_dq), thr_copy.partition_D(sQ))
        # stmatrix writes are generic-proxy stores; the TMA engine reads through the async proxy.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=DqKernelBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        tile = (self.block_m, self.dq_cols)
        if const_expr(self.problem.packed):
            # The rows past the sequence's end are the next sequence's: per-row predicated
            # 16-byte stores by the consumer threads instead of a bulk store.
            gdQ = cute.local_tile(self.sequences.rows(mdQ, head, work.seq), tile, (m_block, 0))
            store_rows_clipped(self.out_dtype, sQ, gdQ, tidx, self.num_mma_threads,
                               work.seq.seqlen_q - m_block * self.block_m, mdQ.shape[1], DQ_VALUES)
        elif tidx < cute.arch.WARP_SIZE:
            gdQ = cute.local_tile(mdQ[None, None, head, batch], tile, (m_block, 0))
            store_tile(tma_atom_dq, sQ, gdQ)
            # The CTA's shared memory must outlive the bulk store's reads of it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)
