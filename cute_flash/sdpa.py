"""cute_flash behind torch.nn.functional.scaled_dot_product_attention's flash backend.

PyTorch (2.10+) lets a library replace the kernels of SDPA's flash backend through a registry
in torch.nn.attention. Importing cute_flash registers itself there under the name
"cute_flash"; activating it stays the user's choice:

    import cute_flash, torch
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl, sdpa_kernel
    activate_flash_attention_impl("cute_flash")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):   # see below
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

Activation overrides the CUDA kernels of the two aten ops that SDPA's flash backend calls,
`_scaled_dot_product_flash_attention` and its `_backward` (eager, autograd and torch.compile:
the ops keep their aten autograd formula and meta functions, so the outputs are laid out as
those promise: out and the gradients like their inputs, `empty_like`).
`torch.nn.attention.restore_flash_attention_impl()` (2.11+) gives torch's own kernels back.

It also overrides the flash kernels beneath, `_flash_attention_forward` and `_backward`, for
their ragged calls (packed (total, N, D) tensors with cumulative lengths, served by the packed
kernels of cute_flash.varlen with flash-attn's bottom-right alignment, windows and seqused_k):
what torch's `torch.nn.attention.varlen.varlen_attn` and SDPA over nested (jagged) tensors
run. Their dense calls come only from torch's own SDPA kernel (for what is not served above)
and stay torch's (`ragged_not_served_reason`).

SDPA picks its backend before the flash op is reached: on an H100 with a recent cuDNN,
torch 2.11 puts cuDNN first, so plain calls never reach the flash backend; choose it with
`sdpa_kernel(SDPBackend.FLASH_ATTENTION)` (or deprioritise cuDNN).

What is served here, and what is not: calls cute_flash can run exactly (fp16/bf16 on a Hopper
GPU, one head dim for q, k and v that is a multiple of 8 up to head_dims.MAX_BACKWARD_HEAD_DIM
(the op's own limit is 8-aligned head dims; its backward must run what its forward ran), key
/value heads dividing the query heads (SDPA's enable_gqa), no dropout, no debug mask; causal
with Sq != Sk is aligned bottom-right, as the op does) run our kernels.
Everything else goes to PyTorch's own flash kernel, unchanged, never to a wrong result:
dropout and other head dims. The forward and
the backward decide from the same arguments, so each backward runs the implementation its
forward ran. `not_served_reason(...)` states the rule; `last_decision` says what the latest
call did.
"""

import torch

from cute_flash.kernels.problem import AttentionProblem
from cute_flash.head_dims import MAX_BACKWARD_HEAD_DIM, ROW_ALIGN
from cute_flash.validation import SUPPORTED_DTYPES

NAME = "cute_flash"
_FORWARD = "_scaled_dot_product_flash_attention"
_BACKWARD = "_scaled_dot_product_flash_attention_backward"
# The flash kernels beneath: torch's varlen_attn and nested-tensor SDPA call them with
# cumulative lengths (the ragged calls served here); the dense calls among them come from
# torch's own SDPA kernel, which runs only what cute_flash does not serve.
_RAGGED_FORWARD = "_flash_attention_forward"
_RAGGED_BACKWARD = "_flash_attention_backward"
# "ours" or the reason the latest call went to PyTorch's kernel (tests and users read it).
last_decision = None
_MAX_ROUTES = 4096  # ever-changing shapes must not grow the routing cache without bound


def registry_available() -> bool:
    import torch.nn.attention as attention

    return hasattr(attention, "register_flash_attention_impl")


def _call_reason(dropout_p, return_debug_mask):
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (cute_flash has no dropout)"
    if return_debug_mask:
        return "return_debug_mask=True"
    return None


def _tensors_reason(query, key, value, dims, layout):
    """The checks a dense (B, N, S, D) call and a ragged (total, N, D) call share: heads on
    dim 1 and the head dim last in both."""
    if query.dim() != dims or key.dim() != dims or value.dim() != dims:
        return f"inputs that are not {dims}-D {layout}"
    if query.dtype not in SUPPORTED_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if len(head_dims) != 1 or query.shape[-1] % ROW_ALIGN or not 0 < query.shape[-1] <= MAX_BACKWARD_HEAD_DIM:
        return (f"head dims {sorted(head_dims)} (cute_flash serves one multiple of {ROW_ALIGN} up to "
                f"{MAX_BACKWARD_HEAD_DIM})")
    if key.shape[1] != value.shape[1]:
        return "k and v with different head counts"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        return "key/value heads that do not divide the query heads"
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "a last dimension that is not contiguous"
    return None


