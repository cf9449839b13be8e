"""The public entry point, with a cached fast path for eager calls.

Validating arguments, looking up the tile config and the compiled kernel, and the torch
custom-op dispatcher together cost ~100 us of Python per call, more than the whole kernel on
small problems. Everything those steps decide depends only on the call's signature (shapes,
strides, dtypes, devices, pointer alignment, the AttentionProblem, scale), so the first call with a
signature validates fully and records a plan; later calls with the same signature only build
the key, allocate the outputs and launch. The custom op remains the path for tracing
(torch.compile, meta and fake tensors) and for anything that is not a CUDA tensor.

Calls that need gradients take the same plan through a torch.autograd.Function whose
backward calls the same backward launcher as the custom op's registered autograd: the
custom-op dispatcher costs ~0.2-0.3 ms of host time per forward+backward on the H100
machine's torch (perf/profile_step.py), which doubled a small training step.
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from cute_flash import compat
from cute_flash.head_dims import ROW_ALIGN, aligned_head_dim, with_aligned_rows
from cute_flash.kernels.problem import GROUPED_ROWS_MAX_SQ, AttentionProblem
from cute_flash.torch_helpers import (
    SIXTEEN_BIT,
    cached_plan,
    call_on_device,
    current_device_index as _current_device,
    empty_with_head_dim,
)
from cute_flash.validation import check_kernel_device, check_variant, validate

_plans = {}
_MAX_PLANS = 4096  # a workload with ever-changing shapes must not grow this without bound


@dataclass(frozen=True)
class _Plan:
    kernel: object
    problem: AttentionProblem  # what the kernel computes (kernels/problem.py)
    scale: float
    copy_inputs: tuple  # per input: True when it must be made TMA-compatible first
    lse_shape: tuple
    dtype: torch.dtype
    device: torch.device
    other_device: bool  # the inputs' device is not the current device
    empty: bool  # no kernel launch: Sq == 0 or Sk == 0
    # Where the kernel writes the LSE when the caller does not want it: nothing ever reads
    # it, so one buffer per plan saves an allocation per call (~1.5 us of the host budget).
    lse_sink: torch.Tensor | None
    # float32 inputs: the operand pass making the copies the kernels take (float32.OperandPass:
    # TF32, 3xTF32 or the scaled fp16 halves), prepared with the plan; else None.
    operand_pass: object
    value_head_dim: int  # v's and O's head dim (cute_flash.head_dims)
    # problem.grouped_rows: q's (B, Nkv, group * Sq, D) view the kernel takes (a key/value
    # head's group of query heads at every position as its rows); None otherwise.
    query_rows: tuple | None = None
    # problem.split_keys (grouped rows only): the parts each sequence's keys are walked in,
    # and the kernel merging them (kernels/split_merge.py); 1 and None otherwise.
    splits: int = 1
    merge: object = None
    # The backward's plans of this forward's calls (launch_bwd.backward's `plans`): found by
    # dO's layout alone, without the backward's whole signature.
    backward_plans: dict = field(default_factory=dict, compare=False, repr=False)

    def run(self, q, k, v, return_lse, sink=None):
        if self.empty:
            from cute_flash import launch_fwd

            return launch_fwd.forward(q, k, v, self.problem, self.scale, sink)
        if self.query_rows is not None:
            return self._run_grouped_rows(q, k, v, sink)
        if True in self.copy_inputs:
            from cute_flash.torch_helpers import as_tma_operand

            q, k, v = (as_tma_operand(t) if c else t for t, c in zip((q, k, v), self.copy_inputs))
        # O has q's shape but v's head dim: empty_like(q) where they agree is ~2 us cheaper than
        # torch.empty with a shape, and keeps q's dense layout, which the TMA store takes as is.
        out = empty_with_head_dim(q, self.value_head_dim)
        scales = None
        if self.operand_pass is not None:
            # After O's allocation: the split operands are twice q's width.
            q, k, v, scales = self.operand_pass.run((q, k, v))
        if return_lse or self.lse_sink is None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        else:
            lse = self.lse_sink
        self._launch(q, k, v, out, lse, sink, scales)
        return out, lse

    def _launch(self, q, k, v, out, lse, sink, scales=None):
        """The kernel on the inputs' device (made current for the call when it is not); a
        dense batch's packed-batch arguments are absent, and so are the sink and the operand
        scales where they are None (FlashForwardSm90.optional_arguments)."""
        call_on_device(self.kernel, self.other_device, self.device, q, k, v, out, lse, sink, None, None, None, None,
                       scales, self.scale)

    def _run_grouped_rows(self, q, k, v, sink):
        """run() of a grouped-rows plan: q as its rows (a view of a dense (B, N, Sq, D) q, else
        one copy), O written as the rows of a (B, N, Sq, Dv) tensor, the LSE in (B, N, Sq);
        each row takes its query head's sink."""
        from cute_flash.torch_helpers import as_tma_operand

        rows = q.reshape(self.query_rows)
        rows, k, v = (as_tma_operand(t) if c else t for t, c in zip((rows, k, v), self.copy_inputs))
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        if self.splits == 1:
            out = torch.empty((*self.lse_shape, self.value_head_dim), dtype=self.dtype, device=self.device)
            self._launch(rows, k, v, out.view(*self.query_rows[:3], self.value_head_dim), lse, sink)
            return out, lse
        # Split keys: part s of sequence b at entry b * splits + s of the parts' buffers (each
        # normalised over its part, the sink left out), merged by one more launch into O, laid
        # out as q (the plain plan's layout, which the SDPA registration promises torch) and
        # written through its (B, Sq, N, Dv) view as the merge indexes it.
        out = empty_with_head_dim(q, self.value_head_dim)
        batch, kv_heads, num_rows, _ = self.query_rows
        entries = batch * self.splits
        parts = torch.empty((entries, kv_heads, num_rows, self.value_head_dim), dtype=self.dtype, device=self.device)
        parts_lse = torch.empty((entries, *self.lse_shape[1:]), dtype=torch.float32, device=self.device)
        self._launch(rows, k, v, parts, parts_lse, sink)  # (the split kernel leaves the sink to the merge)
        call_on_device(self.merge, self.other_device, self.device, parts, parts_lse, sink, out.transpose(1, 2), lse)
        return out, lse


