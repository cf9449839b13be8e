"""Launching the Hopper backward kernels on torch tensors (the backward op's implementation).

The tile config comes from the YAML file (direction `bwd`), like the forward's; direction
`bwd_dq` says from which Sq the dQ comes from its own kernel (no fp32 accumulator). Under
torch.use_deterministic_algorithms(True) the deterministic variant runs: dQ's partial sums
are added in a fixed key-block order (bitwise reproducible; +5 % backward time on the large
shape, perf/NOTES.md).

`backward` records what it decides from a call's signature as a BackwardPlan (plan cache,
like the forward's in cute_flash.api); `backward_with_config` plans a given config uncached.
A plan's run allocates the fp32 work buffers (LSE * log2(e), delta and the dQ
accumulator, all padded to a multiple of 128 query rows) and runs the kernels that
cute_flash.compile_bwd compiled:
    preprocess: delta = rowsum(dO * O), lse_log2, dq_accum = 0 (with a fused_preprocess
                config only for the first heads, see prepare_ahead_plan), dq_done = 0
    main:       dK, dV, dq_accum += dS K (a writer warp's bulk reduce-adds); each CTA
                counts itself in dq_done[b, h] when done; with fused_preprocess also the
                preprocess of the other heads
    postprocess: dQ = dq_accum * softmax_scale (it starts while the main kernel's last CTAs
                run and waits per (b, h) on dq_done)
A grid run as one launch (config.runs_as_one_launch: one wave, or a few of short heads) skips
the preprocess: its main kernel prepares every head itself (a fused_preprocess config,
one_launch_config; bwd_prepare_ahead with prep_ahead 0) on a kept set whose counts are never
zeroed but counted on (work_buffers.counted_work_set), so a small backward is two launches, not three (each costs
the host ~7-10 us; perf/NOTES.md, sixtieth and sixty-first sessions); and where a group's
dq_accum is small (IN_KERNEL_DQ_BYTES) one: each head's last main CTA converts its dQ
(fused_postprocess, BackwardPlan.converts_dq), no postprocess is launched.
With a config whose `deterministic` is true it also allocates a zeroed int32 semaphore per
(batch, head, query block), which orders the main kernel's dQ additions (bitwise
reproducible dQ); otherwise the main kernel gets a 1-element dummy it never reads.

When a SeparateDqConfig applies (long sequences, see cute_flash.config) there is no dQ
accumulator at all:
    preprocess: delta, lse_log2 (nothing zeroed)
    main:       dK, dV only
    dq kernel:  dQ (bwd_dq_sm90: one CTA per query block, dQ in registers, written once)
and the work buffers are O(B N Sq) floats instead of O(B N Sq D).

float32 inputs always take that path, on TF32 in one pass or three as torch's float32 matmul
precision says (cute_flash.float32: "float32" or "float32x3" entries): their bwd entries are
the dK/dV kernel's and their bwd_dq entries apply from Sq = 1; one pass before the kernels
makes the operand copies they read (q, k, v, dO rounded or split; Q^T, K^T, dO^T permuted).
"""

import dataclasses

import torch

from cute_flash import compile_bwd, float32
from cute_flash.config import get_config, one_launch_config, runs_as_one_launch, tile_head_dims
from cute_flash.head_dims import require_row_aligned
from cute_flash.kernels import rules
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.seqlen_pad import packed_padded_rows, packed_region_start, padded_seqlen_q
from cute_flash.torch_helpers import (
    TORCH_DTYPE_NAMES,
    batch_of_one,
    cached_plan,
    call_on_device,
    current_device_index as _current_device,
    device_scope,
    device_traits,
    tma_compatible,
    tma_operands,
)
from cute_flash.work_buffers import counted_work_set, work_set

# A one-launch grid's main kernel converts dQ itself (no postprocess launch) where one CTA's
# share, a whole group's dq_accum, is at most this many bytes: the head's last CTA converts it
# alone after its own epilogue, where the postprocess spreads it over a CTA per query block.
# Measured (perf/NOTES.md, sixty-second session): 5-11 us less host time per small backward; at
# 256 KiB ((1, 16, 1024, 64)) the GPU level or faster, at 512 KiB ((1, 16, 1024, 128)) the
# backward alone ~4 us slower on the GPU (its forward + backward still ~5 us faster).
IN_KERNEL_DQ_BYTES = 256 * 2**10
# Query heads per key/value head whose completion fits the writer warp's bit mask.
IN_KERNEL_DQ_MAX_GROUP = 32

# fused_preprocess: heads prepared by the preprocess kernel are those whose CTAs the grid
# launches within about this many waves of SMs from the start; each later head is prepared by
# the CTAs of the head this many waves before it (bwd_prepare_ahead), long before it runs.
PREP_AHEAD_WAVES = 2


def new_gradients(q, k, v):
    """The (dq, dk, dv) tensors the backward returns: contiguous, whatever the inputs' layout.
    The op's fake implementation allocates through this too: torch.compile checks the real
    outputs' strides against the fake ones (a (B, S, N, D) input viewed as (B, N, S, D) gets a
    contiguous (B, N, S, D) gradient from both)."""
    # (empty_like: a few us cheaper per tensor than torch.empty with a shape, dtype and device.)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


_plans = {}
_MAX_PLANS = 4096  # as the forward's plan cache (cute_flash.api): bounded for ever-changing shapes