def _device_reason(query):
    # Asked once per call signature (the override caches its routes), so uncached here.
    if query.device.type != "cuda" or torch.cuda.get_device_capability(query.device)[0] != 9:
        return "not a Hopper GPU"
    return None


def not_served_reason(query, key, value, dropout_p, is_causal, return_debug_mask):
    """None when cute_flash runs this call; otherwise why PyTorch's flash kernel does."""
    reason = _call_reason(dropout_p, return_debug_mask) or _tensors_reason(query, key, value, 4, "(B, N, S, D)")
    if reason is not None:
        return reason
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return "mismatched batch sizes"
    if key.shape[2] != value.shape[2]:
        return "k and v of different lengths"
    return _device_reason(query)


# The keyword arguments of aten::_flash_attention_forward a ragged call may carry, and which of
# them cute_flash runs: num_splits is a performance hint (the packed forward does not split).
_RAGGED_OPTIONS = {"scale", "window_size_left", "window_size_right", "seqused_k", "alibi_slopes", "block_table",
                   "num_splits"}


def ragged_not_served_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, options):
    """None when cute_flash runs a call of aten::_flash_attention_forward / _backward
    (options: its keyword arguments); otherwise why PyTorch's kernel does. Only ragged calls
    (cum_seq_q and cum_seq_k given: torch's varlen_attn, nested-tensor SDPA) are served here;
    dense ones come through _scaled_dot_product_flash_attention."""
    if cum_seq_q is None or cum_seq_k is None:
        return "a dense call (served through _scaled_dot_product_flash_attention)"
    unknown = sorted(name for name, value in options.items() if name not in _RAGGED_OPTIONS and value is not None)
    if unknown:
        return f"arguments cute_flash does not know: {', '.join(unknown)}"
    if options.get("alibi_slopes") is not None:
        return "alibi_slopes (cute_flash has no ALiBi)"
    if options.get("block_table") is not None:
        return "a paged KV cache (block_table)"
    reason = _call_reason(dropout_p, return_debug_mask) or _tensors_reason(query, key, value, 3, "(total, N, D)")
    if reason is not None:
        return reason
    if key.shape[0] != value.shape[0]:
        return "k and v of different lengths"
    return _device_reason(query)


def sdpa_problem(query, key, is_causal) -> AttentionProblem:
    """The op's semantics: causal aligned bottom-right (which is top-left when Sq == Sk: the
    plain causal kernels serve those), key/value heads grouped when fewer."""
    return AttentionProblem.of(is_causal, alignment=_alignment(query, key, is_causal),
                               grouped=key.shape[1] != query.shape[1])


def _alignment(query, key, is_causal) -> str:
    return "bottom_right" if is_causal and query.shape[2] != key.shape[2] else "top_left"


class _Served:
    """A signature cute_flash runs: its plan, and the forward's outputs that carry nothing
    for a dropout-free call (philox seed and offset, the empty debug mask), shaped as the
    op's meta function says, made once per signature and never written (the backward
    ignores them without dropout)."""

    __slots__ = ("plan", "split_plan", "rows_plan", "seed", "offset", "debug_mask")

    def __init__(self, plan, device, dtype, split_plan=None, rows_plan=None):
        self.plan = plan
        # A decode-like call with few (batch, head) units over a long key range: its keys
        # split across CTAs (api._split_parts), for calls that need no gradient (the backward
        # takes `plan`'s problem).
        self.split_plan = split_plan
        # Grouped heads over a causal band: the forward runs each group as its tiles' rows
        # (api._heads_in_rows); the backward takes `plan`'s grouped problem, on the same O and LSE.
        self.rows_plan = rows_plan
        self.seed = torch.zeros((2,), dtype=torch.uint64, device=device)
        self.offset = torch.zeros((), dtype=torch.uint64, device=device)
        self.debug_mask = torch.empty(0, dtype=dtype, device=device)


