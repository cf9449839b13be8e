"""FlashAttention backward for Hopper (sm_90a), written in the CuTe DSL.

One CTA owns one block of block_n keys of one (batch, head) and walks the query blocks that
can see it, so dK and dV live in registers for the CTA's whole life and are written once. dQ
is the sum over all key blocks, which several CTAs produce concurrently: each CTA adds its
partial dQ into an fp32 buffer (preprocess zeroes it, postprocess scales and converts it).

* warpgroup 0 is the producer. Its first warp issues TMA loads of K and V once, and of Q
  (with the LSE slice) and dO (with the delta slice) per query block, into num_stages-deep
  swizzled rings guarded by mbarriers.
* warpgroups 1.. are consumers, each owning 64 key rows. Per query block, with fp32
  accumulators (the register-A scheme of FA3's sm90 backward):
      S^T  = K Q^T                (WGMMA, both operands in shared memory)
      P^T  = exp2(S^T * scale * log2(e) - LSE * log2(e))   (the forward's P, recomputed)
      dP^T = V dO^T               (WGMMA, issued together with S^T)
      dS^T = P^T * (dP^T - delta) (delta = rowsum(dO * O), from the preprocess)
      dV += P^T dO,  dK += dS^T Q (WGMMA with P^T / dS^T as the register A operand)
      dQ_partial = dS K           (dS^T stored transposed to shared memory: dQ needs every
                                   warpgroup's keys)
  and dQ_partial is staged in shared memory and added to the fp32 buffer by bulk reduce-adds
  that the producer warpgroup's second warp issues (the writer warp, see dq_accumulate.py).
  LSE and delta are per query, i.e. per column of S^T. dQ needs all of dS, hence one barrier
  across the consumer warpgroups per query block.
* Epilogue: dK * softmax_scale and dV are converted, staged in the (now dead) K and V buffers
  with stmatrix and written by TMA stores that clip the key tail.

Float32 tiles (cute_flash.float32, "high" precision) run every GEMM on the TF32 WGMMA, which
reads both operands K-major: Q and dO arrive also as Q^T and dO^T copies (D, Sq8), their
queries permuted within groups of 8 to match P^T's and dS^T's registers as the TF32 A operand
(layouts.acc_as_tf32_operand_a), in rings of their own (BackwardPipes.q_t, do_t) so that Q's and
dO's stages go back once S^T and dP^T are done; P^T and dS^T are rounded to TF32 first
(layouts.store_tf32_operand_a: the tensor cores would truncate). Such a kernel
computes dK and dV only (rules.backward: dQ comes from bwd_dq_sm90), and its epilogue stores
float32 column pairs where stmatrix moves 16-bit elements. With split_operands ("highest",
3xTF32) every operand is its two TF32 parts (Q, dO, K, V [hi | lo] along D; Q^T, dO^T hi rows
over lo rows; P^T and dS^T split in registers), every GEMM hi lo + lo hi + hi hi, and each
step's dV / dK product goes into an accumulator of its own, added to dV / dK in float32 once
done (_dkv_gemm, _collect); dK and dV are staged through D-wide views of the K / V buffers.
With a 16-bit dtype and split_operands the operands are float32 inputs' scaled fp16 halves
("float32x3h", kernels/half_operands.py, docs/DESIGN.md): Q's and dO's column halves read
MN-major (no transposes), P^T scaled by P_SCALE and dS^T by a power of two per key row before
their splits, each step's product collected with those and the query head's operand scales
(_with_operand_scales), dK and dV stored in float32.

Sequence tails: TMA fills out-of-bounds rows of Q, dO, K, V with zeros. Key columns >= Sk
are masked to -inf (P = 0). Query rows >= Sq need no mask: the preprocess writes
LSE*log2(e) = +inf for them (and for rows whose LSE is -inf), so P = exp2(-inf) = 0, and
their delta is 0. The LSE/delta/dQ buffers are padded to a multiple of 128 rows so the TMA
loads of their slices and the dQ reductions never leave the buffer.

Config attributes (cute_flash.config.BackwardTileConfig, from the YAML entries):
    block_m             query rows per step of the inner loop (64 or 128; 80, 96, 112 with
                        dq_swap_ab)
    block_n             keys per CTA: 64 * num_mma_warpgroups (each warpgroup's S^T fragment is
                        exactly one 64-row WGMMA tile, which doubles as the A operand of dV / dK)
    num_stages          depth of the Q/LSE ring (1 or 2)
    num_stages_do       depth of the dO/delta ring (at most num_stages)
    num_stages_pds      shared-memory buffers for dS: 1, or num_stages (saves a barrier)
    num_mma_warpgroups  consumer warpgroups (2 or 3)
    dq_atom_m           consumer warpgroups stacked along the query rows of the dQ GEMM
                        (the rest split the head dim); block_m must be 64 * dq_atom_m
    deterministic       add dQ in a fixed order of key blocks (a turn semaphore per query
                        block, see FlashBackwardSm90): bitwise reproducible dQ
    dq_swap_ab          dQ^T = K^T dS^T (warpgroups split D), so block_m may be 80 (FA3's
                        non-causal D=128 step)
    dv_after_ds         dV += P^T dO is issued once dS is formed (P^T converted to 16 bits
                        then) instead of while it is formed: less overlap, but no 16-bit P^T
                        beside S^T and dP^T in fp32, which is what lets a block_m = 80 step fit
                        in 240 registers without ptxas serialising the WGMMAs (FA3's order)
    dq_stages           shared-memory dQ tiles the consumers and the writer warp take turns
                        through (1 or 2)
    fused_preprocess    not deterministic: the producer warpgroup's idle warps 2 and 3 do the
                        preprocess of the head launched prep_ahead heads later (see
                        bwd_prepare_ahead)
    split_head_dim      for D > 128: block_n = 64 keys shared by the consumer warpgroups, which
                        split S^T / dP^T along the queries and dK / dV (and dQ) along D, so a
                        thread holds D / num_wg floats of dK and dV together instead of D. P^T joins
                        dS^T in shared memory (both GEMMs need every warpgroup's queries), and
                        dV / dK read them from there (FA3's D = 256 backward splits likewise)
    grads_transposed    for D > 128 with more keys per CTA (96 at D = 192): the warpgroups split
                        the keys (block_n / num_wg each) and hold dK^T and dV^T (D x their keys);
                        S = Q K^T and dP = dO V^T with the queries as rows, P and dS through
                        shared memory as the B operands of dV^T += dO^T P and dK^T += Q^T dS
                        (shared_p_step): fewer partial dQ tiles per head than
                        split_head_dim's 64-key blocks, whose L2 reductions bound that step
    exps_above_dp_wait  P^T's exp2s pinned above the wait for dP^T (an always-true branch), or
                        left to ptxas, which sinks most of them among the dS math below it
    pinned_exp_columns  with the pin, only the exp2s of a thread's first that many query
                        columns (0: all): the rest go below the wait, and the pinned run of
                        MUFU no longer outlasts dP^T's GEMM (D <= 96, not with a softcap)
    section_pairs       a causal dense grid (not deterministic, no prepare-ahead) numbered
                        key-block-major inside sections of that many (head, batch) pairs
                        (tile_scheduler.sections_fast), 1: per pair; derived for grouped problems
dq_accum holds each query block in the dQ MMA's fragment order (the writer warp adds the
staged tile as is; the postprocess reorders it).
"""

import math
from functools import partial
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cute_flash.kernels import rules, warp_specialized
from cute_flash.kernels.barriers import BackwardBarrier
from cute_flash.kernels.block_ranges import BlockRanges
from cute_flash.kernels.bwd_prepare_ahead import PREP_WARPS, PrepareAhead
from cute_flash.kernels.dq_accumulate import DqAccumulation, DqBlockConverter, dq_staged_layout
from cute_flash.kernels.head_mapping import HeadMapping
from cute_flash.kernels.half_operands import (
    P_SCALE,
    SCALE_DK,
    SCALE_DP,
    SCALE_DV,
    SCALE_SCORES,
    split_rows_scaled,
    store_halves,
)
from cute_flash.kernels.layouts import (
    acc_as_operand_a,
    acc_as_rows_cols,
    accumulator_store_atom,
    column_halves_transposed,
    copy_clipped_rows,
    row_copy,
    row_halves,
    sequence_major,
    store_rows_clipped,
    store_tf32_operand_a,
    store_tf32_split_operand_a,
    transposed_view,
)
from cute_flash.kernels.mask import mask_scores
from cute_flash.kernels.optional_arguments import check_given
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.ptx import thread_idx_x_uncached
from cute_flash.kernels.score_transform import ScoreTransform
from cute_flash.kernels.sequences import PackedBatch, SequenceLayout
from cute_flash.kernels.stale_keys import zero_rows_past_keys
from cute_flash.kernels.tile_scheduler import grid_divisors, sections_fast
from cute_flash.kernels.tma_pipeline import SWIZZLED_TILE_ALIGN, shared_storage, start_rings, swizzled_tensor, tma_tiles
from cute_flash.kernels.wgmma import (
    K_MAJOR,
    MN_MAJOR,
    THREADS_PER_WARPGROUP,
    side_by_side_tiled_mma,
    smem_operands,
    split_products,
    stacked_tiled_mma,
    warpgroup_slice,
    wgmma,
    wgmma_k_major,
    wgmma_products,
)

# Named barrier ids: kernels/barriers.py (BackwardBarrier); 0 is __syncthreads.

# Registers per thread after setmaxnreg (consumers, producer), by consumer warpgroup count.
# Consumers hold dK and dV (2 * block_n * D / num_wg floats per warpgroup) for the whole CTA,
# plus S, dP and their 16-bit copies per step.
# One consumer warpgroup: float32x3 at D = 128, whose 64-key tiles of K and V (both parts)
# leave room for no second warpgroup's (rules.backward).
REGISTER_SPLIT = {1: (256, 24), 2: (240, 24), 3: (160, 32)}
GRAD_VALUES = 8  # per thread and row in a packed batch's dK / dV stores: 16 bytes


class CtaCounters(NamedTuple):
    """The int32 counters through which CTAs wait for each other, zeroed before the launch
    (one argument of __call__: torch passes a plain tuple)."""
    dq_semaphore: cute.Tensor  # (B, N, num_m_blocks): dQ turns (deterministic mode only)
    dq_done: cute.Tensor  # (B, N): CTAs whose dQ adds are done (read by the postprocess)
    prepared: cute.Tensor  # (B, N): CTAs that prepared the head (fused_preprocess)


# The kernel's arguments and per-CTA state, grouped. The DSL flattens a NamedTuple argument
# into its fields in order, so the kernel's parameter list (and its SASS) is that of the
# fields one by one.
class BackwardTensors(NamedTuple):
    """Global memory, kernel-side (S, D, N, B) / (S, N, B) views."""
    q: cute.Tensor  # TMA loads
    k: cute.Tensor
    v: cute.Tensor
    do: cute.Tensor
    lse: cute.Tensor  # LSE * log2(e), padded rows
    delta: cute.Tensor
    dk: cute.Tensor  # TMA stores
    dv: cute.Tensor
    dq_accum: cute.Tensor
    dq_semaphore: cute.Tensor  # deterministic mode
    dq_done: cute.Tensor
    # fused_preprocess: the plain (non-TMA) views of what it reads and writes.
    o: cute.Tensor
    do_rows: cute.Tensor
    lse_natural: cute.Tensor  # the forward's LSE
    lse_rows: cute.Tensor
    delta_rows: cute.Tensor
    prepared: cute.Tensor
    # A packed batch's sequence bounds (kernels/sequences.py); None for a dense batch.
    cu_seqlens_q: object
    cu_seqlens_k: object
    seqused_k: object
    # Float32: Q^T and dO^T (TMA loads; QueryTransposes); None otherwise.
    q_t: object = None
    do_t: object = None
    # Scaled halves: (B, N, SCALES) float32 operand scales (SCALE_*); None otherwise.
    scales: object = None
    # A grid in sections (section_pairs > 1): its divisors, made on the host
    # (tile_scheduler.grid_divisors); None otherwise.
    tile_divisors: object = None
    # fused_postprocess: dQ (S, D, N, B) and the dq_done total that completes a head this call
    # (0: the postprocess converts); None otherwise.
    dq: object = None
    dq_target: object = None