def backward(q, k, v, out, dout, lse, problem: AttentionProblem, softmax_scale: float, dlse=None, grads=None,
             overlap_postprocess: bool = True, deterministic: bool = False, delta_out: list | None = None,
             plans: dict | None = None):
    """(dq, dk, dv) for the upstream gradients dout of O and, optionally, dlse of the LSE,
    with the configs the YAML file selects for this call. deterministic (or
    torch.use_deterministic_algorithms(True)): the bitwise reproducible variant. delta_out:
    see backward_with_config (backward_with_sink reads it for the sink's gradient).

    `grads` may supply the output tensors (dq, dk, dv), e.g. poisoned ones in tests; by
    default they come from new_gradients. overlap_postprocess=False: see backward_with_config.

    Everything the launch decides from the call's signature (configs, kernels, buffer shapes,
    the prepare-ahead plan, which operands TMA must get copies of) is recorded as a
    BackwardPlan on the signature's first call: the host path of a small backward costs about
    as much as its kernels (perf/NOTES.md, twenty-fourth session).

    `plans`: a dict kept with the forward's plan (cute_flash.api), which fixed everything about
    q, k, v, out and the LSE: the plans found there are keyed by what is left (dO's strides and
    alignment, the call's switches), a shorter key than the signature.
    """
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if plans is None:
        plan = _planned(q, k, v, out, dout, lse, problem, dlse, overlap_postprocess, deterministic)
    else:
        short_key = (dout.stride(), dout.data_ptr() & 15, dlse is None, overlap_postprocess, deterministic,
                     _current_device())
        if q.dtype == torch.float32:
            short_key += (torch.get_float32_matmul_precision(),)
        plan = plans.get(short_key)
        if plan is None:
            plan = _planned(q, k, v, out, dout, lse, problem, dlse, overlap_postprocess, deterministic)
            if len(plans) >= _MAX_FORWARD_BACKWARD_PLANS:
                plans.clear()
            plans[short_key] = plan
    return plan.run(q, k, v, out, dout, lse, softmax_scale, dlse, grads, delta_out)


# Backward plans kept per forward plan (backward's `plans`): dO layouts seen with one forward.
_MAX_FORWARD_BACKWARD_PLANS = 16