def _needs_padded_head_dims(q, k, v) -> bool:
    """Head dims the kernels do not take as they are: rows TMA cannot describe (not a multiple
    of 16 bytes), or float32 q, k and v of two head dims (its operand pass takes one)."""
    return (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4
            and (q.shape[-1] % ROW_ALIGN or v.shape[-1] % ROW_ALIGN
                 or (q.dtype == torch.float32 and q.shape[-1] != v.shape[-1])))


def _padded_head_dims(q, k, v, softmax_scale, return_lse, **variant):
    """q and k padded with zero columns to the next multiple of ROW_ALIGN, v to its own (or,
    float32 with two head dims, all three to the wider): Q K^T is unchanged, and so are the
    first Dv columns of P V; autograd slices the gradients back (cute_flash.head_dims)."""
    scale = validate(q, k, v, softmax_scale)  # errors name the caller's tensors; 1/sqrt(real D)
    qk_width, v_width = aligned_head_dim(q.shape[-1]), aligned_head_dim(v.shape[-1])
    if q.dtype == torch.float32:
        qk_width = v_width = max(qk_width, v_width)
    padded = [with_aligned_rows(t, width) for t, width in ((q, qk_width), (k, qk_width), (v, v_width))]
    out, lse = flash_attention(*padded, softmax_scale=scale, return_lse=True, **variant)
    out = out[..., : v.shape[-1]]
    return (out, lse) if return_lse else out


def call_signature(q, k, v, problem, softmax_scale):
    """Everything a plan depends on, cheap to build: the key of the plan cache (and of the
    SDPA registration's routing cache, cute_flash.sdpa)."""
    return (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
        # Each pointer's alignment on its own: the plan copies exactly the inputs TMA cannot take.
        q.device, k.device, v.device, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
        problem, softmax_scale, _current_device(),
    )