class QueryTransposes(NamedTuple):
    """A float32 backward's Q^T and dO^T, (B, N, D, Sq8), queries permuted within groups of 8
    (kernels/tf32_operands.py); one argument of __call__, read by float32 kernels only."""
    q_t: cute.Tensor
    do_t: cute.Tensor


class BackwardTmaAtoms(NamedTuple):
    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    do: cute.CopyAtom
    lse: cute.CopyAtom
    delta: cute.CopyAtom
    dk: cute.CopyAtom  # stores
    dv: cute.CopyAtom
    q_t: object = None  # float32
    do_t: object = None


class BackwardSmem(NamedTuple):
    """Shared-memory tensors of the kernel (or, with `stat` for lse and delta, their layouts)."""
    q: object  # num_stages deep, like do, lse and delta
    do: object
    k: object  # dK's staging buffer in the epilogue
    v: object  # dV's
    ds: object  # num_stages_pds deep
    p: object  # like ds; split_head_dim only (None otherwise)
    lse: object
    delta: object
    dq: object  # dq_stages deep; None without dQ
    q_t: object = None  # float32: Q^T and dO^T, (D, block_m) num_stages deep; None otherwise
    do_t: object = None
    # Split operands: dK's and dV's staging views of the K and V buffers, (block_n, D) where
    # K and V are (block_n, 2D); None otherwise (k and v above).
    dk: object = None
    dv: object = None
    # fused_postprocess: one int32, the writer warp's bits of the query heads this CTA completed.
    finished: object = None


class BackwardPipes(NamedTuple):
    q: object  # PipelineTmaAsync: Q with the LSE slice
    do: object  # dO with the delta slice
    k: object
    v: object
    # Float32: Q^T and dO^T in rings of their own, so that Q's and dO's stages go back once
    # S^T and dP^T are done (the next step's loads then overlap this step's dV and dK).
    q_t: object = None
    do_t: object = None


class BackwardMmas(NamedTuple):
    sdp: cute.TiledMma  # S^T = K Q^T, dP^T = V dO^T
    dkv: cute.TiledMma  # dV += P^T dO, dK += dS^T Q
    dq: cute.TiledMma  # dQ = dS K (or its transpose)


class KeyBlockWork(NamedTuple):
    """A CTA's work: key block n_block of (batch, key/value head `head`), query blocks
    [m_block_min, m_block_max) of each of the `group` query heads head * group + g that read
    it (group: a compile-time 1 without grouped-query attention). The CTA walks the query
    heads one after the other, so dK and dV sum over the group in registers (fp32, fixed
    order) and no per-query-head partial exists. Item m_block + g * (m_block_max -
    m_block_min) numbers the (head, query block) steps consecutively: the dQ hand-off's
    stages take turns by item."""
    n_block: Int32
    head: Int32
    batch: Int32
    m_block_min: Int32
    m_block_max: Int32
    group: object
    seq: object  # its Sequence (kernels/sequences.py); batch above indexes the counters


class StepOperands(NamedTuple):
    """A consumer thread's WGMMA operand fragments and dS copy, fixed for the CTA's life."""
    k: cute.Tensor  # S^T = K Q^T
    q: cute.Tensor
    v: cute.Tensor  # dP^T = V dO^T
    do: cute.Tensor
    do_t: cute.Tensor  # dV += P^T dO
    q_t: cute.Tensor  # dK += dS^T Q
    ds: cute.Tensor  # dQ = dS K
    k_t: cute.Tensor
    ds_copy: object  # stmatrix (transposing) of dS^T into the dS buffer
    ds_smem: cute.Tensor  # its destination partition
    st_cols: cute.Tensor  # which query (column of S^T) each accumulator value is
    # split_head_dim: P^T's destination partition (like ds_smem), and P^T / dS^T as the
    # shared-memory A operands of dV / dK; None otherwise.
    p_smem: object
    pt: object
    dst: object
    # Split operands: the low halves of Q^T and dO^T (do_t, q_t above: the high ones).
    do_t_lo: object = None
    q_t_lo: object = None

def _smem_layout(dtype, rows: int, cols: int, stages=None, major_size=None):
    """Swizzled (rows, cols[, stages]) tile with cols contiguous.

    The swizzle atom is chosen from `major_size` (default cols): a tile that some warpgroup
    reads as an MN-major WGMMA operand in slices of major_size columns must not have a swizzle
    atom wider than that slice (e.g. K for D=64 when two warpgroups split dQ's head dim).
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_size or cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def _probabilities(out_rc, scores_rc, p_scale_log2, lse_cols, columns=None):
    """P^T = exp2(S^T * scale - LSE) of a step's fragment (rows, cols views; out may be the
    scores' own registers), of the given query columns (default: all). Plain Python: unrolled
    where the kernel calls it."""
    for c in columns if columns is not None else range(len(lse_cols)):
        for r in range(cute.size(scores_rc, mode=[0])):
            out_rc[r, c] = cute.math.exp2(scores_rc[r, c] * p_scale_log2 - lse_cols[c], fastmath=True)


def _rows_as_cols(rows_cols: cute.Tensor) -> cute.Tensor:
    """A (rows, cols) view with its two modes swapped (grads_transposed: the queries that
    _probabilities / _ds index by column are S's rows)."""
    return cute.make_tensor(rows_cols.iterator, cute.select(rows_cols.layout, mode=[1, 0]))


def _ds(dp_rc, p_rc, delta_cols, dp_scale=None):
    """dS^T = P^T (dP^T - delta) in dP^T's registers (scaled halves: dP^T times its power of
    two dp_scale first). Plain Python, unrolled."""
    for c in range(len(delta_cols)):
        for r in range(cute.size(dp_rc, mode=[0])):
            dp = dp_rc[r, c] if dp_scale is None else dp_rc[r, c] * dp_scale
            dp_rc[r, c] = p_rc[r, c] * (dp - delta_cols[c])


def dq_tiled_mma(dtype, head_dim: int, dq_atom_m: int, num_mma_warpgroups: int, block_m: int = 64,
                 swap_ab: bool = False) -> cute.TiledMma:
    """dQ = dS K: dS is K-major (keys contiguous), K^T has D contiguous (MN-major). With
    swap_ab, dQ^T = K^T dS^T: K^T is the MN-major A operand (each warpgroup 64 of the D
    rows) and dS^T the K-major B operand (N = block_m, any multiple of 16). Also built by
    the postprocess, which reads dq_accum in this MMA's fragment order."""
    if swap_ab:
        return sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.K, Float32,
            atom_layout_mnk=(num_mma_warpgroups, 1, 1), tiler_mn=(64, block_m),
        )
    dq_atom_n = num_mma_warpgroups // dq_atom_m
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
        atom_layout_mnk=(dq_atom_m, dq_atom_n, 1), tiler_mn=(64, head_dim // dq_atom_n),
    )