def _planned(q, k, v, out, dout, lse, problem, dlse, overlap_postprocess, deterministic) -> "BackwardPlan":
    """The BackwardPlan of this signature, from the plan cache or made."""
    key = _signature(q, k, v, out, dout, lse, problem, dlse, overlap_postprocess, deterministic)

    def make():
        dtype_name = kernel_dtype_name(q.dtype, max(q.shape[-1], v.shape[-1]))
        seqlens = (q.shape[2], k.shape[2])
        tile, value_tile, config = _tile_and_config(dtype_name, q.shape[-1], v.shape[-1], problem, seqlens,
                                                    q.device, deterministic)
        config = one_launch_config(config, dtype_name, problem, tile, q.shape[-1], v.shape[-1], q.shape[0] * k.shape[1],
                                   -(-k.shape[2] // config.block_n), device_traits(q.device)[1])
        # A file without a bwd_dq entry never uses the separate dQ kernel; float32 always does.
        dq_config = get_config(dtype_name, tile, problem.causal, "bwd_dq", q.device,
                               required=dtype_name in rules.FLOAT32_INPUTS,
                               seqlens=seqlens)
        return plan_backward(q, k, v, out, dout, lse, problem, config, dlse, dq_config, overlap_postprocess,
                             tile_head_dim=tile, value_tile_head_dim=value_tile)

    return cached_plan(_plans, key, make, _MAX_PLANS)


def _signature(q, k, v, out, dout, lse, problem, dlse, overlap_postprocess, deterministic) -> tuple:
    """What a BackwardPlan depends on, cheap to build: the key of the backward's plan cache.
    Each operand's pointer alignment is its own entry (the plan says which operands TMA
    needs copies of); float32's kernels follow torch's matmul precision, global state read
    per call."""
    key = (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), dout.stride(), lse.stride(),
        q.dtype, q.device, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, out.data_ptr() & 15,
        dout.data_ptr() & 15, problem, dlse is None, overlap_postprocess, deterministic, _current_device(),
    )
    if q.dtype == torch.float32:
        key += (torch.get_float32_matmul_precision(),)
    return key


def kernel_dtype_name(dtype: torch.dtype, head_dim: int) -> str:
    """The backward kernels' dtype name (and YAML entries' dtype) for inputs of `dtype`:
    float32's follows torch's float32 matmul precision now (cute_flash.float32)."""
    if dtype == torch.float32:
        return float32.backward_dtype_name(head_dim)
    return TORCH_DTYPE_NAMES[dtype]


def _tile_and_config(dtype_name: str, head_dim: int, value_head_dim: int, problem: AttentionProblem, seqlens,
                     device, deterministic: bool) -> tuple:
    """(native tile, value tile, backward config) for head dims (head_dim, value_head_dim): the
    pair of tiles that serves both (cute_flash.head_dims: a bwd entry with a value tile of its
    own, as DeepSeek's (192, 128), or a square tile), its YAML bwd entry for seqlens = (Sq,
    Sk), and the variants the host derives (derived_config; deterministic also under
    torch.use_deterministic_algorithms(True))."""
    require_row_aligned(head_dim, "backward kernels")
    require_row_aligned(value_head_dim, "backward kernels")
    tile, value_tile = tile_head_dims(dtype_name, head_dim, value_head_dim, "bwd", device)
    config = get_config(dtype_name, tile, problem.causal, "bwd", device, seqlens=seqlens, value_head_dim=value_tile)
    config = derived_config(config, dtype_name, problem, tile, head_dim,
                            deterministic or torch.are_deterministic_algorithms_enabled(), value_head_dim)
    return tile, value_tile, config


def backward_with_sink(q, k, v, out, dout, lse, problem: AttentionProblem, softmax_scale: float, sink, dlse=None,
                       deterministic: bool = False, plans: dict | None = None):
    """(dq, dk, dv, dsink): `backward`, plus the gradient of the (N,) sink logits when `sink`
    is a tensor (None otherwise). d loss / d sink_h = -sum over the rows of head h of
    P_sink * (delta - dlse), P_sink = exp(sink_h - LSE): delta as the kernels used it.
    plans: see backward."""
    # Only the sink's gradient reads delta (asking for it keeps the call from reusing work
    # buffers, cute_flash.work_buffers).
    delta = [] if sink is not None else None
    dq, dk, dv = backward(q, k, v, out, dout, lse, problem, softmax_scale, dlse=dlse, deterministic=deterministic,
                          delta_out=delta, plans=plans)
    dsink = None
    if sink is not None:
        rows = delta[0][:, :, : q.shape[2]]
        dsink = -(torch.exp(sink.view(1, -1, 1) - lse) * rows).sum(dim=(0, 2))
    return dq, dk, dv, dsink


# (head, batch) pairs per section of a grouped causal backward grid (derived_config): 2, 4 and
# 16 measured level with each other, all 1.04-1.11x over per-pair order (fortieth session).
GROUPED_SECTION_PAIRS = 4


def derived_config(config, dtype_name: str, problem: AttentionProblem, tile: int, head_dim: int,
                   deterministic: bool, value_head_dim: int | None = None):
    """The backward config that runs `problem`, from the YAML entry of its (dtype, tile,
    causal): the variants the host derives rather than the YAML lists (precompiling callers
    build the same). value_head_dim: v's (default head_dim)."""
    if deterministic and not config.deterministic:
        config = dataclasses.replace(config, deterministic=True)
    if (tile != head_dim or (value_head_dim or head_dim) != head_dim or problem.packed) and config.fused_preprocess:
        # The main kernel's preparing warps read O and dO rows of the tile's width, a dense
        # (batch, head)'s rows as one range.
        config = dataclasses.replace(config, fused_preprocess=False)
    if problem.softcap and dtype_name in rules.DTYPES:
        # The softcap's step holds P^T's 16-bit copy beside S^T and dP^T: the 64-query step
        # without the dQ swap fits 240 registers where the 80- and 128-row ones spill (SASS),
        # at the head dims that allow it (not 16: its dQ GEMM cannot split over two warpgroups).
        # Its exp2s stay pinned above dP^T's wait, all of them: 1.5 % faster than unpinned at
        # bf16 D = 64 softcap 50 (perf/NOTES.md, fortieth session); the pinned block also holds
        # P^T's 16-bit copy and the softcap's factor, which pinned_exp_columns does not split.
        lean = dataclasses.replace(config, block_m=64, dq_atom_m=1, dq_swap_ab=False, dv_after_ds=False,
                                   dq_stages=1, fused_preprocess=False, exps_above_dp_wait=True,
                                   pinned_exp_columns=0)
        if problem.grouped and tile >= 128 and not (lean.grads_transposed or lean.split_head_dim):
            # With GQA the CTA walks its group's query heads; from D = 128 (dK and dV alone take
            # 128 of the 240 registers) that loop's state did not fit beside the softcap's step:
            # 18-46 spilled registers and serialised WGMMAs (SASS). dK^T and dV^T
            # (grads_transposed: P and dS go through shared memory) fit, and ran 14-15 % faster
            # (bf16 (2, 32 / 16, 8192, 128) causal softcap 50, with and without a 4096 window;
            # perf/NOTES.md, thirty-eighth session). Without GQA the register step stays: there
            # it is 15 % faster than the transposed one.
            lean = dataclasses.replace(lean, grads_transposed=True, num_stages_pds=1)
        if rules.backward(dtype_name, tile, lean) is None:
            config = lean
    if (problem.grouped and problem.causal and dtype_name in rules.DTYPES and not problem.packed
            and not config.deterministic and not config.preprocess_in_main):
        # A grouped CTA walks its whole group's query heads: 8x longer CTAs at 64 / 8 heads,
        # and a causal grid per (head, batch) pair started the longest ones of its last pairs
        # with little left to run beside them. Longest first across sections of pairs: 1.10x
        # gpt-oss (2, 64 / 8, 8192, 64), 1.05x (4, 32 / 8, 8192, 128) bf16 causal; MHA's
        # short CTAs lost 1-2.5 % (perf/NOTES.md, fortieth session). A left window tapers the
        # last key blocks of each pair the same way: 1.006x at Mistral's (the model said 7 %).
        # Not where the kernel keeps the launch order (packed, deterministic, prepare-ahead:
        # kernels/bwd_sm90.py), so that those share the per-pair kernel's compile key.
        config = dataclasses.replace(config, section_pairs=GROUPED_SECTION_PAIRS)
    return config


def prepare_ahead_plan(config, dq_config, problem, batch, heads, seqlen_k, num_sms, dlse, rows_contiguous,
                       waves: int = PREP_AHEAD_WAVES, group: int = 1) -> tuple:
    """(prep_ahead, prep_ctas) for the main kernel: the preprocess prepares heads
    0 .. prep_ahead - 1 (in launch order), and the first prep_ctas key blocks of head j
    prepare head j + prep_ahead. prep_ahead = B x N when the main kernel prepares nothing:
    configs without fused_preprocess (or where the kernel ignores it), the separate dQ kernel,
    an upstream LSE gradient (delta is corrected on the torch side after the preprocess), and
    O or dO whose rows are not contiguous (rows_contiguous False: the kernel reads a head's
    rows as one range). `waves`: see PREP_AHEAD_WAVES (0: each head prepared by the CTAs of
    the head launched just before it). With grouped-query attention `heads` counts the grid's
    key/value heads (units of `group` query heads) and prep_ctas is a multiple of group: each
    preparing CTA takes one query head's share (bwd_prepare_ahead)."""
    total = batch * heads
    # A one-launch kernel (fused_postprocess) prepares no later head: every head is prepared by
    # the preprocess (its fallback) or by its own CTAs (prep_ahead 0, BackwardPlan._launch).
    if not main_kernel_may_prepare(config, dq_config, dlse, rows_contiguous) or config.fused_postprocess:
        return total, 1
    prep_ctas = preparing_ctas(config, problem, seqlen_k, group)
    if prep_ctas == 0:
        return total, 1
    prep_ahead = max(1, -(-waves * num_sms // -(-seqlen_k // config.block_n)))
    return min(total, prep_ahead), prep_ctas


def main_kernel_may_prepare(config, dq_config, dlse, rows_readable: bool) -> bool:
    """Whether the main kernel may prepare heads (their delta and log2 LSE, dq_accum zeroed):
    a fused_preprocess config whose main kernel accumulates dQ (not the separate dQ kernel),
    no upstream LSE gradient (delta is corrected on the torch side after the preprocess), and
    O's and dO's rows readable by the preparing code (rows_readable)."""
    return config.preprocess_in_main and dq_config is None and dlse is None and rows_readable


def preparing_ctas(config, problem: AttentionProblem, seqlen_k: int, group: int, one_launch: bool = False) -> int:
    """How many key blocks (CTAs) of a unit prepare a head in the main kernel (0: none fit).
    one_launch: a grid run as one launch, whose CTAs all wait for their own head's preparation."""
    num_n_blocks = -(-seqlen_k // config.block_n)
    # Causal: the lower half of the key blocks walk the most query blocks, and they prepare a
    # head launched later, so that the short ones near the diagonal are not lengthened. In a
    # grid run as one launch every CTA of the head waits for its preparation before its first step:
    # all of them share it, and the longest CTAs wait half as long.
    prep_ctas = (num_n_blocks + 1) // 2 if problem.causal and not one_launch else num_n_blocks
    # Grouped heads: a unit's preparing CTAs take one query head each, in equal shares.
    return prep_ctas - prep_ctas % group


_dummies = {}


def _work_buffers(rows: tuple, separate_dq: bool, tile: int, device, reusable: bool) -> tuple:
    """(lse_log2, delta, dq_accum, dq_done, prepared) for one call with per-row buffers of
    shape `rows` (cute_flash.work_buffers: a kept set where one may serve); with the separate
    dQ kernel the last three are never-read placeholders. dq_done and prepared are zeroed by
    the preprocess; the main kernel's CTAs count themselves in them."""
    lse_log2, delta, dq_accum, dq_done, prepared = work_set(rows, 0 if separate_dq else tile, device, reusable)
    if separate_dq:
        dq_accum = _dummy((1, 1, padded_seqlen_q(1), tile), torch.float32, device)
        dq_done = prepared = _dummy((1, 1), torch.int32, device)
    return lse_log2, delta, dq_accum, dq_done, prepared


def _dummy(shape, dtype, device):
    """A small zeroed tensor standing in for a buffer the kernel is compiled not to touch
    (the dQ semaphore outside deterministic mode, the dQ accumulator with a separate dQ
    kernel): one per (shape, dtype, device), never written."""
    key = (shape, dtype, device)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def backward_with_config(q, k, v, out, dout, lse, problem: AttentionProblem, softmax_scale: float, config, grads=None,
                         dlse=None, dq_config=None, overlap_postprocess: bool = True,
                         prep_ahead_waves: int = PREP_AHEAD_WAVES, tile_head_dim: int | None = None,
                         delta_out: list | None = None, value_tile_head_dim: int | None = None):
    """dq, dk, dv of attention(q, k, v) for the upstream gradient dout, with the given
    BackwardTileConfig (no plan cache: plan_backward, then BackwardPlan.run).

    dq_config (a SeparateDqConfig, optional): when it applies to Sq, dQ comes from the
    separate dQ kernel and no dQ accumulator is allocated.

    q (B, N, Sq, D), out, dout (B, N, Sq, Dv); k (B, N, Sk, D), v (B, N, Sk, Dv); lse (B, N, Sq)
    fp32 natural-log LSE from the forward (-inf for rows that see no key). `grads` optionally
    supplies the (dq, dk, dv) output tensors (same shapes and dtype as q, k, v). `dlse` (B, N,
    Sq), optional, is the
    upstream gradient of the LSE: d loss / d S_ij gains dlse_i * P_ij, which is the same as
    using delta - dlse in place of delta. Runs on PyTorch's current stream of q's device.

    overlap_postprocess=False runs the dQ postprocess after the main kernel has finished
    instead of overlapping its end (for measuring what the overlap gains; another binary).
    prep_ahead_waves: see prepare_ahead_plan. tile_head_dim: the native head dim whose
    kernels (and config) serve head dims D and Dv (default D; cute_flash.head_dims), and
    value_tile_head_dim its value tile (default the tile). delta_out, a list: receives the
    (B, N, Sq_pad) delta the kernels used (the sink's gradient reads it).
    """
    plan = plan_backward(q, k, v, out, dout, lse, problem, config, dlse, dq_config, overlap_postprocess,
                         prep_ahead_waves, tile_head_dim, value_tile_head_dim)
    return plan.run(q, k, v, out, dout, lse, softmax_scale, dlse, grads, delta_out)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What the backward's launch decides from a call's signature (shapes, strides, pointer
    alignment, dtype, problem, configs), so that a call with a known signature only allocates
    and launches. Holds no tensor of the caller's."""

    empty: bool  # no query, key, batch or head: every gradient is zero, no launch
    kernels: tuple  # (preprocess, main, last): compile_bwd.get_backward
    dtype_name: str  # the kernels' (float32: "float32" or "float32x3", cute_flash.float32)
    tile: int  # the native head dim whose kernels run
    separate_dq: bool  # dQ from bwd_dq_sm90 (no dQ accumulator, no completion counters)
    rows: tuple  # the per-row fp32 buffers' (B, N, Sq padded: seqlen_pad.padded_seqlen_q)
    units: int  # the grid's heads per batch (key/value heads: the prepared counts' units)
    copy_operands: tuple  # per q, k, v, out, dout: TMA needs a copy (torch_helpers.as_tma_operand)
    lse_copy: bool  # the LSE's rows are not contiguous
    prep_ahead: int  # prepare_ahead_plan
    prep_ctas: int
    # The grid runs as one launch and its config prepares heads in the main kernel: on a counted set
    # (work_buffers.counted_work_set) it runs with prep_ahead 0 and no preprocess (else, e.g.
    # under graph capture or where delta is kept, as prep_ahead says, with the preprocess).
    one_launch: bool
    # A one-launch plan on a counted set: the main kernel's last CTA of each head converts its dQ
    # (config.fused_postprocess) and no postprocess is launched.
    converts_dq: bool
    group: int  # query heads per key/value head
    semaphore_blocks: int  # deterministic mode: query blocks per (batch, head) to order dQ over; else 0
    key_blocks: int  # the main kernel's CTAs per (batch, head) that the postprocess waits for
    # float32 inputs: the operand pass making the copies the kernels take (float32.OperandPass)
    operand_pass: object = None
    # q's device is not the current one (the signature holds both): each run makes it current.
    other_device: bool = False

    def run(self, q, k, v, out, dout, lse, softmax_scale, dlse=None, grads=None, delta_out=None):
        """(dq, dk, dv) into `grads` (default new_gradients); see backward_with_config."""
        given = grads is not None
        if not given:
            grads = new_gradients(q, k, v)
        if self.empty:
            # No query, no key or no batch/head: every gradient is zero (or empty).
            for g in grads:
                g.zero_()
            if delta_out is not None:
                # No key: O = 0, so rowsum(dO * O) = 0 and only dlse remains.
                delta = torch.zeros(lse.shape, dtype=torch.float32, device=q.device)
                delta_out.append(delta if dlse is None else delta - dlse.to(torch.float32))
            return grads
        work = grads
        if given:
            # The kernels write dq with vector stores and dk / dv with TMA: outputs that cannot
            # take those are computed in scratch buffers and copied.
            work = tuple(
                g if tma_compatible(g) else torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in grads
            )
        q, k, v, out, dout = tma_operands((q, k, v, out, dout), self.copy_operands)
        if self.lse_copy:
            lse = lse.contiguous()
        delta = call_on_device(self._launch, self.other_device, q.device, q, k, v, out, dout, lse, softmax_scale,
                               dlse, work, delta_out is not None)
        if given:
            for g, w in zip(grads, work):
                if g is not w:
                    g.copy_(w)
        if delta_out is not None:
            delta_out.append(delta)
        return grads

    def _launch(self, q, k, v, out, dout, lse, softmax_scale, dlse, grads, keep_delta: bool):
        """The three kernels (with float32 the operand pass before them; a one-launch plan on a
        counted set: the main kernel and the postprocess) on the current
        device; returns the delta they used (keep_delta: the caller keeps it, so it is not
        a reused work buffer, cute_flash.work_buffers)."""
        pre, main, last = self.kernels
        dq, dk, dv = grads
        # A dense batch's offsets, and the transposes (TF32) and operand scales (scaled halves)
        # where the kernels do not read them, are None (kernels/optional_arguments.py).
        transposes, scales = None, None
        q_in, k_in, v_in, dout_in = q, k, v, dout
        # What the preprocess reads as dO: float32's as rounded for dP, so that with one visible
        # key dP - delta is exactly 0 as in the forward's O = V; float32x3's dP is dO's to float32
        # accuracy (its operand is the [hi | lo] pair), so dO itself.
        dout_delta = dout
        if self.operand_pass is not None:
            (q_in, k_in, v_in, dout_in), transposes, scales = self.operand_pass.run((q, k, v, dout))
            dout_delta = dout if self.dtype_name in rules.SPLIT_DTYPES else dout_in
        q_t = dout_t = k_t = None
        if transposes is not None:
            q_t, k_t, dout_t = transposes
        # The main kernel's arguments that both paths below pass alike (before and after the
        # work buffers and counts).
        inputs = (q_in, k_in, v_in, out, dout_in, lse)
        outputs = (None, None if transposes is None else (q_t, dout_t), scales, dq)
        counted = None
        if self.one_launch and not keep_delta:
            counted = counted_work_set(self.rows, self.tile, self.units, q.device)
        if counted is not None:
            # Every head prepared by the main kernel, on counts that go on from the last call.
            lse_log2, delta, dq_accum, dq_done, prepared, totals = counted
            prepared_count, done_count = totals.advance(self.prep_ctas, self.key_blocks, (dq_done, prepared))
            try:
                main(*inputs, lse_log2, delta, dq_accum, (None, dq_done, prepared),
                     dk, dv, softmax_scale, 0, self.prep_ctas, prepared_count, *outputs,
                     done_count if self.converts_dq else 0)
                if not self.converts_dq:
                    last(dq_accum, dq, dq_done, done_count, softmax_scale, None)
            except BaseException:
                totals.reset((dq_done, prepared))
                raise
            return delta
        lse_log2, delta, dq_accum, dq_done, prepared = _work_buffers(
            self.rows, self.separate_dq, self.tile, q.device, reusable=not keep_delta)
        if self.semaphore_blocks:
            dq_semaphore = torch.zeros((*self.rows[:2], self.semaphore_blocks), dtype=torch.int32, device=q.device)
        else:
            dq_semaphore = None
        pre(out, dout_delta, lse, lse_log2, delta, dq_accum, dq_done, prepared, self.prep_ahead * self.group, None)
        if dlse is not None:
            # Rows whose LSE is -inf have P = 0, so their delta does not matter.
            delta[:, :, : q.shape[2]].sub_(dlse.to(torch.float32))
        main(*inputs, lse_log2, delta, dq_accum, (dq_semaphore, dq_done, prepared), dk, dv, softmax_scale,
             self.prep_ahead, self.prep_ctas, self.prep_ctas, *outputs, 0)
        if self.separate_dq:
            last(q_in, k_in, v_in, dout_in, lse_log2, delta, dq, k_t, scales, None, softmax_scale)
        else:
            # Nothing may run between the main kernel and the postprocess: the postprocess
            # overlaps the main kernel (programmatic dependent launch, see bwd_postprocess).
            last(dq_accum, dq, dq_done, self.key_blocks, softmax_scale, None)
        return delta


def plan_backward(q, k, v, out, dout, lse, problem: AttentionProblem, config, dlse=None, dq_config=None,
                  overlap_postprocess: bool = True, prep_ahead_waves: int = PREP_AHEAD_WAVES,
                  tile_head_dim: int | None = None, value_tile_head_dim: int | None = None) -> BackwardPlan:
    """The BackwardPlan of a call with these operands (their shapes, strides, alignment and
    dtype; nothing is kept of them) and configs; arguments as backward_with_config's."""
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    value_head_dim = v.shape[-1]
    dtype_name = kernel_dtype_name(q.dtype, max(head_dim, value_head_dim))
    tile = tile_head_dim or head_dim
    arch, num_sms = device_traits(q.device)
    if dq_config is not None and not dq_config.applies(seqlen_q):
        dq_config = None
    empty = q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or seqlen_k == 0
    kernels = None
    if not empty:
        kernels = compile_bwd.get_backward(dtype_name, head_dim, problem, config, arch, dq_config,
                                           overlap_postprocess, tile, value_head_dim, value_tile_head_dim)
    copy_operands = tuple(not tma_compatible(t) for t in (q, k, v, out, dout))
    # Only a config whose main kernel prepares later heads reads O / dO as row ranges (a copy
    # is contiguous).
    rows_contiguous = config.preprocess_in_main and all(
        c or t.stride(2) == value_head_dim or t.shape[2] == 1 for t, c in zip((out, dout), copy_operands[3:])
    )
    # The prepare-ahead's units are the grid's heads: with grouped-query attention a key/value
    # head, whose group of query heads is prepared together (the preprocess kernel counts
    # query heads: group per unit).
    group = heads // k.shape[1] if k.shape[1] else 1
    prep_ahead, prep_ctas = prepare_ahead_plan(config, dq_config, problem, batch, k.shape[1], seqlen_k, num_sms, dlse,
                                               rows_contiguous, prep_ahead_waves, group)
    deterministic_dq = config.deterministic and dq_config is None
    key_blocks = -(-seqlen_k // config.block_n)
    # One launch: each CTA waits for its own head's preparing CTAs, which need only be resident
    # at once or dispatched meanwhile (the grid launches in index order: bwd_prepare_ahead).
    one_launch_ctas = 0
    # (A one-launch kernel, fused_postprocess, prepares its heads in its consumers, through O's
    # and dO's own row strides: flash-attn's (B, S, N, D) layout too.)
    if (main_kernel_may_prepare(config, dq_config, dlse, rows_contiguous or config.fused_postprocess)
            and not problem.packed and runs_as_one_launch(batch * k.shape[1], key_blocks, tile, num_sms)):
        one_launch_ctas = preparing_ctas(config, problem, seqlen_k, group, one_launch=True)
    padded_rows = padded_seqlen_q(seqlen_q, config.block_m)
    converts_dq = (one_launch_ctas > 0 and config.fused_postprocess and group <= IN_KERNEL_DQ_MAX_GROUP
                   and 4 * padded_rows * tile * group <= IN_KERNEL_DQ_BYTES)
    return BackwardPlan(
        empty=empty,
        kernels=kernels,
        dtype_name=dtype_name,
        tile=tile,
        separate_dq=dq_config is not None,
        rows=(batch, heads, padded_rows),
        units=k.shape[1],
        copy_operands=copy_operands,
        lse_copy=lse.stride(-1) != 1,
        prep_ahead=prep_ahead,
        prep_ctas=one_launch_ctas or prep_ctas,
        one_launch=one_launch_ctas > 0,
        converts_dq=converts_dq,
        group=group,
        semaphore_blocks=-(-seqlen_q // config.block_m) if deterministic_dq else 0,
        key_blocks=key_blocks,
        operand_pass=float32.operand_pass(dtype_name, True, (q, k, v, dout), tile)
        if q.dtype == torch.float32 and not empty else None,
        other_device=q.device.index != _current_device(),
    )


def packed_rows(cu_seqlens_q, total_q: int, padded_rows: int) -> torch.Tensor:
    """For each token of a packed q, its row in the backward's padded per-row buffers
    (kernels/sequences.py: the sequence's stat_offset plus the token's place in it); no host
    sync."""
    starts = cu_seqlens_q[:-1].clamp(0, total_q)
    batch = torch.arange(starts.shape[0], device=cu_seqlens_q.device)
    shift = packed_region_start(starts, batch) - starts
    tokens = torch.arange(total_q, device=cu_seqlens_q.device, dtype=torch.int32)
    # (searchsorted, not repeat_interleave: offsets that break the contract must not trip a
    # device assert; they give wrong rows, clamped inside the buffers.)
    sequence = torch.searchsorted(cu_seqlens_q[1:].contiguous(), tokens, right=True).clamp_(max=starts.shape[0] - 1)
    return (tokens + shift[sequence]).clamp_(0, padded_rows - 1)


def backward_packed(q, k, v, out, dout, lse, batch: tuple, problem: AttentionProblem, softmax_scale: float,
                    dlse=None, deterministic: bool = False, want_delta: bool = False, grads=None):
    """(dq, dk, dv, delta) of a packed batch (problem.packed; cute_flash.varlen): q (total_q, N,
    D), out, dout (total_q, N, Dv), k (total_k, Nkv, D), v (total_k, Nkv, Dv), lse and dlse (N,
    total_q), batch = (cu_seqlens_q,
    cu_seqlens_k, seqused_k or None, max_seqlen_q, max_seqlen_k). The kernels take the packed
    tensors as (1, N, total, D) views; the per-row buffers give each sequence a region of its
    own (kernels/sequences.py). delta: with want_delta the (N, total_q) delta the kernels used
    (the sink's gradient reads it), else None. grads: (dq, dk, dv) to write into (the SDPA
    route passes them laid out as aten's meta function promises), else new_gradients.
    What the call's signature decides is recorded as a PackedBackwardPlan (plan cache)."""
    cu_q, cu_k, used, max_q, max_k = batch
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    key = (_signature(q, k, v, out, dout, lse, problem, dlse, True, deterministic), cu_q.shape, used is None,
           max_q, max_k)
    plan = cached_plan(_plans, key, lambda: plan_packed_backward(q, k, v, out, dout, lse, cu_q.shape[0] - 1, max_q,
                                                                 max_k, problem, deterministic), _MAX_PLANS)
    return plan.run(q, k, v, out, dout, lse, batch, softmax_scale, dlse, want_delta, grads)


@dataclasses.dataclass(frozen=True)
class PackedBackwardPlan:
    """backward_packed's decisions for a signature (as BackwardPlan for dense calls)."""

    empty: bool  # no query or no key: every gradient is zero, no launch
    kernels: tuple
    dtype_name: str  # the kernels' (float32 inputs: the scaled halves, cute_flash.float32)
    tile: int
    separate_dq: bool  # dQ from bwd_dq_sm90 (float32: no dQ accumulator, no completion counters)
    rows: int  # the per-row buffers' rows (seqlen_pad.packed_padded_rows)
    copy_operands: tuple  # per q, k, v, out, dout: TMA needs a copy of its (1, N, total, D) view
    semaphore_blocks: int  # deterministic mode: query blocks per (sequence, head); else 0
    key_blocks: int  # the main kernel's CTAs per query head, as the postprocess counts them
    operand_pass: object = None  # float32 inputs: as BackwardPlan's, on the (1, N, total, D) views

    def run(self, q, k, v, out, dout, lse, batch, softmax_scale, dlse, want_delta, grads):
        cu_q, cu_k, used, _, _ = batch
        total_q, heads, _ = q.shape
        dq, dk, dv = new_gradients(q, k, v) if grads is None else grads
        f32 = dict(dtype=torch.float32, device=q.device)
        if self.empty:
            for g in (dq, dk, dv):
                g.zero_()
            delta = torch.zeros((heads, total_q), **f32)
            return dq, dk, dv, (delta if dlse is None else delta - dlse.to(torch.float32)) if want_delta else None
        if used is not None:
            # The kernels store the key rows sequences use; the rest (past seqused_k) do not
            # reach the output: their gradient is zero.
            dk.zero_()
            dv.zero_()
        q4, k4, v4, out4, dout4 = tma_operands([batch_of_one(t) for t in (q, k, v, out, dout)], self.copy_operands)
        dq4, dk4, dv4 = batch_of_one(dq), batch_of_one(dk), batch_of_one(dv)
        lse3 = (lse if lse.stride(-1) == 1 else lse.contiguous()).unsqueeze(0)
        num_seqs = cu_q.shape[0] - 1
        # (Transposes and operand scales: None where the kernels do not read them,
        # kernels/optional_arguments.py.)
        q_in, k_in, v_in, dout_in, scales = q4, k4, v4, dout4, None
        if self.operand_pass is not None:
            # The scaled halves (one power of two per head over the packed tensors: a packed
            # sequence's batch index is 0; no transposes); the preprocess reads the float32 O
            # and dO. With seqused_k, k's and v's powers of two over the rows in use (as the
            # forward's).
            tops = None if used is None else (None, *float32.keys_in_use_tops((k, v), cu_k, used), None)
            (q_in, k_in, v_in, dout_in), _, scales = self.operand_pass.run((q4, k4, v4, dout4), tops)
        dq_semaphore = None
        if self.semaphore_blocks:
            dq_semaphore = torch.zeros((num_seqs, heads, self.semaphore_blocks), dtype=torch.int32, device=q.device)
        # (The kernels' seqused_k is read with problem.keys_used only; their binaries serve
        # both, so a batch without it passes a stand-in.)
        offsets = (cu_q, cu_k, used if used is not None else _dummy((1,), torch.int32, q.device))
        token_rows = packed_rows(cu_q, total_q, self.rows) if dlse is not None or want_delta else None
        pre, main, last = self.kernels
        with device_scope(q.device):
            # (dq_done and prepared count per head here: kernels/sequences.py, counter_batch.)
            lse_log2, delta, dq_accum, dq_done, prepared = _work_buffers(
                (1, heads, self.rows), self.separate_dq, self.tile, q.device, reusable=not want_delta)
            pre(out4, dout4, lse3, lse_log2, delta, dq_accum, dq_done, prepared, heads, offsets)
            if dlse is not None:
                delta[0][:, token_rows] -= dlse.to(torch.float32)
            main(q_in, k_in, v_in, out4, dout_in, lse3, lse_log2, delta, dq_accum, (dq_semaphore, dq_done, prepared),
                 dk4, dv4, softmax_scale, num_seqs * k.shape[1], 1, 1, offsets, None, scales, dq4, 0)
            if self.separate_dq:
                last(q_in, k_in, v_in, dout_in, lse_log2, delta, dq4, None, scales, offsets, softmax_scale)
            else:
                # Every CTA of the main kernel's compact grid counts once per query head.
                last(dq_accum, dq4, dq_done, self.key_blocks, softmax_scale, offsets)
        return dq, dk, dv, delta[0][:, token_rows] if want_delta else None


def plan_packed_backward(q, k, v, out, dout, lse, num_seqs: int, max_q: int, max_k: int, problem: AttentionProblem,
                         deterministic: bool) -> PackedBackwardPlan:
    """The PackedBackwardPlan of a packed call with these operands (shapes, strides, alignment,
    dtype; nothing is kept of them); the longest sequence's lengths pick the config (the
    grids' bounds come from the totals)."""
    total_q, heads, head_dim = q.shape
    value_head_dim = v.shape[-1]
    dtype_name = TORCH_DTYPE_NAMES[q.dtype]
    if q.dtype == torch.float32:
        dtype_name = float32.kernel_dtype_name(max(head_dim, value_head_dim), packed=True)
    max_q, max_k = min(max_q, total_q), min(max_k, k.shape[0])
    tile, value_tile, config = _tile_and_config(dtype_name, head_dim, value_head_dim, problem, (max_q, max_k),
                                                q.device, deterministic)
    # float32's dQ always comes from its own kernel (its dK / dV kernel has no dQ GEMM).
    dq_config = None
    if dtype_name in rules.FLOAT32_INPUTS:
        dq_config = get_config(dtype_name, tile, problem.causal, "bwd_dq", q.device, required=True,
                               seqlens=(max_q, max_k))
    empty = q.numel() == 0 or k.shape[0] == 0
    kernels = None
    if not empty:
        arch, _ = device_traits(q.device)
        kernels = compile_bwd.get_backward(dtype_name, head_dim, problem, config, arch, dq_config, True, tile,
                                           value_head_dim, value_tile)
    return PackedBackwardPlan(
        empty=empty,
        kernels=kernels,
        dtype_name=dtype_name,
        tile=tile,
        separate_dq=dq_config is not None,
        rows=packed_padded_rows(total_q, num_seqs),
        copy_operands=tuple(not tma_compatible(batch_of_one(t)) for t in (q, k, v, out, dout)),
        # (A separate dQ kernel adds no dQ: no turns to take.)
        semaphore_blocks=-(-max_q // config.block_m) if config.deterministic and dq_config is None else 0,
        key_blocks=k.shape[0] // config.block_n + num_seqs,
        operand_pass=float32.operand_pass(dtype_name, True, tuple(batch_of_one(t) for t in (q, k, v, dout)), tile)
        if q.dtype == torch.float32 and not empty else None,
    )