def _make_plan(q, k, v, problem, softmax_scale, splits=1) -> _Plan:
    from cute_flash import launch_fwd
    from cute_flash.compile_kvcache import get_split_merge
    from cute_flash.torch_helpers import TORCH_DTYPE_NAMES, device_traits, tma_compatible

    scale = validate(q, k, v, softmax_scale)
    check_kernel_device(q)
    batch, heads, seqlen_q, head_dim = q.shape
    empty = q.numel() == 0 or k.shape[2] == 0
    kernel, operand_pass, query_rows = None, None, None
    operands = (q, k, v)
    if problem.grouped_rows:
        query_rows = (batch, k.shape[1], heads // k.shape[1] * seqlen_q, head_dim)
        operands = (q.reshape(query_rows), k, v)
    if not empty:
        # (Tiles aligned to each sequence's end where Sq = Sk: launch_fwd.end_aligned_problem.)
        kernel = launch_fwd.kernel_for(q.dtype, head_dim,
                                       launch_fwd.end_aligned_problem(problem, seqlen_q == k.shape[2], q.dtype),
                                       q.device, (seqlen_q, k.shape[2]), v.shape[-1],
                                       (batch, heads, k.shape[1]))
        if q.dtype == torch.float32:
            from cute_flash import float32

            name, tile = launch_fwd.kernel_tile(q.dtype, head_dim, q.device)
            operand_pass = float32.operand_pass(name, False, operands, tile)
    return _Plan(
        kernel=kernel,
        problem=problem,
        scale=scale,
        copy_inputs=tuple(not tma_compatible(t) for t in operands),
        lse_shape=(batch, heads, seqlen_q),
        dtype=q.dtype,
        device=q.device,
        other_device=q.device.index != _current_device(),
        empty=empty,
        lse_sink=None if empty else torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device),
        operand_pass=operand_pass,
        value_head_dim=v.shape[-1],
        query_rows=query_rows,
        splits=splits,
        merge=get_split_merge(TORCH_DTYPE_NAMES[q.dtype], v.shape[-1], device_traits(q.device)[0], problem.sink)
        if problem.split_keys and not empty else None,
    )


def plan_for(q, k, v, problem: AttentionProblem, softmax_scale, splits: int = 1):
    """The recorded plan for eager CUDA inputs with this signature (validated and recorded
    on first use); plan.run(q, k, v, return_lse) launches without autograd. splits: with
    problem.split_keys, the parts of each sequence's keys (_split_parts)."""
    key = call_signature(q, k, v, problem, softmax_scale)
    if q.dtype == torch.float32:
        # Which float32 kernel runs depends on the matmul precision, global state the caller
        # may change between calls (cute_flash.float32).
        key += (torch.get_float32_matmul_precision(),)
    if splits > 1:
        key += (splits,)
    return cached_plan(_plans, key, lambda: _make_plan(q, k, v, problem, softmax_scale, splits), _MAX_PLANS)


_launch_bwd_module = None


def _launch_bwd():
    """cute_flash.launch_bwd (which imports this module: not imported at the top), kept after
    the first backward: an import statement per call costs ~1 us of the backward's host path."""
    global _launch_bwd_module
    if _launch_bwd_module is None:
        from cute_flash import launch_bwd

        _launch_bwd_module = launch_bwd
    return _launch_bwd_module