class FlashBackwardSm90(DqAccumulation, PrepareAhead):
    """Backward main kernel for one (dtype, head_dim, causal, config) combination.

    Call with (q, k, v, out, dout, lse, lse_log2, delta, dq_accum, (dq_semaphore, dq_done,
    prepared), dk, dv, softmax_scale, prep_ahead, prep_ctas, prepared_count, batch, (q_t, dout_t),
    scales, dq, dq_target, stream): q, out, dout, dq (B, N, Sq, D);
    k, v, dk, dv (B, N, Sk, D); lse (B, N, Sq) fp32 from the forward; lse_log2, delta
    (B, N, Sq_pad) fp32; dq_accum (B, N, Sq_pad, D) fp32; Sq_pad =
    seqlen_pad.padded_seqlen_q(Sq); dq_semaphore (B, N, ceil(Sq / block_m)) int32, zeroed,
    in deterministic mode (else None, as batch, (q_t, dout_t) and scales where this kernel does
    not read them: optional_arguments); dq_done, prepared (B, N)
    int32, zeroed (or, with prep_ahead 0, counts kept from earlier calls: prepared_count and
    the postprocess's target are then their running totals). The preprocess has filled
    lse_log2, delta and zeroed dq_accum for the first prep_ahead heads in launch order; with
    fused_preprocess this kernel does the rest (out, lse, prepared, prep_ctas,
    prepared_count: see bwd_prepare_ahead), else prep_ahead must be B x N. A one-launch kernel
    (fused_postprocess) prepares only its own heads, in its consumers (prep_ahead 0), and with
    dq_target > 0 (the dq_done total this call reaches) the last CTA of each head writes its
    dQ (convert_finished_heads); else dq is not written.

    Deterministic mode: the fp32 additions into dq_accum[b, h, m-block] happen in a fixed
    order of key blocks. dq_semaphore[b, h, m] counts the key blocks that have added theirs;
    a CTA's writer warp waits until it equals the CTA's turn (_dq_turn), adds, waits for its
    reductions to be performed and increments it.
    A CTA only waits for CTAs launched before it (lower blockIdx.x of the same batch and
    head), and the grid launches blocks in increasing linear index, so the wait cannot
    deadlock: the CTA whose turn is 0 never waits, and every CTA it can wait for is resident
    or finished.
    """

    def __init__(self, dtype, head_dim: int, problem: AttentionProblem, config, with_dq: bool = True,
                 split_operands: bool = False, value_head_dim: int | None = None, grad_columns: tuple | None = None):
        """split_operands: float32 operands as TF32 hi | lo pairs (3xTF32, "float32x3"; see the
        module docstring). value_head_dim: the V, dO and dV tiles' columns (None: head_dim), a
        value tile of its own below head_dim (grads_transposed: dV^T's rows, dP's contraction).
        grad_columns: (first column, columns) of dK and dV that this launch computes, the scaled
        halves above D = 128 (rules.gradient_chunks): S^T and dP^T still contract over every
        column, dK's and dV's GEMMs read those columns of Q and dO; None: all of them."""
        # Without dQ (with_dq=False) the dQ GEMM's shape rules do not apply.
        # fp16 split operands: float32 inputs' scaled halves (kernels/half_operands.py).
        self.scaled_halves = split_operands and dtype.width == 16
        dtype_name = (rules.SCALED_HALVES if self.scaled_halves else
                      rules.SPLIT_FLOAT32 if split_operands else dtype.__name__.lower())
        rules.require("FlashBackwardSm90", rules.backward(dtype_name, head_dim, config, with_dq, value_head_dim,
                                                          grad_columns))
        # Float32 tiles: TF32 GEMMs on Q^T / dO^T copies (see the module docstring).
        self.tf32 = dtype is Float32
        if self.tf32:  # (the scaled halves read Q, dO as the 16-bit kernels do: any batch)
            rules.require("FlashBackwardSm90", rules.float32_problem(problem))
        self.split_operands = split_operands
        self.out_dtype = Float32 if self.scaled_halves else dtype
        # Columns of the Q, dO, K and V tiles (rows of Q^T's and dO^T's): both parts when split.
        self.operand_cols = 2 * head_dim if split_operands else head_dim
        self.value_head_dim = value_head_dim or head_dim
        # dK's and dV's columns (the accumulators, their GEMMs' N, the epilogue's tiles): a chunk
        # of the tile's (grad_columns, where value_head_dim == head_dim), else all of them.
        self.grad_columns = grad_columns
        self.dk_cols = grad_columns[1] if grad_columns else head_dim
        self.dv_cols = grad_columns[1] if grad_columns else self.value_head_dim
        # Columns of the V and dO tiles (value_head_dim: 16-bit only, rules.backward).
        self.value_cols = self.operand_cols if self.value_head_dim == head_dim else self.value_head_dim
        nwg = config.num_mma_warpgroups
        self.dq_swap_ab = with_dq and config.dq_swap_ab
        self.dtype = dtype
        self.head_dim = head_dim
        self.problem = problem
        self.block_m = config.block_m
        self.block_n = config.block_n
        self.ranges = BlockRanges(self.block_m, self.block_n, problem)
        self.heads = HeadMapping(problem)
        self.scores = ScoreTransform(problem, float32_accurate=split_operands)
        self.sequences = SequenceLayout(problem)
        self.num_stages = config.num_stages
        self.num_stages_do = config.num_stages_do
        self.num_stages_pds = config.num_stages_pds
        self.num_mma_warpgroups = nwg
        self.dq_atom_m = config.dq_atom_m
        # Warpgroups splitting D in the dQ GEMM (all of them with dq_swap_ab).
        self.dq_atom_n = nwg if self.dq_swap_ab else nwg // config.dq_atom_m
        self.num_mma_threads, self.num_threads, self.mma_regs, self.producer_regs = warp_specialized.warp_roles(
            nwg, REGISTER_SPLIT)
        # with_dq=False: dK and dV only (dQ then comes from bwd_dq_sm90's separate kernel);
        # no dQ GEMM, no accumulator traffic, no writer warp.
        self.with_dq = with_dq
        self.deterministic = config.deterministic
        # Deterministic causal: key blocks add their dQ for a query block from the last key
        # block that sees it down to the first (see _dq_turn), so the CTA of the highest key
        # block must start first: blockIdx.x walks the key blocks in reverse.
        self.reverse_n_blocks = self.deterministic and problem.causal
        # With a softcap P^T's 16-bit copy is taken before dS (score_transform), so dV is
        # issued then too: dv_after_ds would only keep that copy alive longer.
        self.dv_after_ds = config.dv_after_ds and not problem.softcap
        self.exps_above_dp_wait = config.exps_above_dp_wait
        self.pinned_exp_columns = config.pinned_exp_columns
        self.dq_stages = config.dq_stages if with_dq else 1
        # The waits for a prepared head sit in the writer warp; the deterministic order of
        # the dQ additions has CTAs waiting on each other already (left as it is).
        self.fused_preprocess = with_dq and config.preprocess_in_main
        # Causal key blocks longest first across sections of (head, batch) pairs (config.section_pairs):
        # not where the launch order carries meaning, the deterministic turns (see _dq_turn) and
        # the prepare-ahead (heads counted in launch order).
        self.section_pairs = (config.section_pairs if problem.causal and not problem.packed and not self.deterministic
                              and not self.fused_preprocess else 1)
        self.split_head_dim = config.split_head_dim
        self.grads_transposed = config.grads_transposed
        # P goes through shared memory too (dV's operand is read by warpgroups that did not
        # compute it, or as a B operand).
        self.p_in_smem = self.split_head_dim or self.grads_transposed
        # A one-launch grid's last CTA of a head converts its dQ (convert_finished_heads), in the
        # dQ staging buffer's bytes (dense batches only, rules.backward).
        self.fused_postprocess = with_dq and config.fused_postprocess
        self.dq_converter = None
        if self.fused_postprocess:
            assert not problem.packed, "fused_postprocess converts a dense batch's heads"
            assert not self.p_in_smem, "fused_postprocess keeps its bits in the unused P buffer"
            self.dq_converter = DqBlockConverter(dtype, head_dim, self.block_m, nwg)
            assert self.dq_converter.smem_bytes() <= 4 * self.block_m * head_dim * config.dq_stages
        # Columns of dK / dV per warpgroup: slices of Q, dO (their B operands) and of the dK /
        # dV staging tiles that one warpgroup reads or writes.
        self.dkv_cols = head_dim // nwg if self.split_head_dim else head_dim
        self.value_dkv_cols = self.value_head_dim // nwg if self.split_head_dim else self.value_head_dim
        # Split operands above D = 64 (one consumer warpgroup): dV's product is added before
        # dK's GEMM is issued, so that one product accumulator lives beside dK and dV (with
        # both, a thread's 64 keys would hold 4 x D / 2 = 256 floats of them at D = 128).
        self.products_in_turn = split_operands and head_dim > rules.SPLIT_BACKWARD_PAIRED_HEAD_DIM

    def _tiled_mmas(self):
        nwg = self.num_mma_warpgroups
        if const_expr(self.grads_transposed):
            # Warpgroups side by side along the keys: S = Q K^T and dP = dO V^T (64 queries x
            # block_n / nwg keys each, both operands K-major), and dV^T += dO^T P, dK^T += Q^T dS
            # (D rows in 64-row atoms x the warpgroup's keys; dO^T / Q^T are MN-major views of
            # dO / Q, and P / dS, keys contiguous, MN-major B operands).
            keys = self.block_n // nwg
            sdp = side_by_side_tiled_mma(self.dtype, nwg, keys)
            dkv = side_by_side_tiled_mma(self.dtype, nwg, keys, MN_MAJOR, MN_MAJOR)
            dq = dq_tiled_mma(self.dtype, self.head_dim, self.dq_atom_m, nwg, self.block_m, self.dq_swap_ab)
            return BackwardMmas(sdp, dkv, dq)
        if const_expr(self.split_head_dim):
            # Warpgroups side by side: S^T / dP^T (64 keys x block_m / nwg queries each) and
            # dV / dK (64 keys x D / nwg columns each, A = P^T / dS^T from shared memory, keys
            # contiguous there: MN-major).
            sdp = side_by_side_tiled_mma(self.dtype, nwg, self.block_m // nwg)
            dkv = side_by_side_tiled_mma(self.dtype, nwg, self.head_dim // nwg, MN_MAJOR, MN_MAJOR)
            dq = dq_tiled_mma(self.dtype, self.head_dim, self.dq_atom_m, nwg, self.block_m, self.dq_swap_ab)
            return BackwardMmas(sdp, dkv, dq)
        # S^T = K Q^T and dP^T = V dO^T: warpgroups split the key rows (M), each holding
        # (64 keys) x (block_m queries); K, V, Q and dO are all K-major (D contiguous).
        sdp = stacked_tiled_mma(self.dtype, nwg, self.block_m)
        if const_expr(self.tf32):
            # dV / dK with Q^T / dO^T K-major (queries contiguous), no dQ GEMM.
            return BackwardMmas(sdp, stacked_tiled_mma(self.dtype, nwg, self.head_dim, K_MAJOR,
                                                       a_from_registers=True), None)
        # dV += P^T dO and dK += dS^T Q with P^T / dS^T straight from those registers (the
        # same 64 key rows per warpgroup), dO^T / Q^T MN-major from shared memory.
        dkv = stacked_tiled_mma(self.dtype, nwg, self.dk_cols, MN_MAJOR, a_from_registers=True)
        dq = dq_tiled_mma(self.dtype, self.head_dim, self.dq_atom_m, nwg, self.block_m, self.dq_swap_ab)
        return BackwardMmas(sdp, dkv, dq)

    def _smem_layouts(self) -> BackwardSmem:
        # Q and dO are also the MN-major B operands of dK / dV (all D columns per warpgroup);
        # K is the MN-major B operand of dQ (A with dq_swap_ab), D / dq_atom_n columns per
        # warpgroup; dS (keys contiguous, written transposed from dS^T by each warpgroup's
        # block_n / num_wg keys) is the K-major operand of dQ.
        # Q and dO are read by dK / dV in slices of dkv_cols columns, V (dV's staging tile)
        # written in them.
        q = _smem_layout(self.dtype, self.block_m, self.head_dim, self.num_stages, major_size=self.dkv_cols)
        k = _smem_layout(self.dtype, self.block_n, self.head_dim, major_size=self.head_dim // self.dq_atom_n)
        v = _smem_layout(self.dtype, self.block_n, self.value_head_dim, major_size=self.value_dkv_cols)
        # split_head_dim: every warpgroup reads all 64 keys of dS (and P) as an MN-major operand.
        ds = _smem_layout(
            self.dtype, self.block_m, self.block_n, self.num_stages_pds,
            major_size=self.block_n if self.split_head_dim else self.block_n // self.num_mma_warpgroups,
        )
        # dO's ring may be shallower than Q's (num_stages_do); delta rides with dO, LSE with Q.
        do = _smem_layout(self.dtype, self.block_m, self.value_head_dim, self.num_stages_do,
                          major_size=self.value_dkv_cols)
        # Each stage's slice is a TMA destination: 128-byte aligned (block_m = 80 is 320 bytes).
        stat_stage_stride = (self.block_m + 31) // 32 * 32
        stat = cute.make_layout((self.block_m, self.num_stages), stride=(1, stat_stage_stride))
        stat_do = cute.make_layout((self.block_m, self.num_stages_do), stride=(1, stat_stage_stride))
        dq = None
        if const_expr(self.with_dq):
            dq = dq_staged_layout(self.block_m, self.head_dim, self.num_mma_warpgroups, self.dq_stages)
        if const_expr(self.scaled_halves):
            # Q, dO, K, V with both parts side by side (Q and dO read MN-major per column
            # half by dK / dV); dK and dV staged D wide in float32 in K's and V's buffers.
            q = _smem_layout(self.dtype, self.block_m, self.operand_cols, self.num_stages, major_size=self.head_dim)
            do = _smem_layout(self.dtype, self.block_m, self.operand_cols, self.num_stages_do,
                              major_size=self.head_dim)
            k = _smem_layout(self.dtype, self.block_n, self.operand_cols)
            grads = _smem_layout(Float32, self.block_n, self.dk_cols)
            return BackwardSmem(q, do, k, k, None, None, stat, stat_do, None, None, None, grads, grads)
        if const_expr(self.tf32):
            # Q^T / dO^T: (D, block_m) with the queries contiguous, the K-major B operands of
            # dK / dV; no dS buffer (no dQ GEMM).
            transposed = _smem_layout(self.dtype, self.operand_cols, self.block_m, self.num_stages)
            if const_expr(self.split_operands):
                # Q, dO, K, V with both parts side by side; dK and dV staged D wide.
                q = _smem_layout(self.dtype, self.block_m, self.operand_cols, self.num_stages)
                k = _smem_layout(self.dtype, self.block_n, self.operand_cols)
                grads = _smem_layout(self.dtype, self.block_n, self.head_dim)
                return BackwardSmem(q, q, k, k, None, None, stat, stat, None, transposed, transposed, grads, grads)
            return BackwardSmem(q, q, k, v, None, None, stat, stat, None, transposed, transposed)
        return BackwardSmem(q, do, k, v, ds, ds if self.p_in_smem else None, stat, stat_do, dq)

    def _rings(self, layouts: BackwardSmem) -> dict:
        """(num_stages, bytes per stage) of each ring (BackwardPipes). The Q ring carries the
        LSE slice and the dO ring the delta slice of the same rows."""
        q_bytes = cute.size_in_bytes(self.dtype, cute.select(layouts.q, mode=[0, 1])) + self.block_m * 4
        do_bytes = cute.size_in_bytes(self.dtype, cute.select(layouts.do, mode=[0, 1])) + self.block_m * 4
        k_bytes = cute.size_in_bytes(self.dtype, layouts.k)
        v_bytes = cute.size_in_bytes(self.dtype, layouts.v)
        rings = dict(q=(self.num_stages, q_bytes), do=(self.num_stages_do, do_bytes), k=(1, k_bytes),
                     v=(1, v_bytes))
        if const_expr(self.tf32):
            transposed_bytes = cute.size_in_bytes(self.dtype, cute.select(layouts.q_t, mode=[0, 1]))
            rings.update(q_t=(self.num_stages, transposed_bytes), do_t=(self.num_stages, transposed_bytes))
        return rings

    def _shared_storage(self, layouts: BackwardSmem):
        """The kernel's shared memory struct (the fields depend on the config)."""
        tile = lambda layout: (self.dtype, cute.cosize(layout), SWIZZLED_TILE_ALIGN)  # noqa: E731
        buffers = dict(
            sLSE=(Float32, cute.cosize(layouts.lse), 128),
            sDelta=(Float32, cute.cosize(layouts.delta), 128),
            sQ=tile(layouts.q), sdO=tile(layouts.do), sK=tile(layouts.k), sV=tile(layouts.v),
            # P^T's (P's) buffer with split_head_dim (grads_transposed); else 128 bytes, unused but
            # by fused_postprocess's finished bits (without them sdS and sdQ sit 1 KiB lower,
            # which changes the SASS (address immediates only) of every kernel with dQ; and a
            # field of its own would take 1 KiB that fp16 D = 128's tile does not have).
            sP=tile(layouts.p) if self.p_in_smem else (self.dtype, 64, 128),
            sdS=tile(layouts.ds) if layouts.ds is not None else (self.dtype, 64, 128),
        )
        if self.tf32:
            buffers.update(sQt=tile(layouts.q_t), sdOt=tile(layouts.do_t))
        if self.with_dq:
            # 16-byte alignment suffices for the bulk reduce-adds and the vector stores.
            buffers["sdQ"] = (Float32, cute.cosize(layouts.dq), 128)
        return shared_storage(self._rings(layouts), buffers)

    def optional_arguments(self) -> tuple:
        """Which of __call__'s optional arguments (dq_semaphore, batch, transposed, scales) this
        kernel reads; the others are None (optional_arguments.py)."""
        return (self.with_dq and self.deterministic, self.problem.packed, self.tf32, self.scaled_halves)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, N, Sq, D)
        mK: cute.Tensor,  # (B, N, Sk, D)
        mV: cute.Tensor,  # (B, N, Sk, D)
        mO: cute.Tensor,  # (B, N, Sq, D), read by fused_preprocess only
        mdO: cute.Tensor,  # (B, N, Sq, D)
        mLSEnat: cute.Tensor,  # (B, N, Sq) fp32, the forward's LSE, read by fused_preprocess only
        mLSE: cute.Tensor,  # (B, N, Sq_pad) fp32, LSE * log2(e), +inf for empty/padded rows
        mDelta: cute.Tensor,  # (B, N, Sq_pad) fp32
        mdQaccum: cute.Tensor,  # (B, N, Sq_pad, D) fp32, zeroed
        counters: CtaCounters,
        mdK: cute.Tensor,  # (B, N, Sk, D)
        mdV: cute.Tensor,  # (B, N, Sk, D)
        softmax_scale: Float32,
        prep_ahead: Int32,  # heads prepared by the preprocess; B x N without fused_preprocess
        prep_ctas: Int32,  # key blocks (CTAs) of a head that prepare a later one
        # What prepared[b, h] reads once (b, h) is prepared: prep_ctas where the preprocess
        # zeroed the counts, their running total where kept counts go on from the last call
        # (launch_bwd's one-launch grids, which prepare every head in this kernel).
        prepared_count: Int32,
        batch: PackedBatch | None,  # problem.packed (then B = 1 above)
        transposed: QueryTransposes | None,  # float32 (TF32) kernels
        mScales: cute.Tensor | None,  # (B, N, 5) float32 operand scales: scaled halves
        mdQ: cute.Tensor,  # (B, N, Sq, D), written only with fused_postprocess
        dq_target: Int32,  # fused_postprocess: the dq_done total a head's last CTA reaches (0: none converts)
        stream: cuda.CUstream,
    ):
        mdQsem, mdQdone, mPrepared = counters
        check_given("the backward", ("dq_semaphore", "batch", "transposed", "scales"),
                    (mdQsem, batch, transposed, mScales), self.optional_arguments())
        # Kernel-side views: (S, D, N, B) / (S, N, B), as in the forward.
        mQ, mK, mV, mO, mdO, mdQaccum, mdK, mdV, mLSEnat, mLSE, mDelta = [
            sequence_major(t) for t in (mQ, mK, mV, mO, mdO, mdQaccum, mdK, mdV, mLSEnat, mLSE, mDelta)
        ]
        if const_expr(mdQsem is not None):
            mdQsem = sequence_major(mdQsem)

        mmas = self._tiled_mmas()
        layouts = self._smem_layouts()
        sQ_layout, sdO_layout, sK_layout, sV_layout, sStat_layout = (layouts.q, layouts.do, layouts.k, layouts.v,
                                                                     layouts.lse)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_store = cpasync.CopyBulkTensorTileS2GOp()
        q_tile = (self.block_m, self.operand_cols)
        kv_tile = (self.block_n, self.operand_cols)
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1]), q_tile
        )
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(
            tma_load, mdO, cute.select(sdO_layout, mode=[0, 1]), (self.block_m, self.value_cols)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, sK_layout, kv_tile)
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mV, sV_layout, (self.block_n, self.value_cols))
        tma_atom_lse, tma_lse = cpasync.make_tiled_tma_atom(
            tma_load, mLSE, cute.select(sStat_layout, mode=[0]), (self.block_m,)
        )
        tma_atom_delta, tma_delta = cpasync.make_tiled_tma_atom(
            tma_load, mDelta, cute.select(sStat_layout, mode=[0]), (self.block_m,)
        )
        sdK_layout = layouts.dk if const_expr(self.split_operands) else sK_layout
        sdV_layout = layouts.dv if const_expr(self.split_operands) else sV_layout
        # (A gradient chunk's dK and dV: the caller's views of those columns.)
        tma_atom_dk, tma_dk = cpasync.make_tiled_tma_atom(tma_store, mdK, sdK_layout, (self.block_n, self.dk_cols))
        tma_atom_dv, tma_dv = cpasync.make_tiled_tma_atom(tma_store, mdV, sdV_layout, (self.block_n, self.dv_cols))
        tma_atom_qt, tma_qt, tma_atom_dot, tma_dot = None, None, None, None
        if const_expr(self.tf32):
            transposed_tile = (self.operand_cols, self.block_m)
            transposed_stage = cute.select(layouts.q_t, mode=[0, 1])
            tma_atom_qt, tma_qt = cpasync.make_tiled_tma_atom(tma_load, sequence_major(transposed.q_t),
                                                              transposed_stage, transposed_tile)
            tma_atom_dot, tma_dot = cpasync.make_tiled_tma_atom(tma_load, sequence_major(transposed.do_t),
                                                                transposed_stage, transposed_tile)

        warp_specialized.check_shared_memory(self._shared_storage(layouts), "backward",
                                             "fewer stages or a smaller block_m")

        scale_log2 = softmax_scale * Float32(math.log2(math.e))
        packed = const_expr(self.problem.packed)
        grid = (cute.ceil_div(mK.shape[0], self.block_n), mK.shape[2], mQ.shape[3])
        if const_expr(packed):
            # Key blocks of every sequence, numbered without empty ones (SequenceLayout.locate).
            grid = (self.sequences.block_numbers(mK.shape[0], self.block_n, batch.cu_seqlens_q.shape[0] - 1),
                    mK.shape[2], 1)
        # Key block fastest; under causal masking the low key blocks see the most query
        # blocks, and they are launched first (longest first) -- except in deterministic
        # causal mode, where blockIdx.x walks the key blocks in reverse (see __init__).
        # With section_pairs, the kernel renumbers that order in sections of pairs.
        sections = None
        if const_expr(self.section_pairs > 1):
            sections = grid_divisors(grid[0], grid[1], grid[2], self.section_pairs)
        warp_specialized.launch(
            self.kernel(
                BackwardTensors(tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta,
                                mdK if packed else tma_dk, mdV if packed else tma_dv, mdQaccum, mdQsem,
                                mdQdone, mO, mdO, mLSEnat, mLSE, mDelta, mPrepared,
                                batch.cu_seqlens_q if packed else None, batch.cu_seqlens_k if packed else None,
                                batch.seqused_k if const_expr(self.problem.keys_used) else None, tma_qt, tma_dot,
                                mScales, sections,
                                sequence_major(mdQ) if const_expr(self.fused_postprocess) else None,
                                dq_target if const_expr(self.fused_postprocess) else None),
                prep_ahead, prep_ctas, prepared_count,
                BackwardTmaAtoms(tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_lse, tma_atom_delta,
                                 tma_atom_dk, tma_atom_dv, tma_atom_qt, tma_atom_dot),
                scale_log2, softmax_scale, layouts, mmas,
            ),
            grid, self.num_threads, stream,
        )

    @cute.kernel
    def kernel(
        self,
        gmem: BackwardTensors,
        prep_ahead: Int32,
        prep_ctas: Int32,
        prepared_count: Int32,
        atoms: BackwardTmaAtoms,
        scale_log2: Float32,
        softmax_scale: Float32,
        layouts: BackwardSmem,
        mmas: BackwardMmas,
    ):
        if const_expr(self.with_dq):
            # The postprocess may start once every CTA of this grid is running: it waits per
            # (batch, head) on mdQdone, so it converts the heads that are finished while the
            # last CTAs still run (see bwd_postprocess). Never earlier: a waiting postprocess
            # CTA must not take the place of a CTA of this grid that it waits for.
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = warp_specialized.start(atoms)

        storage = cutlass.memory.SmemAllocator().allocate(self._shared_storage(layouts))
        pipes = start_rings(storage, BackwardPipes, self._rings(layouts), self.num_mma_threads)
        sQ, sdO, sK, sV = (
            swizzled_tensor(b, layout) for b, layout in zip((storage.sQ, storage.sdO, storage.sK, storage.sV), layouts)
        )
        sdS, sQt, sdOt = None, None, None
        if const_expr(self.tf32):
            sQt = swizzled_tensor(storage.sQt, layouts.q_t)
            sdOt = swizzled_tensor(storage.sdOt, layouts.do_t)
        elif const_expr(not self.scaled_halves):
            sdS = swizzled_tensor(storage.sdS, layouts.ds)
        sLSE = storage.sLSE.get_tensor(layouts.lse)
        sDelta = storage.sDelta.get_tensor(layouts.delta)
        sdQ = None
        if const_expr(self.with_dq):
            sdQ = storage.sdQ.get_tensor(layouts.dq)
        sP = None
        if const_expr(self.p_in_smem):
            sP = swizzled_tensor(storage.sP, layouts.p)
        sdK, sdV = None, None
        if const_expr(self.scaled_halves):
            # float32 views of the fp16 K and V buffers (2D fp16 columns: as many bytes).
            sdK = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), layouts.dk.inner, dtype=Float32),
                                   layouts.dk.outer)
            sdV = cute.make_tensor(cute.recast_ptr(storage.sV.data_ptr(), layouts.dv.inner, dtype=Float32),
                                   layouts.dv.outer)
        elif const_expr(self.split_operands):
            sdK = swizzled_tensor(storage.sK, layouts.dk)
            sdV = swizzled_tensor(storage.sV, layouts.dv)
        sFinished = None
        if const_expr(self.fused_postprocess):
            sFinished = cute.make_tensor(cute.recast_ptr(storage.sP.data_ptr(), dtype=Int32), cute.make_layout(1))
        smem = BackwardSmem(sQ, sdO, sK, sV, sdS, sP, sLSE, sDelta, sdQ, sQt, sdOt, sdK, sdV, sFinished)

        n_block, head, batch = cute.arch.block_idx()
        if const_expr(self.problem.packed):
            seq, n_block, _ = self.sequences.locate(n_block, self.block_n, True, gmem.q, gmem.k, gmem)
            batch = seq.index
        else:
            if const_expr(self.section_pairs > 1):
                # The grid's linear launch order, renumbered key-block-major within sections.
                blocks, heads, _ = cute.arch.grid_dim()
                n_block, pair = sections_fast(n_block + blocks * (head + heads * batch), gmem.tile_divisors)
                batch, head = divmod(pair, gmem.tile_divisors.heads)
            seq = self.sequences.of(batch, gmem.q, gmem.k, gmem)
        seqlen_k = seq.seqlen_k
        num_n_blocks = (seqlen_k + self.block_n - 1) // self.block_n
        if const_expr(self.reverse_n_blocks):
            n_block = num_n_blocks - 1 - n_block
        m_block_min, m_block_max = self.ranges.query_block_range(n_block, seq.seqlen_q, seqlen_k)
        if const_expr(self.problem.packed):
            # A block number left over (or past seqused_k) walks no query block: it still
            # counts itself for the postprocess, and stores nothing (see epilogue).
            has_keys = self.sequences.has_keys(n_block, self.block_n, seq)
            m_block_max = m_block_max if has_keys else m_block_min
        group = self.heads.group_size(gmem.q.shape[2], gmem.k.shape[2])
        work = KeyBlockWork(n_block, head, batch, m_block_min, m_block_max, group, seq)

        # Units of the prepare-ahead's launch order: the grid's heads (key/value heads).
        num_heads = gmem.k.shape[2] if const_expr(self.heads.grouped) else gmem.q.shape[2]
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(gmem, smem, atoms, pipes, work, num_heads, prep_ahead, prepared_count)
            if const_expr(self.with_dq):
                if warp_idx == 1:
                    if const_expr(self.fused_preprocess):
                        if m_block_max > m_block_min:
                            # The first bulk addition into dq_accum comes after it was zeroed.
                            self.wait_prepared(gmem.prepared, head, batch, num_heads, prep_ahead, prepared_count)
                    self.write_dq(gmem.dq_accum, sdQ, work, num_n_blocks, gmem.dq_semaphore, gmem.dq_done,
                                  seq.seqlen_q, seqlen_k, gmem.dq_target, sFinished)
            # (A one-launch kernel prepares only its own heads, in its consumers: prepare_own_rows.)
            if const_expr(self.fused_preprocess and not self.fused_postprocess):
                if warp_idx >= PREP_WARPS[0]:
                    self.prepare_ahead(
                        gmem.o, gmem.do_rows, gmem.lse_natural, gmem.lse_rows, gmem.delta_rows, gmem.dq_accum,
                        gmem.prepared, n_block, head, batch, prep_ahead, prep_ctas,
                        cute.arch.thread_idx()[0] - 32 * PREP_WARPS[0], num_heads, group,
                    )
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            tidx, _, _ = cute.arch.thread_idx()
            if const_expr(self.fused_postprocess):
                self.prepare_own_rows(gmem.o, gmem.do_rows, gmem.lse_natural, gmem.lse_rows, gmem.delta_rows,
                                      gmem.dq_accum, gmem.prepared, n_block, head, batch, prep_ahead, prep_ctas,
                                      tidx - THREADS_PER_WARPGROUP, group)
            self.consume(mmas, gmem, smem, atoms, pipes, tidx - THREADS_PER_WARPGROUP,
                         scale_log2, softmax_scale, work, seqlen_k)

    @cute.jit
    def _dq_turn(self, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k):
        """Deterministic mode: how many key blocks add their dQ for m_block before n_block.

        The key blocks that see query block m are a contiguous range (block_ranges). Not
        causal: in increasing n, turn = n minus the range's first. Causal: in decreasing n,
        turn = last(m) - n: each CTA starts on the diagonal with turn 0 and then meets the
        query blocks that the next-higher key block has just finished, so the CTAs pipeline
        instead of waiting for the longest one (and blockIdx.x is reversed so that the CTAs
        waited for are launched first)."""
        return self.ranges.key_turn(n_block, m_block, num_n_blocks, seqlen_q, seqlen_k, self.problem.causal)

    @cute.jit
    def produce(self, gmem: BackwardTensors, smem: BackwardSmem, atoms: BackwardTmaAtoms, pipes: BackwardPipes,
                work: KeyBlockWork, num_heads, prep_ahead, prepared_count):
        mK, mV = gmem.k, gmem.v
        sK, sV = smem.k, smem.v
        tma_atom_k, tma_atom_v = atoms.k, atoms.v
        k_pipe, v_pipe = pipes.k, pipes.v
        n_block, head, m_block_min, m_block_max = work.n_block, work.head, work.m_block_min, work.m_block_max
        gK = cute.local_tile(self.sequences.rows(mK, head, work.seq, keys=True), (self.block_n, self.operand_cols),
                             (n_block, 0))
        gV = cute.local_tile(self.sequences.rows(mV, head, work.seq, keys=True), (self.block_n, self.value_cols),
                             (n_block, 0))
        tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages_do)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)

        # K and V are loaded even by a CTA with no query block (causal, Sq < Sk), which keeps
        # the consumers' waits unconditional; such a CTA writes zero dK and dV.
        # Issue order follows first use: K and Q for S, then V and dO for dP.
        k_pipe.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK, tKsK, tma_bar_ptr=k_pipe.producer_get_barrier(kv_state))
        load_query_head = partial(
            self._produce_query_head, gmem=gmem, smem=smem, atoms=atoms, pipes=pipes, work=work, kv_state=kv_state,
            tVsV=tVsV, tVgV=tVgV, num_heads=num_heads, prep_ahead=prep_ahead, prepared_count=prepared_count,
        )
        if const_expr(self.heads.grouped):
            for g in cutlass.range(work.group, unroll=1):
                q_state, do_state = load_query_head(head * work.group + g, g == 0, q_state, do_state)
        else:
            q_state, do_state = load_query_head(head, True, q_state, do_state)
        if m_block_max == m_block_min:
            v_pipe.producer_acquire(kv_state)
            cute.copy(tma_atom_v, tVgV, tVsV, tma_bar_ptr=v_pipe.producer_get_barrier(kv_state))

    @cute.jit
    def _produce_query_head(self, q_head, first_head, q_state, do_state, gmem: BackwardTensors, smem: BackwardSmem,
                            atoms: BackwardTmaAtoms, pipes: BackwardPipes, work: KeyBlockWork, kv_state, tVsV, tVgV,
                            num_heads, prep_ahead, prepared_count):
        """Q with its LSE slice and dO with its delta slice, per query block of query head
        q_head; V after the CTA's first Q."""
        mQ, mdO, mLSE, mDelta = gmem.q, gmem.do, gmem.lse, gmem.delta
        sQ, sdO, sLSE, sDelta = smem.q, smem.do, smem.lse, smem.delta
        q_pipe, do_pipe, v_pipe = pipes.q, pipes.do, pipes.v
        head, batch, m_block_min, m_block_max = work.head, work.batch, work.m_block_min, work.m_block_max

        def partition(atom, s, g):
            return tma_tiles(atom, s, g, rank=cute.rank(g) - 1)  # the last mode of g indexes blocks

        seq = work.seq
        gQ = cute.local_tile(self.sequences.rows(mQ, q_head, seq), (self.block_m, self.operand_cols), (None, 0))
        gdO = cute.local_tile(self.sequences.rows(mdO, q_head, seq), (self.block_m, self.value_cols), (None, 0))
        gLSE = cute.local_tile(self.sequences.padded_stats(mLSE, q_head, seq), (self.block_m,), (None,))
        gDelta = cute.local_tile(self.sequences.padded_stats(mDelta, q_head, seq), (self.block_m,), (None,))
        tQsQ, tQgQ = partition(atoms.q, sQ, gQ)
        tdOsdO, tdOgdO = partition(atoms.do, sdO, gdO)
        tLsL, tLgL = partition(atoms.lse, sLSE, gLSE)
        tDsD, tDgD = partition(atoms.delta, sDelta, gDelta)
        tQtsQt, tQtgQt, tdOtsdOt, tdOtgdOt = None, None, None, None
        if const_expr(self.tf32):
            # Q^T / dO^T: (D, block_m) tiles along the queries (dense batches: rules.float32_problem).
            transposed_tile = (self.operand_cols, self.block_m)
            gQt = cute.local_tile(gmem.q_t[None, None, q_head, batch], transposed_tile, (0, None))
            gdOt = cute.local_tile(gmem.do_t[None, None, q_head, batch], transposed_tile, (0, None))
            tQtsQt, tQtgQt = partition(atoms.q_t, smem.q_t, gQt)
            tdOtsdOt, tdOtgdOt = partition(atoms.do_t, smem.do_t, gdOt)
        for i in cutlass.range(m_block_max - m_block_min, unroll=1):
            m_block = m_block_min + i
            q_pipe.producer_acquire(q_state)
            q_bar = q_pipe.producer_get_barrier(q_state)
            cute.copy(atoms.q, tQgQ[None, m_block], tQsQ[None, q_state.index], tma_bar_ptr=q_bar)
            if const_expr(not self.fused_preprocess):
                cute.copy(atoms.lse, tLgL[None, m_block], tLsL[None, q_state.index], tma_bar_ptr=q_bar)
            if i == 0:
                if first_head:
                    v_pipe.producer_acquire(kv_state)
                    cute.copy(atoms.v, tVgV, tVsV, tma_bar_ptr=v_pipe.producer_get_barrier(kv_state))
            do_pipe.producer_acquire(do_state)
            bar = do_pipe.producer_get_barrier(do_state)
            cute.copy(atoms.do, tdOgdO[None, m_block], tdOsdO[None, do_state.index], tma_bar_ptr=bar)
            if const_expr(self.fused_preprocess):
                # LSE and delta of a head prepared by an earlier CTA: wait for it once, after
                # the first Q, K, V and dO loads are on their way.
                if i == 0:
                    if first_head:  # a unit prepares every query head of a group at once
                        self.wait_prepared(gmem.prepared, head, batch, num_heads, prep_ahead, prepared_count)
                cute.copy(atoms.lse, tLgL[None, m_block], tLsL[None, q_state.index], tma_bar_ptr=q_bar)
            cute.copy(atoms.delta, tDgD[None, m_block], tDsD[None, do_state.index], tma_bar_ptr=bar)
            if const_expr(self.tf32):
                # Q^T and dO^T after Q and dO: their rings go back last (after dK / dV), and
                # they advance with Q's and dO's, whose states they share.
                pipes.q_t.producer_acquire(q_state)
                cute.copy(atoms.q_t, tQtgQt[None, m_block], tQtsQt[None, q_state.index],
                          tma_bar_ptr=pipes.q_t.producer_get_barrier(q_state))
                pipes.do_t.producer_acquire(do_state)
                cute.copy(atoms.do_t, tdOtgdOt[None, m_block], tdOtsdOt[None, do_state.index],
                          tma_bar_ptr=pipes.do_t.producer_get_barrier(do_state))
            q_state.advance()
            do_state.advance()
        return q_state, do_state

    @cute.jit
    def consume(self, mmas: BackwardMmas, gmem: BackwardTensors, smem: BackwardSmem, atoms: BackwardTmaAtoms,
                pipes: BackwardPipes, tidx, scale_log2, softmax_scale, work: KeyBlockWork, seqlen_k):
        """The consumer warpgroups: per query block
            S^T = K Q^T, dP^T = V dO^T        (each warpgroup: 64 key rows x block_m queries)
            P^T = exp2(S^T * scale*log2e - LSE[col]),  dS^T = P^T * (dP^T - delta[col])
            dV += P^T dO, dK += dS^T Q          (A operand = those registers, no smem trip)
            dQ_partial = dS K                   (dS^T stored transposed to smem: dQ needs all keys)
        so only dS goes through shared memory and one barrier per block remains (two with a
        single dS buffer). With grads_transposed the warpgroups split the keys instead
        (shared_p_step)."""
        tiled_mma_dkv, tiled_mma_dq = mmas.dkv, mmas.dq
        n_block, m_block_min, m_block_max = work.n_block, work.m_block_min, work.m_block_max
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        wg_sdp, wg_dkv = (warpgroup_slice(mma, wg_idx) for mma in mmas[:2])
        wg_dq = warpgroup_slice(tiled_mma_dq, wg_idx) if const_expr(not self.tf32) else None
        if const_expr(self.grads_transposed):
            operands = self._transposed_grads_operands(mmas, smem, tidx, wg_sdp, wg_dkv, wg_dq)
            dk_tile, dv_tile = (self.head_dim, self.block_n), (self.value_head_dim, self.block_n)
        else:
            operands = self._operands(mmas, smem, tidx, wg_sdp, wg_dkv, wg_dq)
            dk_tile, dv_tile = (self.block_n, self.dk_cols), (self.block_n, self.dv_cols)
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C(dv_tile), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C(dk_tile), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipes.k.consumer_wait(kv_state)
        pipes.v.consumer_wait(kv_state)
        if const_expr(self.problem.packed and not self.tf32):
            # Rows past the sequence's keys: another sequence's or a cache's free slots (NaN
            # possible); dP = dO V^T and dQ = dS K would carry them into the gradients.
            keys_in_block = seqlen_k - n_block * self.block_n
            if keys_in_block < self.block_n:
                zero_rows_past_keys(self.dtype, [smem.k, smem.v], keys_in_block, tidx, self.num_mma_threads,
                                    BackwardBarrier.STALE_KEYS)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages_do)
        seqlen_q = work.seq.seqlen_q
        num_masked, unmasked_end = self.ranges.masked_query_blocks(n_block, m_block_min, m_block_max, seqlen_q,
                                                                   seqlen_k)
        step_fn = self.shared_p_step if const_expr(self.p_in_smem) else self.step
        step = partial(step_fn, n_block=n_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, mmas=mmas, tidx=tidx,
                       operands=operands, acc_dV=acc_dV, acc_dK=acc_dK, smem=smem, pipes=pipes, scale_log2=scale_log2)
        if const_expr(self.heads.grouped):
            # One query head after the other; the items continue across them.
            for g in cutlass.range(work.group, unroll=1):
                q_state, do_state = self._consume_query_head(
                    g * (m_block_max - m_block_min), q_state, do_state,
                    self._with_operand_scales(step, gmem, work, work.head * work.group + g, scale_log2),
                    m_block_min, m_block_max, num_masked, unmasked_end)
        else:
            q_state, do_state = self._consume_query_head(
                0, q_state, do_state, self._with_operand_scales(step, gmem, work, work.head, scale_log2),
                m_block_min, m_block_max, num_masked, unmasked_end)

        self.epilogue(acc_dK, acc_dV, softmax_scale, tiled_mma_dkv, gmem, smem, atoms, work)
        if const_expr(self.fused_postprocess):
            self.convert_finished_heads(tiled_mma_dq, gmem, smem, work, softmax_scale)

    @cute.jit
    def convert_finished_heads(self, tiled_mma_dq, gmem: BackwardTensors, smem: BackwardSmem, work: KeyBlockWork,
                               softmax_scale):
        """fused_postprocess, the consumer warpgroups after the epilogue: dQ = dq_accum x
        softmax_scale for every query block of each query head whose count this CTA completed
        (the writer warp's bits in smem.finished): the postprocess's work, without its launch.
        The writer's atomic (acquire) and the DQ_CONVERT barrier order these loads after every
        CTA's sums; the writer's reductions no longer read sdQ, whose bytes hold each block."""
        cute.arch.barrier(barrier_id=BackwardBarrier.DQ_CONVERT,
                          number_of_threads=self.num_mma_threads + cute.arch.WARP_SIZE)
        finished = smem.finished[0]
        if finished != 0:
            tidx = thread_idx_x_uncached() - THREADS_PER_WARPGROUP
            sdQ = cute.make_tensor(cute.recast_ptr(smem.dq.iterator, dtype=self.dtype),
                                   self.dq_converter.smem_layout())
            store = self.dq_converter.store_copy()
            for g in cutlass.range(work.group, unroll=1):
                if ((finished >> g) & 1) != 0:
                    q_head = work.head * work.group + g if const_expr(self.heads.grouped) else work.head
                    self._convert_head(tiled_mma_dq, gmem, q_head, work, softmax_scale, store, sdQ, tidx)

    @cute.jit
    def _convert_head(self, tiled_mma_dq, gmem: BackwardTensors, q_head, work: KeyBlockWork, softmax_scale, store,
                      sdQ, tidx):
        tile = (self.block_m, self.head_dim)
        seqlen_q = work.seq.seqlen_q
        accum_rows = gmem.dq_accum[None, None, q_head, work.batch]
        dq_rows = gmem.dq[None, None, q_head, work.batch]
        for m_block in cutlass.range((seqlen_q + self.block_m - 1) // self.block_m, unroll=1):
            self.dq_converter.convert(cute.local_tile(accum_rows, tile, (m_block, 0)),
                                      cute.local_tile(dq_rows, tile, (m_block, 0)),
                                      seqlen_q - m_block * self.block_m, gmem.dq.shape[1], softmax_scale,
                                      tiled_mma_dq, self.dq_swap_ab, store, sdQ, tidx, BackwardBarrier.EPILOGUE)
            # Every thread has read sdQ before the next block writes it.
            cute.arch.barrier(barrier_id=BackwardBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)

    def _with_operand_scales(self, step, gmem: BackwardTensors, work: KeyBlockWork, q_head, scale_log2):
        """The step of query head q_head: with the scaled halves' operand scales of that head
        (the scores' joins their scale; dP's, dK's and dV's go to the step, dK's and dV's into
        each step's product as it is collected: the heads of a group have powers of their
        own), else the step as it is. Plain Python."""
        if const_expr(not self.scaled_halves):
            return step
        # (A packed batch's work.batch numbers its sequence; the tensors' batch index is 0.)
        scales = gmem.scales[work.seq.batch if const_expr(self.problem.packed) else work.batch, q_head, None]
        return partial(step, scale_log2=scale_log2 * scales[SCALE_SCORES],
                       halves_scales=(scales[SCALE_DP], scales[SCALE_DK], scales[SCALE_DV]))

    def _operands(self, mmas: BackwardMmas, smem: BackwardSmem, tidx, wg_sdp, wg_dkv, wg_dq) -> "StepOperands":
        """A consumer thread's fragments for step, and for shared_p_step with split_head_dim (S^T
        orientation)."""
        tiled_mma_sdp = mmas.sdp
        sQ, sdO, sK, sV, sdS = smem.q, smem.do, smem.k, smem.v, smem.ds
        tStrK, tStrQ = smem_operands(wg_sdp, sK, sQ)
        tdPtrV, tdPtrdO = smem_operands(wg_sdp, sV, sdO)
        tdVrdOt_lo, tdKrQt_lo = None, None
        if const_expr(self.split_operands):
            if const_expr(self.scaled_halves):
                # dO's and Q's column halves, each read MN-major as dV's / dK's B operand (the
                # 16-bit path's transposed views, per half).
                # (A gradient chunk's columns of them: grad_columns.)
                sdOt, sdOt_lo = column_halves_transposed(sdO, self.block_m, self.head_dim, self.grad_columns)
                sQt, sQt_lo = column_halves_transposed(sQ, self.block_m, self.head_dim, self.grad_columns)
            else:
                # Q^T's / dO^T's stages as (D, block_m) hi and lo halves.
                sdOt, sdOt_lo = row_halves(smem.do_t, self.head_dim, self.block_m)
                sQt, sQt_lo = row_halves(smem.q_t, self.head_dim, self.block_m)
            # (No dQ GEMM: the separate dQ kernel's.)
            tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt))
            tdVrdOt_lo = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt_lo))
            tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt))
            tdKrQt_lo = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt_lo))
            tdQrdS, tdQrKt = None, None
        elif const_expr(self.tf32):
            # Q^T / dO^T from their own copies (K-major); no dQ GEMM, no dS buffer.
            tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(smem.do_t))
            tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(smem.q_t))
            tdQrdS, tdQrKt = None, None
        else:
            tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sdO)))
            tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sQ)))
            if const_expr(self.dq_swap_ab):
                # dQ^T = K^T dS^T: K^T is the A operand, dS^T (= the dS buffer) the B operand.
                tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
                tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(transposed_view(sK)))
            else:
                tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
                tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transposed_view(sK)))

        # dS^T goes to shared memory as dS (keys contiguous, the K-major A operand of dQ):
        # transposing stmatrix into the transposed view of the dS buffer.
        thr_copy_ds, tdSsdS = None, None
        if const_expr(not self.tf32 and not self.scaled_halves):
            stmatrix_t = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
            thr_copy_ds = cute.make_tiled_copy_C(stmatrix_t, tiled_mma_sdp).get_slice(tidx)
            tdSsdS = thr_copy_ds.partition_D(transposed_view(sdS))
        tPsP, tdVsPt, tdKsdSt = None, None, None
        if const_expr(self.split_head_dim):
            # P^T goes where dS^T goes, in its own buffer; both are read back as dV's / dK's
            # A operand (keys x queries, keys contiguous: the transposed view of the buffers).
            tPsP = thr_copy_ds.partition_D(transposed_view(smem.p))
            tdVsPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed_view(smem.p)))
            tdKsdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed_view(sdS)))

        # Which queries (columns of S^T) this thread's fragment holds, for LSE / delta.
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        st_cols = acc_as_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((self.block_n, self.block_m))))

        return StepOperands(tStrK, tStrQ, tdPtrV, tdPtrdO, tdVrdOt, tdKrQt, tdQrdS, tdQrKt, thr_copy_ds, tdSsdS,
                            st_cols, tPsP, tdVsPt, tdKsdSt, tdVrdOt_lo, tdKrQt_lo)

    def _transposed_grads_operands(self, mmas: BackwardMmas, smem: BackwardSmem, tidx, wg_sdp, wg_dkv,
                                   wg_dq) -> "StepOperands":
        """A consumer thread's fragments for shared_p_step with grads_transposed: S = Q K^T and
        dP = dO V^T (A = Q / dO, B = K / V), P and dS stored as they are (queries as rows, keys
        contiguous) by stmatrix, read back as the MN-major B operands of dV^T += dO^T P and
        dK^T += Q^T dS and (dS, all keys) as the K-major A operand of dQ = dS K."""
        sQ, sdO, sK, sV, sdS = smem.q, smem.do, smem.k, smem.v, smem.ds
        tSrQ, tSrK = smem_operands(wg_sdp, sQ, sK)
        tdPrdO, tdPrV = smem_operands(wg_sdp, sdO, sV)
        tdVrdOt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed_view(sdO)))
        tdKrQt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed_view(sQ)))
        tdVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(smem.p)))
        tdKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed_view(sdS)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transposed_view(sK)))
        stmatrix = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_copy_ds = cute.make_tiled_copy_C(stmatrix, mmas.sdp).get_slice(tidx)
        # Which query (row of S) and key each accumulator value is, for LSE / delta.
        s_coords = acc_as_rows_cols(mmas.sdp.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.block_m, self.block_n))))
        return StepOperands(tSrK, tSrQ, tdPrV, tdPrdO, tdVrdOt, tdKrQt, tdQrdS, tdQrKt, thr_copy_ds,
                            thr_copy_ds.partition_D(sdS), s_coords, thr_copy_ds.partition_D(smem.p), tdVrP, tdKrdS)

    @cute.jit
    def _consume_query_head(self, item_base, q_state, do_state, step, m_block_min, m_block_max, num_masked,
                            unmasked_end):
        """The query blocks of one query head: those the band's right edge (or the key tail)
        crosses, the unmasked run, then those its left edge crosses."""
        for i in cutlass.range(num_masked, unroll=1):
            m_block = m_block_min + i
            q_state, do_state = step(m_block, m_block + item_base, q_state, do_state, True)
        for i in cutlass.range(num_masked, unmasked_end, unroll=1):
            m_block = m_block_min + i
            q_state, do_state = step(m_block, m_block + item_base, q_state, do_state, False)
        if const_expr(self.problem.left is not None):
            for i in cutlass.range(unmasked_end, m_block_max - m_block_min, unroll=1):
                m_block = m_block_min + i
                q_state, do_state = step(m_block, m_block + item_base, q_state, do_state, True)
        return q_state, do_state

    @cute.jit
    def step(
        self, m_block, item, q_state, do_state, masked: cutlass.Constexpr[bool], n_block, seqlen_q, seqlen_k,
        mmas: BackwardMmas, tidx, operands: StepOperands, acc_dV, acc_dK, smem: BackwardSmem,
        pipes: BackwardPipes, scale_log2, halves_scales=None,
    ):
        """One query block (see consume); `item` numbers it among the CTA's steps (KeyBlockWork).
        halves_scales: the scaled halves' (dP, dK, dV) powers of two (consume); else None."""
        dp_scale, dv_factor = (halves_scales[0], halves_scales[2]) if const_expr(self.scaled_halves) else (None, None)
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        tdVrdOt, tdKrQt, tdQrdS, tdQrKt, thr_copy_ds, tdSsdS = operands[4:10]
        sLSE, sDelta, sdQ = smem.lse, smem.delta, smem.dq
        q_pipe, do_pipe = pipes.q, pipes.do
        qi = q_state.index
        di = do_state.index
        pi = qi if const_expr(self.num_stages_pds > 1) else 0
        acc_shape_s = tiled_mma_sdp.get_slice(0).partition_shape_C((self.block_n, self.block_m))
        # P^T / dS^T registers double as the A operand: one 64-row tile per warpgroup, so the
        # accumulator and the operand fragment list the registers in the same order.
        assert cute.size(acc_shape_s, mode=[1]) == 1 and cute.size(acc_shape_s, mode=[2]) == 1
        thr0_dkv = tiled_mma_dkv.get_slice(0)
        shape_a_dkv = thr0_dkv.partition_shape_A((self.block_n, self.block_m))

        acc_s, acc_dp, lse_cols, p_scale_log2 = self._scores(
            m_block, q_state, do_state, masked, n_block, seqlen_q, seqlen_k, tiled_mma_sdp, tidx, operands, sLSE,
            pipes, scale_log2)
        p_rc = acc_as_rows_cols(acc_s)
        # The exp2s are meant to run while dP^T is on the tensor cores, but ptxas moves most
        # of them below the wait for dP^T (to interleave the MUFU ops with the dS math),
        # which leaves the tensor cores idle through both. A branch ends the basic block, and
        # ptxas keeps the block's instructions above the wait: 3 % faster non-causal
        # (perf/NOTES.md, tenth session). Always taken: the host launches with Sk >= 1.
        tdVrPt = thr0_dkv.make_fragment_A(shape_a_dkv)
        # Split operands: P^T's and dS^T's low TF32 parts.
        tdVrPt_lo = thr0_dkv.make_fragment_A(shape_a_dkv) if const_expr(self.split_operands) else None
        pinned = self.pinned_exp_columns
        if const_expr(self.exps_above_dp_wait and 0 < pinned < len(lse_cols) and not self.problem.softcap):
            # The first `pinned` columns in the dP^T GEMM's shadow, the rest left to ptxas.
            if seqlen_k > 0:  # always true (below)
                _probabilities(p_rc, p_rc, p_scale_log2, lse_cols, range(pinned))
            _probabilities(p_rc, p_rc, p_scale_log2, lse_cols, range(pinned, len(lse_cols)))
        elif const_expr(self.exps_above_dp_wait):
            if seqlen_k > 0:  # always true: the branch ends the basic block, so ptxas keeps the exp2s above dP^T's wait
                self._probabilities_t(p_rc, acc_s, p_scale_log2, lse_cols, tdVrPt, tdVrPt_lo)
        else:
            self._probabilities_t(p_rc, acc_s, p_scale_log2, lse_cols, tdVrPt, tdVrPt_lo)
        # Likewise delta, before the wait for dP^T (the registers of the LSE values are free).
        delta_cols = [sDelta[q, di] for q in self._query_coords(operands.st_cols)]
        if const_expr(self.dv_after_ds):
            warpgroup.wait_group(0)  # dP^T ready
        dv_part = None
        if const_expr(not self.dv_after_ds):
            if const_expr(not self.problem.softcap):
                self._operand_a(tdVrPt, acc_s, tdVrPt_lo)
            # dV += P^T dO goes to the tensor cores while dS is computed.
            if const_expr(self.tf32):
                pipes.do_t.consumer_wait(do_state)
            dv_part = self._dkv_gemm(tiled_mma_dkv, acc_dV, tdVrPt, tdVrPt_lo, tdVrdOt, operands.do_t_lo, di,
                                     1)  # dP^T ready
            if const_expr(self.tf32):
                do_pipe.consumer_release(do_state)  # dO (dP^T is done) and delta (read) go back

        _ds(acc_as_rows_cols(acc_dp), p_rc, delta_cols, dp_scale)
        if const_expr(self.dv_after_ds):
            # P^T in fp32 dies here: its 16-bit copy never coexists with S^T and dP^T.
            self._operand_a(tdVrPt, acc_s)
        tdKrdSt = thr0_dkv.make_fragment_A(shape_a_dkv)
        tdKrdSt_lo = thr0_dkv.make_fragment_A(shape_a_dkv) if const_expr(self.split_operands) else None
        ds_row_down = None
        if const_expr(self.scaled_halves):
            # dS^T spans P's range: a power of two per key row before the fp16 split; its
            # inverse scales that row of the step's dK product (_collect).
            ds_row_down = split_rows_scaled(tdKrdSt, tdKrdSt_lo, acc_dp)
            for r in cutlass.range_constexpr(cute.size(ds_row_down)):
                ds_row_down[r] = ds_row_down[r] * halves_scales[1]  # and Q's power of two
        else:
            self._operand_a(tdKrdSt, acc_dp, tdKrdSt_lo)
        if const_expr(self.with_dq):
            if const_expr(self.num_stages_pds == 1):
                # Single dS buffer: every warpgroup must be done with the previous block's dQ GEMM.
                cute.arch.barrier(barrier_id=BackwardBarrier.PDS, number_of_threads=self.num_mma_threads)
            r_ds = cute.make_tensor(tdKrdSt.iterator, acc_dp.layout)  # same registers, C layout
            cute.copy(thr_copy_ds, thr_copy_ds.retile(r_ds), tdSsdS[None, None, None, pi])
        if const_expr(self.dv_after_ds):
            wgmma(tiled_mma_dkv, acc_dV, tdVrPt, tdVrdOt[None, None, None, di], False, -1)
        if const_expr(self.with_dq):
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BackwardBarrier.PDS, number_of_threads=self.num_mma_threads)

            # dQ^T (D x block_m) = K^T dS^T with dq_swap_ab, else dQ (block_m x D) = dS K.
            if const_expr(self.dq_swap_ab):
                dq_tile, dq_a, dq_b = (self.head_dim, self.block_m), tdQrKt, tdQrdS[None, None, None, pi]
            else:
                dq_tile, dq_a, dq_b = (self.block_m, self.head_dim), tdQrdS[None, None, None, pi], tdQrKt
            acc_dq = cute.make_rmem_tensor(tiled_mma_dq.get_slice(0).partition_shape_C(dq_tile), Float32)
            # dv_after_ds: dV done before dK is issued, so P^T's registers are free again and
            # at most two GEMMs hold register operands at a time.
            wgmma(tiled_mma_dq, acc_dq, dq_a, dq_b, True, 1 if self.dv_after_ds else -1)
        release_do_early = self.dv_after_ds and self.with_dq
        if const_expr(release_do_early):
            do_pipe.consumer_release(do_state)  # dV, the last reader of dO, is done
        if const_expr(self.tf32):
            pipes.q_t.consumer_wait(q_state)
        if const_expr(self.products_in_turn):
            warpgroup.wait_group(0)  # dV's product done: its registers go to dK's
            self._collect(acc_dV, dv_part, factor=dv_factor)
            dv_part = None
        dk_part = self._dkv_gemm(tiled_mma_dkv, acc_dK, tdKrdSt, tdKrdSt_lo, tdKrQt, operands.q_t_lo, qi,
                                 1)  # dV (and dQ) done
        self._collect(acc_dV, dv_part, factor=dv_factor)
        if const_expr(self.tf32):
            pipes.do_t.consumer_release(do_state)  # dV, the reader of dO^T, is done
        elif const_expr(not release_do_early):
            do_pipe.consumer_release(do_state)
        if const_expr(self.with_dq):
            self._stage_dq(acc_dq, sdQ, item, tidx)

        warpgroup.wait_group(0)
        self._collect(acc_dK, dk_part, row_factors=ds_row_down)
        # (Float32: Q went back once S^T was done; Q^T's stage now that dK is.)
        (pipes.q_t if const_expr(self.tf32) else q_pipe).consumer_release(q_state)
        q_state.advance()
        do_state.advance()
        return q_state, do_state

    def _probabilities_t(self, p_rc, acc_s, p_scale_log2, lse_cols, tdVrPt, tdVrPt_lo):
        """P^T from S^T in place (p_rc: acc_s as rows and columns); with a softcap, P^T's 16-bit
        copy for dV first (tdVrPt), then P^T times the softcap's gradient factor in place (for
        dS: t dies here, score_transform). Plain Python, inlined where the step calls it."""
        if const_expr(self.problem.softcap):
            probs = cute.make_rmem_tensor_like(acc_s, Float32)
            probs_rc = acc_as_rows_cols(probs)
            _probabilities(probs_rc, p_rc, p_scale_log2, lse_cols)
            self._operand_a(tdVrPt, probs, tdVrPt_lo)
            self._softcap_gradient(p_rc, probs_rc)
        else:
            _probabilities(p_rc, p_rc, p_scale_log2, lse_cols)

    def _operand_a(self, fragment, acc, fragment_lo=None):
        """An S^T-shaped accumulator (P^T, dS^T) into dV's / dK's register A operand: in 16
        bits, or for float32 rounded to TF32 (the tensor cores would truncate) and in the
        TF32 A order (layouts.acc_as_tf32_operand_a), which Q^T / dO^T's permuted queries
        match; split operands: its high and low TF32 parts (fragment, fragment_lo). Plain
        Python, inlined where the step calls it."""
        if const_expr(self.scaled_halves):
            # P^T (at most 1) times P_SCALE as fp16 hi + lo, from a value: _ds reads P^T after.
            store_halves(fragment, fragment_lo, acc_as_operand_a(acc).load() * Float32(P_SCALE))
        elif const_expr(self.split_operands):
            store_tf32_split_operand_a(fragment, fragment_lo, acc)
        elif const_expr(self.tf32):
            store_tf32_operand_a(fragment, acc)
        else:
            fragment.store(acc_as_operand_a(acc).load().to(self.dtype))

    def _dkv_gemm(self, tiled_mma, acc, a, a_lo, b, b_lo, stage, wait_group: int):
        """dV += P^T dO or dK += dS^T Q (A from registers, B's stage `stage`), then wgmma's
        wait. Split operands: the step's product (3xTF32) goes into an accumulator of its own,
        returned for _collect to add once it is done: summed by the tensor cores over a long
        sequence's query blocks, dK and dV would lose low bits at every step (as the forward's
        O did: fwd_sm90's per-block P V). Otherwise None. Plain Python."""
        if const_expr(self.split_operands):
            part = cute.make_rmem_tensor_like(acc)
            products = split_products(a, b[None, None, None, stage], a_lo, b_lo[None, None, None, stage])
            wgmma_products(tiled_mma, part, products, True, wait_group)
            return part
        wgmma(tiled_mma, acc, a, b[None, None, None, stage], False, wait_group)
        return None

    def _collect(self, acc, part, row_factors=None, factor=None):
        """acc += part, a finished _dkv_gemm product of split operands (in float32, rounded to
        nearest); nothing otherwise. Scaled halves: part times its powers of two, dV's one
        `factor`, dK's a factor per row (dS^T's rows are dK's: the same M tiling). Plain Python."""
        if const_expr(part is None):
            return
        if const_expr(factor is not None):
            acc.store(acc.load() + part.load() * factor)
        elif const_expr(row_factors is not None):
            acc_rows, part_rows = acc_as_rows_cols(acc), acc_as_rows_cols(part)
            for r in range(cute.size(acc_rows, mode=[0])):
                acc_rows[r, None].store(acc_rows[r, None].load() + part_rows[r, None].load() * row_factors[r])
        else:
            acc.store(acc.load() + part.load())

    @cute.jit
    def _scores(self, m_block, q_state, do_state, masked: cutlass.Constexpr[bool], n_block, seqlen_q, seqlen_k,
                tiled_mma_sdp, tidx, operands: StepOperands, sLSE, pipes: BackwardPipes, scale_log2):
        """The start of a step: S^T = K Q^T and dP^T = V dO^T issued, this thread's LSE values
        read, and once S^T is done (dP^T may still run) the score transform and the mask.
        Returns S^T (transformed), dP^T (in flight), the LSE values and the exp2 scale."""
        qi = q_state.index
        di = do_state.index
        # grads_transposed: S (queries x keys) = Q K^T, else S^T (keys x queries) = K Q^T.
        s_tile = (self.block_m, self.block_n) if const_expr(self.grads_transposed) else (self.block_n, self.block_m)
        acc_shape_s = tiled_mma_sdp.get_slice(0).partition_shape_C(s_tile)
        pipes.q.consumer_wait(q_state)
        # This thread's LSE values (one per query: a column of S^T, a row of S), read before
        # S^T and dP^T are issued. Read after the wait for S^T, their shared-memory latency
        # would stall the exp2 that follows; read between the two GEMMs' issues (as before
        # 2026-11-28), they queued behind the GEMMs' operand traffic and came back after S^T
        # was done, and the exp2 waited for them (ncu: 10 % of the loop's samples on their
        # first use); where ptxas happened to wait for them before issuing dP^T (a constant
        # reloaded into their address register) that wait cost as much. Read first: the
        # backward 3 % faster on dense batches, 5-7 % on packed ones (perf/NOTES.md,
        # thirty-second session).
        lse_cols = [sLSE[q, qi] for q in self._query_coords(operands.st_cols)]
        acc_s = cute.make_rmem_tensor(acc_shape_s, Float32)
        if const_expr(self.grads_transposed):
            wgmma(tiled_mma_sdp, acc_s, operands.q[None, None, None, qi], operands.k, True, -1)
        else:
            wgmma_k_major(tiled_mma_sdp, acc_s, operands.k, operands.q[None, None, None, qi], self.split_operands,
                          -1)
        pipes.do.consumer_wait(do_state)
        acc_dp = cute.make_rmem_tensor(acc_shape_s, Float32)
        if const_expr(self.grads_transposed):
            wgmma(tiled_mma_sdp, acc_dp, operands.do[None, None, None, di], operands.v, True, 1)
        else:
            wgmma_k_major(tiled_mma_sdp, acc_dp, operands.v, operands.do[None, None, None, di], self.split_operands,
                          1)
        if const_expr(self.tf32):
            # S^T is done and the LSE values read: Q's stage goes back (Q^T has a ring of its own).
            pipes.q.consumer_release(q_state)

        # S^T is ready (dP^T may still run). P^T = exp2(S^T * scale*log2e - LSE*log2e[query]).
        self.scores.transform(acc_s, scale_log2)
        if const_expr(masked):
            mask_scores(acc_s, tiled_mma_sdp, tidx, m_block, n_block, seqlen_k, self.block_m, self.block_n,
                        self.problem, transposed=not self.grads_transposed, seqlen_q=seqlen_q)
        return acc_s, acc_dp, lse_cols, self.scores.softmax_scale_log2(scale_log2)

    def _query_coords(self, coords_rc):
        """The query of each LSE / delta value a thread reads, from its (rows, cols) coordinate
        view of S^T (a column's query) or, with grads_transposed, of S (a row's). Plain Python."""
        if const_expr(self.grads_transposed):
            return [coords_rc[r, 0][0] for r in range(cute.size(coords_rc, mode=[0]))]
        return [coords_rc[0, c][1] for c in range(cute.size(coords_rc, mode=[1]))]

    def _softcap_gradient(self, p_rc, probs_rc):
        """P^T times the softcap's gradient factor, into the transformed scores' registers
        (p_rc: t in, P^T (1 - t^2) out; score_transform). Plain Python, unrolled."""
        for c in range(cute.size(p_rc, mode=[1])):
            for r in range(cute.size(p_rc, mode=[0])):
                p_rc[r, c] = probs_rc[r, c] * self.scores.grad(p_rc[r, c])

    @cute.jit
    def shared_p_step(
        self, m_block, item, q_state, do_state, masked: cutlass.Constexpr[bool], n_block, seqlen_q, seqlen_k,
        mmas: BackwardMmas, tidx, operands: StepOperands, acc_dV, acc_dK, smem: BackwardSmem,
        pipes: BackwardPipes, scale_log2,
    ):
        """step with P through shared memory (p_in_smem), all GEMM operands there:
        * split_head_dim: S^T and dP^T as in step (each warpgroup block_m / nwg of the queries),
          P^T and dS^T stored, then dV += P^T dO and dK += dS^T Q (each warpgroup D / nwg
          columns);
        * grads_transposed: S = Q K^T and dP = dO V^T (the queries as rows, each warpgroup
          block_n / nwg of the keys), P and dS stored, then dV^T += dO^T P and dK^T += Q^T dS
          (each warpgroup its own keys, all D rows);
        then dQ = dS K (each warpgroup D / nwg columns, all keys)."""
        tiled_mma_sdp = mmas.sdp
        sLSE, sDelta, sdQ = smem.lse, smem.delta, smem.dq
        qi = q_state.index
        di = do_state.index
        pi = qi if const_expr(self.num_stages_pds > 1) else 0

        acc_s, acc_dp, lse_q, p_scale_log2 = self._scores(
            m_block, q_state, do_state, masked, n_block, seqlen_q, seqlen_k, tiled_mma_sdp, tidx, operands, sLSE,
            pipes, scale_log2)
        s_q = self._queries_as_cols(acc_s)
        # P in fp32: in place, or beside the scores with a softcap (whose gradient factor needs them).
        probs = cute.make_rmem_tensor_like(acc_s, Float32) if const_expr(self.problem.softcap) else acc_s
        probs_q = self._queries_as_cols(probs)
        _probabilities(probs_q, s_q, p_scale_log2, lse_q)
        r_p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        r_p.store(probs.load().to(self.dtype))
        if const_expr(self.problem.softcap):
            self._softcap_gradient(s_q, probs_q)
        delta_q = [sDelta[q, di] for q in self._query_coords(operands.st_cols)]
        warpgroup.wait_group(0)  # dP ready
        _ds(self._queries_as_cols(acc_dp), s_q, delta_q)
        r_ds = cute.make_rmem_tensor_like(acc_dp, self.dtype)
        r_ds.store(acc_dp.load().to(self.dtype))
        if const_expr(self.num_stages_pds == 1):
            # Single P / dS buffers: every warpgroup's GEMMs of the previous step that read them
            # (dV, dK, and dQ, which reads all of dS) have completed.
            cute.arch.barrier(barrier_id=BackwardBarrier.PDS, number_of_threads=self.num_mma_threads)
        thr_copy = operands.ds_copy
        cute.copy(thr_copy, thr_copy.retile(r_p), operands.p_smem[None, None, None, pi])
        cute.copy(thr_copy, thr_copy.retile(r_ds), operands.ds_smem[None, None, None, pi])
        cute.arch.fence_view_async_shared()
        # dV / dK read what other warpgroups stored (split_head_dim: every warpgroup's queries;
        # grads_transposed: the warpgroup's keys of every query row, all four warps' stores),
        # dQ every warpgroup's keys: one barrier of all consumers.
        cute.arch.barrier(barrier_id=BackwardBarrier.PDS, number_of_threads=self.num_mma_threads)

        # Each operand is sliced right before its GEMM (slicing all four first reorders the
        # descriptor arithmetic in the SASS).
        if const_expr(self.grads_transposed):
            # dV^T += dO^T P and dK^T += Q^T dS: M = D, the warpgroup's keys as N.
            wgmma(mmas.dkv, acc_dV, operands.do_t[None, None, None, di], operands.pt[None, None, None, pi], False, -1)
            wgmma(mmas.dkv, acc_dK, operands.q_t[None, None, None, qi], operands.dst[None, None, None, pi], False, -1)
        else:
            # dV += P^T dO and dK += dS^T Q: each warpgroup D / nwg columns.
            wgmma(mmas.dkv, acc_dV, operands.pt[None, None, None, pi], operands.do_t[None, None, None, di], False, -1)
            wgmma(mmas.dkv, acc_dK, operands.dst[None, None, None, pi], operands.q_t[None, None, None, qi], False, -1)
        acc_dq = None
        if const_expr(self.with_dq):
            acc_dq = cute.make_rmem_tensor(
                mmas.dq.get_slice(0).partition_shape_C((self.block_m, self.head_dim)), Float32)
            wgmma(mmas.dq, acc_dq, operands.ds[None, None, None, pi], operands.k_t, True, 1)  # dV, dK done
        else:
            warpgroup.wait_group(0)
        pipes.do.consumer_release(do_state)
        pipes.q.consumer_release(q_state)
        if const_expr(self.with_dq):
            warpgroup.wait_group(0)
            self._stage_dq(acc_dq, sdQ, item, tidx)
        q_state.advance()
        do_state.advance()
        return q_state, do_state

    def _queries_as_cols(self, acc: cute.Tensor) -> cute.Tensor:
        """A step accumulator's (rows, cols) view with the queries as columns, as _probabilities
        and _ds index them (one LSE / delta per column): S^T's own view, S's with its modes
        swapped (grads_transposed). Plain Python."""
        if const_expr(self.grads_transposed):
            return _rows_as_cols(acc_as_rows_cols(acc))
        return acc_as_rows_cols(acc)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, softmax_scale, tiled_mma_dkv, gmem: BackwardTensors, smem: BackwardSmem,
                 atoms: BackwardTmaAtoms, work: KeyBlockWork):
        mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv = gmem.dk, gmem.dv, smem.k, smem.v, atoms.dk, atoms.dv
        if const_expr(self.split_operands):
            sK, sV = smem.dk, smem.dv  # D-wide views of the (2D-wide) K and V buffers
        n_block, head = work.n_block, work.head
        r_dv = cute.make_rmem_tensor_like(acc_dV, self.out_dtype)
        r_dv.store(acc_dV.load().to(self.out_dtype))
        r_dk = cute.make_rmem_tensor_like(acc_dK, self.out_dtype)
        r_dk.store((acc_dK.load() * softmax_scale).to(self.out_dtype))
        # Every warpgroup's last GEMM reading K and V has completed (each waited for its own).
        cute.arch.barrier(barrier_id=BackwardBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        # The thread index is read again here: derived from the loop's copy, its shared-memory
        # offsets stayed live across the whole main loop and spilled (bf16 causal, 128-row step).
        tidx = thread_idx_x_uncached() - THREADS_PER_WARPGROUP
        if const_expr(self.grads_transposed):
            # dK^T / dV^T (D x keys) into the (keys, D) buffers: transposing stmatrix.
            stmatrix_t = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
            thr_copy = cute.make_tiled_copy_C(stmatrix_t, tiled_mma_dkv).get_slice(tidx)
            cute.copy(thr_copy, thr_copy.retile(r_dv), thr_copy.partition_D(transposed_view(sV)))
            cute.copy(thr_copy, thr_copy.retile(r_dk), thr_copy.partition_D(transposed_view(sK)))
        else:
            thr_copy = cute.make_tiled_copy_C(accumulator_store_atom(self.out_dtype), tiled_mma_dkv).get_slice(tidx)
            cute.copy(thr_copy, thr_copy.retile(r_dv), thr_copy.partition_D(sV))
            cute.copy(thr_copy, thr_copy.retile(r_dk), thr_copy.partition_D(sK))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BackwardBarrier.EPILOGUE, number_of_threads=self.num_mma_threads)
        tile = (self.block_n, self.dk_cols)
        value_tile = (self.block_n, self.dv_cols)
        if const_expr(self.problem.packed):
            # The rows past the sequence's keys are the next sequence's: per-row predicated
            # 16-byte stores by every consumer thread, none by a key block past the end.
            key_rows = work.seq.seqlen_k - n_block * self.block_n
            key_rows = key_rows if self.sequences.has_keys(n_block, self.block_n, work.seq) else 0
            gdK = cute.local_tile(self.sequences.rows(mdK, head, work.seq, keys=True), tile, (n_block, 0))
            gdV = cute.local_tile(self.sequences.rows(mdV, head, work.seq, keys=True), value_tile, (n_block, 0))
            if const_expr(self.dv_cols != self.dk_cols):
                # A value tile of its own: each gradient's rows in stores of its width.
                store_rows_clipped(self.out_dtype, sK, gdK, tidx, self.num_mma_threads, key_rows, mdK.shape[1],
                                   GRAD_VALUES)
                store_rows_clipped(self.out_dtype, sV, gdV, tidx, self.num_mma_threads, key_rows, mdV.shape[1],
                                   GRAD_VALUES)
            else:
                # Passes that tile the block's rows (layouts.store_rows_clipped: a pass past them
                # stores into the next block's rows).
                threads, store = row_copy(self.out_dtype, self.num_mma_threads, self.dk_cols, GRAD_VALUES,
                                          self.block_n)
                if tidx < threads:
                    thr_store = store.get_slice(tidx)
                    coords = thr_store.partition_S(cute.make_identity_tensor(tile))
                    dk_copy = (thr_store.partition_S(sK), thr_store.partition_D(gdK))
                    dv_copy = (thr_store.partition_S(sV), thr_store.partition_D(gdV))
                    # Each gradient's columns (static): v's head dim may differ from q's and k's.
                    if const_expr(mdK.shape[1] == mdV.shape[1]):
                        copy_clipped_rows(store, [dk_copy, dv_copy], coords, key_rows, mdK.shape[1], self.dk_cols)
                    else:
                        copy_clipped_rows(store, [dk_copy], coords, key_rows, mdK.shape[1], self.dk_cols)
                        copy_clipped_rows(store, [dv_copy], coords, key_rows, mdV.shape[1], self.dk_cols)
        else:
            if tidx < cute.arch.WARP_SIZE:
                gdK = cute.local_tile(mdK[None, None, head, work.batch], tile, (n_block, 0))
                gdV = cute.local_tile(mdV[None, None, head, work.batch], value_tile, (n_block, 0))
                tKsK, tKgK = tma_tiles(tma_atom_dk, sK, gdK)
                tVsV, tVgV = tma_tiles(tma_atom_dv, sV, gdV)
                cute.copy(tma_atom_dv, tVsV, tVgV)
                cute.copy(tma_atom_dk, tKsK, tKgK)
                cute.arch.cp_async_bulk_commit_group()
                # The CTA's shared memory must outlive the bulk stores' reads of it.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