class _Override:
    """The two kernels and the PyTorch kernels they fall back to; `remove()` (called by the
    registry when another implementation is activated or on restore) drops the library,
    which unregisters them."""

    def __init__(self):
        forward_op = getattr(torch.ops.aten, _FORWARD).default
        backward_op = getattr(torch.ops.aten, _BACKWARD).default
        # Taken before overriding: calling the aten op from inside the override would recurse.
        self._torch_forward = torch.library.get_kernel(forward_op, "CUDA")
        self._torch_backward = torch.library.get_kernel(backward_op, "CUDA")
        # Call signature (api.call_signature) -> the plan that serves it, or the reason torch's
        # kernel does: the checks run once per signature, not per call (host time).
        self._routes = {}
        # (device, dtype) -> a _Served without a plan: the ragged forward's dropout-free outputs.
        self._ragged_outputs = {}
        self._torch_ragged_forward = torch.library.get_kernel(getattr(torch.ops.aten, _RAGGED_FORWARD).default,
                                                              "CUDA")
        self._torch_ragged_backward = torch.library.get_kernel(getattr(torch.ops.aten, _RAGGED_BACKWARD).default,
                                                               "CUDA")
        self.library = torch.library.Library("aten", "IMPL", "CUDA")
        self.library.impl(_FORWARD, self._forward, "CUDA", with_keyset=True)
        self.library.impl(_BACKWARD, self._backward, "CUDA", with_keyset=True)
        self.library.impl(_RAGGED_FORWARD, self._ragged_forward, "CUDA", with_keyset=True)
        self.library.impl(_RAGGED_BACKWARD, self._ragged_backward, "CUDA", with_keyset=True)

    def remove(self):
        self.library = None

    def _route(self, query, key, value, is_causal, scale):
        """What runs a dropout-free call without a debug mask: a _Served (our plan), or the
        reason torch's kernel does (a str); cached per call signature."""
        from cute_flash.api import _heads_in_rows, _rows_problem, _split_parts, call_signature, plan_for

        problem = sdpa_problem(query, key, is_causal)
        signature = call_signature(query, key, value, problem, scale)
        route = self._routes.get(signature)
        if route is None:
            reason = not_served_reason(query, key, value, 0.0, is_causal, False)
            if reason is not None:
                route = reason
            else:
                # scale None (a direct aten call) resolves to 1/sqrt(D) in the plan's validation.
                plan = plan_for(query, key, value, problem, scale)
                splits = _split_parts(query, key, value, (-1, -1))
                split_plan = None
                if splits > 1:
                    split_problem = AttentionProblem.of(problem.causal, alignment=_alignment(query, key, is_causal),
                                                        grouped_rows=True, split_keys=True)
                    split_plan = plan_for(query, key, value, split_problem, scale, splits)
                rows_plan = None
                if _heads_in_rows(query, key, value, problem.causal, (-1, -1)):
                    rows_plan = plan_for(query, key, value, _rows_problem(problem, query, key), scale)
                route = _Served(plan, query.device, query.dtype, split_plan, rows_plan)
            if len(self._routes) >= _MAX_ROUTES:
                self._routes.clear()
            self._routes[signature] = route
        return route

    def _forward(self, keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                 scale=None):
        global last_decision
        if dropout_p != 0.0 or return_debug_mask:
            route = not_served_reason(query, key, value, dropout_p, is_causal, return_debug_mask)
        else:
            route = self._route(query, key, value, is_causal, scale)
        if isinstance(route, str):
            last_decision = route
            return self._torch_forward.call_boxed(keyset, query, key, value, dropout_p, is_causal,
                                                  return_debug_mask, scale=scale)
        last_decision = "ours"
        plan = route.plan if route.rows_plan is None else route.rows_plan
        if route.split_plan is not None and not (torch.is_grad_enabled() and (
                query.requires_grad or key.requires_grad or value.requires_grad)):
            plan = route.split_plan
        out, lse = plan.run(query, key, value, True)
        return out, lse, None, None, query.shape[2], key.shape[2], route.seed, route.offset, route.debug_mask

    def _backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                  dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        global last_decision
        if dropout_p != 0.0:
            route = not_served_reason(query, key, value, dropout_p, is_causal, False)
        else:
            route = self._route(query, key, value, is_causal, scale)
        if isinstance(route, str):
            last_decision = route
            return self._torch_backward.call_boxed(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                                                   cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                                                   philox_offset, scale=scale)
        last_decision = "ours"
        from cute_flash import launch_bwd

        # Laid out like the inputs, as the op's meta function promises torch.compile.
        grads = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))
        plan = route.plan
        return launch_bwd.backward(query, key, value, out, grad_out, logsumexp, plan.problem, plan.scale,
                                   grads=grads)

    def _ragged_forward(self, keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, **options):
        global last_decision
        reason = ragged_not_served_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask,
                                          options)
        if reason is not None:
            last_decision = reason
            return self._torch_ragged_forward.call_boxed(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                                         dropout_p, is_causal, return_debug_mask, **options)
        last_decision = "ours"
        from cute_flash import launch_fwd

        seqused_k = options.get("seqused_k")
        problem, scale = _ragged_problem(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, options,
                                         seqused_k)
        # Laid out like the query, as the op's meta function promises torch.compile.
        out, lse = launch_fwd.forward_packed(query, key, value, cum_seq_q, cum_seq_k, seqused_k, int(max_q),
                                             int(max_k), problem, scale, out=torch.empty_like(query))
        aux = self._ragged_outputs.get((query.device, query.dtype))
        if aux is None:
            aux = self._ragged_outputs[(query.device, query.dtype)] = _Served(None, query.device, query.dtype)
        return out, lse, aux.seed, aux.offset, aux.debug_mask

    def _ragged_backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                         max_k, dropout_p, is_causal, rng_state, unused, **options):
        global last_decision
        # Decided from the arguments the forward's decision read too (those the backward has).
        reason = ragged_not_served_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p, False, options)
        if reason is not None:
            last_decision = reason
            return self._torch_ragged_backward.call_boxed(keyset, grad_out, query, key, value, out, logsumexp,
                                                          cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                                          rng_state, unused, **options)
        last_decision = "ours"
        from cute_flash import launch_bwd

        problem, scale = _ragged_problem(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, options,
                                         None)
        grads = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))
        batch = (cum_seq_q, cum_seq_k, None, int(max_q), int(max_k))
        dq, dk, dv, _ = launch_bwd.backward_packed(query, key, value, out, grad_out, logsumexp, batch, problem, scale,
                                                   grads=grads)
        return dq, dk, dv