class _AttentionFunction(torch.autograd.Function):
    """Eager autograd over a plan: saves q, k, v, O and the LSE only (O(S) memory)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, plan, deterministic):
        out, lse = plan.run(q, k, v, True, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        problem = plan.problem
        if problem.grouped_rows or problem.row_heads:
            # The forward ran a group's query heads as a tile's rows; the backward's row blocks
            # are one query head's (grouped heads): the same O and LSE, its own problem.
            problem = dataclasses.replace(problem, grouped_rows=False, row_heads=0, grouped=True)
        ctx.problem, ctx.scale, ctx.deterministic = problem, plan.scale, deterministic
        ctx.backward_plans = plan.backward_plans
        # An unused LSE gets no zero-filled gradient (dlse is None, not a tensor of zeros).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dsink = _launch_bwd().backward_with_sink(q, k, v, out, dout, lse, ctx.problem, ctx.scale, sink,
                                                          dlse=dlse, deterministic=ctx.deterministic,
                                                          plans=ctx.backward_plans)
        return dq, dk, dv, dsink, None, None


def _is_plain(window_size, alignment, softcap, sink) -> bool:
    return window_size == (-1, -1) and alignment == "top_left" and softcap == 0.0 and sink is None


def problem_of(q, k, causal, window_size, alignment, softcap, sink, plain=None) -> AttentionProblem:
    """The AttentionProblem of a call's (checked) arguments, at run time (not traced: dynamo
    cannot hash through the problem cache). `plain`: _is_plain of the arguments, when the
    caller has it already."""
    grouped = k.shape[1] != q.shape[1]
    if plain is None:
        plain = _is_plain(window_size, alignment, softcap, sink)
    if plain and not grouped:
        return AttentionProblem.of(causal)  # the plain call: shared instances
    return AttentionProblem.of(causal, window_size, alignment, softcap, sink is not None, grouped)


def flash_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, window_size=(-1, -1),
                    alignment="top_left", softcap=0.0, sink=None, deterministic=False):
    """softmax(q k^T * scale) v with the semantics of torch's scaled_dot_product_attention.

    q: (B, N, Sq, D); k: (B, Nkv, Sk, D), v: (B, Nkv, Sk, Dv) with Nkv dividing N
    (grouped-query attention: query head h reads key/value head h // (N / Nkv)); fp16 or bf16
    on a Hopper GPU; 1 <= D, Dv <= 256 (v may have a head dim of its own, e.g. DeepSeek's
    (192, 128)), forward and gradients (cute_flash.head_dims: a D or Dv that is not a multiple
    of 8 costs one padded copy of the tensors that have it). float32: on tensor cores at
    torch.get_float32_matmul_precision()'s accuracy (cute_flash.float32): one TF32 pass under
    "high" / "medium", float32-accurate split operands (3xTF32, fp16 scaled halves) under
    "highest", D <= 256; gradients likewise (above D = 128 the scaled halves at either precision,
    in 128-column chunks).
    Under torch.autocast("cuda") they are cast to the autocast dtype first, as SDPA does.
    The mask is a band around the diagonal: query i sees key j iff
    i + offset - left <= j <= i + offset + right, with window_size = (left, right) (-1:
    unbounded) and `causal` meaning right = 0; the diagonal's offset is 0 with
    alignment="top_left" (SDPA's is_causal) or Sk - Sq with "bottom_right" (flash-attn's and a
    KV cache's). A row that sees no key gives 0 and LSE -inf. `softcap` > 0 replaces scores s
    (after scaling) by softcap * tanh(s / softcap) (Gemma 2). `sink`: a float32 (N,) tensor
    of per-head logits that join every row's softmax denominator without a value (gpt-oss);
    differentiable. `softmax_scale` defaults to 1/sqrt(D). deterministic=True: the backward
    adds dQ in a fixed order, bitwise reproducible (as under
    torch.use_deterministic_algorithms(True)). Returns O (B, N, Sq, Dv) in the input dtype,
    and with return_lse=True also the natural-log LSE (B, N, Sq) in float32.
    """
    if type(window_size) is list:
        window_size = tuple(window_size)
    plain = _is_plain(window_size, alignment, softcap, sink)
    if not plain:
        check_variant(causal, window_size, alignment, softcap, sink,
                      q.shape[1] if isinstance(q, torch.Tensor) and q.dim() else 0,
                      q.device if isinstance(q, torch.Tensor) else None)
    if isinstance(q, torch.Tensor) and q.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        # As SDPA under autocast (and the op's autocast rule): attention runs in the autocast
        # dtype. Here too, because the eager fast path below does not go through the op.
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    needs_grad = torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False) or getattr(sink, "requires_grad", False)
    )
    eager_cuda = (
        isinstance(q, torch.Tensor) and q.is_cuda and not torch.compiler.is_compiling()
        and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    )
    if _needs_padded_head_dims(q, k, v):
        return _padded_head_dims(q, k, v, softmax_scale, return_lse, causal=causal, window_size=window_size,
                                 alignment=alignment, softcap=softcap, sink=sink, deterministic=deterministic)
    if _packs_query_heads(q, k, v, sink):
        return _packed_decode(q, k, v, causal, softmax_scale, return_lse, window_size, alignment, softcap,
                              deterministic)
    if eager_cuda:
        if q.dim() != 4 or k.dim() != 4:
            validate(q, k, v, softmax_scale)  # raises, naming the tensor
        splits = 1 if needs_grad else _split_parts(q, k, v, window_size)
        if splits > 1:
            problem = AttentionProblem.of(causal, window_size, alignment, softcap, sink is not None, grouped_rows=True,
                                          split_keys=True)
        elif _groups_query_rows(q, k, v, sink):
            problem = AttentionProblem.of(causal, window_size, alignment, softcap, sink is not None, grouped_rows=True)
        elif _heads_in_rows(q, k, v, causal, window_size):
            problem = _rows_problem(problem_of(q, k, causal, window_size, alignment, softcap, sink, plain), q, k)
        else:
            problem = problem_of(q, k, causal, window_size, alignment, softcap, sink, plain)
        plan = plan_for(q, k, v, problem, softmax_scale, splits)
        if needs_grad:
            out, lse = _AttentionFunction.apply(q, k, v, sink, plan, bool(deterministic))
        else:
            out, lse = plan.run(q, k, v, return_lse, sink)
    else:
        scale = validate(q, k, v, softmax_scale)
        out, lse = torch.ops.cute_flash.flash_attention_fwd(
            q, k, v, bool(causal), scale, int(window_size[0]), int(window_size[1]), alignment == "bottom_right",
            float(softcap), sink, bool(deterministic))
    return (out, lse) if return_lse else out


# Packed decode runs one CTA per (batch, key/value head): below this many it leaves most SMs
# idle and one row per CTA is faster (perf/variants.py, H100, 32/8 heads, D = 128: B = 1
# 0.099 vs 0.053 ms unpacked at Sk = 4096, equal at 32768; B = 8 (64 units) 0.085 vs 0.096,
# 0.38 vs 0.70; B = 64 0.37 vs 0.74, 3.03 vs 6.35). Long caches with few units want split-KV.
PACKED_DECODE_MIN_UNITS = 64


def _packs_query_heads(q, k, v, sink) -> bool:
    """One query row per head with grouped key/value heads (a decode step) and enough
    (batch, key/value head) units: the group's query heads become the rows of one tile (see
    _packed_decode)."""
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[2] == 1 and sink is None
            and _groups_enough_units(q, k, v))


def _grouped_heads(q, k, v) -> bool:
    """Grouped key/value heads: fewer than q's, dividing them, k's and v's equal (4-D)."""
    return 0 < k.shape[1] < q.shape[1] and q.shape[1] % k.shape[1] == 0 and v.shape[1] == k.shape[1]


def _groups_enough_units(q, k, v) -> bool:
    """Keys, grouped key/value heads (_grouped_heads) and at least PACKED_DECODE_MIN_UNITS
    (batch, key/value head) units; q, k, v 4-D."""
    return k.shape[2] > 0 and _grouped_heads(q, k, v) and q.shape[0] * k.shape[1] >= PACKED_DECODE_MIN_UNITS


def _groups_query_rows(q, k, v, sink) -> bool:
    """A few query positions (2 .. GROUPED_ROWS_MAX_SQ, or 1 with a sink: the decode step's
    packing takes none) with grouped key/value heads, 16-bit, and enough (batch, key/value
    head) units (PACKED_DECODE_MIN_UNITS, as the decode step's packing): a key/value head's
    group of query heads at every position run as one tile's rows (problem.grouped_rows; each
    row takes its query head's sink), so one CTA reads the keys once for the group (with
    gradients the backward runs the ordinary grouped kernels: _AttentionFunction); q and k
    validated 4-D."""
    return ((1 < q.shape[2] or sink is not None) and q.shape[2] <= GROUPED_ROWS_MAX_SQ and v.dim() == 4
            and q.dtype in SIXTEEN_BIT and _groups_enough_units(q, k, v))


def _heads_in_rows(q, k, v, causal, window_size) -> bool:
    """Prefill with grouped key/value heads and a band (causal or a window): a group's query
    heads at each position run as consecutive rows of one tile (problem.row_heads), so that
    a tile's key range follows block_m / G positions instead of block_m and each key block
    is loaded once for the group. Measured at one clock (perf/NOTES.md, thirty-eighth
    session, H200): gpt-oss's 128-key window 1.21x, its causal layers (D = 64, 64 / 8 heads)
    1.03x, D = 128 and 256 causal and 4096-key windows 1.00-1.005x; without a band
    (non-causal) no gain, so those stay one query head per tile. 16-bit, more than
    GROUPED_ROWS_MAX_SQ positions (fewer run as grouped rows or packed decode steps), and a
    group dividing 64 (every forward tile's block_m is a multiple of 64: rules.row_heads).
    q, k validated 4-D."""
    return (v.dim() == 4 and q.dtype in SIXTEEN_BIT and (causal or tuple(window_size) != (-1, -1))
            and q.shape[2] > GROUPED_ROWS_MAX_SQ and _grouped_heads(q, k, v) and 64 % (q.shape[1] // k.shape[1]) == 0)


def _rows_problem(problem: AttentionProblem, q, k) -> AttentionProblem:
    """`problem` (grouped heads) with each group's query heads as its tiles' rows instead
    (problem.row_heads), for a call _heads_in_rows takes: the eager entry point, the custom
    op and the SDPA route build it here, the op on every call (hence cached)."""
    return problem.with_group_in_rows(q.shape[1] // k.shape[1])


def _split_parts(q, k, v, window_size) -> int:
    """Into how many parts a decode-like step without gradients splits each sequence's keys
    (split-KV, 1: none): 1 .. GROUPED_ROWS_MAX_SQ query positions, 16-bit, key/value heads
    dividing q's, and too few (batch, key/value head) units for the SMs over a long key range
    (kvcache.decode_splits, the KV cache's rule: at B = 1 with 8 key/value heads a step of one
    CTA per unit read 32k keys at 0.39 TB/s against cuDNN's 2.4, perf/variants.py). The step
    then runs as grouped rows (a group's query heads at every position as one tile's rows), its
    parts merged by kernels/split_merge.py. q, k validated 4-D."""
    if not (v.dim() == 4 and q.numel() > 0 and 1 <= q.shape[2] <= GROUPED_ROWS_MAX_SQ
            and q.dtype in SIXTEEN_BIT and k.shape[2] > 0 and 0 < k.shape[1] <= q.shape[1]
            and q.shape[1] % k.shape[1] == 0 and v.shape[1] == k.shape[1] and k.shape[0] == q.shape[0]):
        return 1
    from cute_flash.kvcache import decode_splits, walked_keys

    return decode_splits(0, q.shape[0] * k.shape[1], walked_keys(k.shape[2], window_size, q.shape[2]), q.device,
                         torch.cuda.is_current_stream_capturing())


def _packed_decode(q, k, v, causal, softmax_scale, return_lse, window_size, alignment, softcap, deterministic):
    """Grouped-query attention with Sq = 1, packed: q (B, N, 1, D) viewed as (B, Nkv, N / Nkv, D)
    -- the query heads of a group as the rows of one tile -- so that one CTA reads each key/value
    head once for its whole group, instead of N / Nkv CTAs reading it for one row each.

    Exact because with one query row every mask is a key range: the row's band [off - left,
    off + right] (off = 0 top-left, Sk - 1 bottom-right) becomes a slice of k and v (a view) and
    the packed call runs unmasked. Views only, so autograd flows back through them (sinks, per
    query head, stay on the unpacked path)."""
    validate(q, k, v, softmax_scale)  # errors name the caller's tensors
    batch, heads, _, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    left, right = window_size
    right = 0 if causal else right
    off = seqlen_k - 1 if alignment == "bottom_right" else 0
    start = max(off - left, 0) if left >= 0 else 0
    end = min(off + right + 1, seqlen_k) if right >= 0 else seqlen_k
    k, v = k[:, :, start:end], v[:, :, start:end]
    packed = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    out, lse = flash_attention(packed, k, v, softmax_scale=softmax_scale, return_lse=True, softcap=softcap,
                               deterministic=deterministic)
    out = out.reshape(batch, heads, 1, v.shape[-1])
    lse = lse.reshape(batch, heads, 1)
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    learnable_sink=None, deterministic=False, return_lse=False, dropout_p=0.0, num_splits=1,
                    pack_gqa=None):
    """flash-attn's entry point (flash-attn-4's names): q (B, Sq, N, D), k (B, Sk, Nkv, D) and
    v (B, Sk, Nkv, Dv), causal and windows aligned bottom-right, out (B, Sq, N, Dv); with
    return_lse=True also the LSE (B, N, Sq) float32. The same kernels as flash_attention, on
    transposed views (no copies). deterministic=True makes the backward bitwise reproducible
    (as torch.use_deterministic_algorithms does for every call).

    flash-attn's conventions (cute_flash.compat): everything after the tensors by keyword;
    window_size sides may be None (unbounded); learnable_sink may be float16 or bfloat16;
    dropout_p (flash-attn 2) must be 0; num_splits and pack_gqa (flash-attn-4's scheduling
    hints) are accepted and left to cute_flash, which decides both itself."""
    compat.no_dropout(dropout_p)
    compat.check_layout(q, k, v)
    views = [t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (q, k, v)]
    out, lse = flash_attention(*views, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                               window_size=compat.window(window_size), alignment="bottom_right", softcap=softcap,
                               sink=compat.sink(learnable_sink), deterministic=deterministic)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