def _ragged_problem(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, options, seqused_k):
    """(problem, scale) of a served ragged call, checked as flash_attention_varlen checks its
    arguments. flash-attn's conventions: causal and windows aligned bottom-right per sequence,
    a window side of None or -1 unbounded, causal forcing the right side to 0."""
    from cute_flash.validation import check_variant
    from cute_flash.varlen import packed_problem, validate_packed

    left, right = (options.get(name) for name in ("window_size_left", "window_size_right"))
    left = -1 if left is None else int(left)
    right = 0 if is_causal else (-1 if right is None else int(right))
    check_variant(is_causal, (left, right), "bottom_right", 0.0, None, query.shape[1], query.device)
    scale = validate_packed(query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), options.get("scale"),
                            seqused_k)
    return packed_problem(query, key, is_causal, left, right, True, 0.0, None, seqused_k), scale


def register() -> bool:
    """Register "cute_flash" with torch's SDPA flash registry (done on import); False when
    this torch has none (before 2.10)."""
    if not registry_available():
        return False
    import torch.nn.attention as attention

    if NAME not in attention.list_flash_attention_impls():
        attention.register_flash_attention_impl(NAME, register_fn=_Override)
    return True


def activate() -> None:
    """torch.nn.attention.activate_flash_attention_impl("cute_flash"), with a clear error on
    a torch without the registry."""
    if not registry_available():
        raise RuntimeError(
            f"torch {torch.__version__} has no SDPA flash-attention registry "
            "(torch.nn.attention.register_flash_attention_impl, torch 2.10 or later): "
            "call cute_flash.flash_attention directly, or upgrade torch"
        )
    register()
    import torch.nn.attention as attention

    attention.activate_flash_attention_impl(NAME)
