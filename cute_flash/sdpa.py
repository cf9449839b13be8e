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
# "ours" or the reason the latest call went to PyTorch's kernel (tests and users read it).
last_decision = None
_MAX_ROUTES = 4096  # ever-changing shapes must not grow the routing cache without bound


def registry_available() -> bool:
    import torch.nn.attention as attention

    return hasattr(attention, "register_flash_attention_impl")


def not_served_reason(query, key, value, dropout_p, is_causal, return_debug_mask):
    """None when cute_flash runs this call; otherwise why PyTorch's flash kernel does."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (cute_flash has no dropout)"
    if return_debug_mask:
        return "return_debug_mask=True"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs that are not 4-D (B, N, S, D)"
    if query.dtype not in SUPPORTED_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if len(head_dims) != 1 or query.shape[-1] % ROW_ALIGN or not 0 < query.shape[-1] <= MAX_BACKWARD_HEAD_DIM:
        return (f"head dims {sorted(head_dims)} (cute_flash serves one multiple of {ROW_ALIGN} up to "
                f"{MAX_BACKWARD_HEAD_DIM})")
    if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[1] != value.shape[1]:
        return "mismatched batch sizes, or k and v with different head counts"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        return "key/value heads that do not divide the query heads"
    if key.shape[2] != value.shape[2]:
        return "k and v of different lengths"
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "a last dimension that is not contiguous"
    # Asked once per call signature (the override caches its routes), so uncached here.
    if query.device.type != "cuda" or torch.cuda.get_device_capability(query.device)[0] != 9:
        return "not a Hopper GPU"
    return None


def sdpa_problem(query, key, is_causal) -> AttentionProblem:
    """The op's semantics: causal aligned bottom-right (which is top-left when Sq == Sk: the
    plain causal kernels serve those), key/value heads grouped when fewer."""
    alignment = "bottom_right" if is_causal and query.shape[2] != key.shape[2] else "top_left"
    return AttentionProblem.of(is_causal, alignment=alignment, grouped=key.shape[1] != query.shape[1])


class _Served:
    """A signature cute_flash runs: its plan, and the forward's outputs that carry nothing
    for a dropout-free call (philox seed and offset, the empty debug mask), shaped as the
    op's meta function says, made once per signature and never written (the backward
    ignores them without dropout)."""

    __slots__ = ("plan", "seed", "offset", "debug_mask")

    def __init__(self, plan, device, dtype):
        self.plan = plan
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
        self.library = torch.library.Library("aten", "IMPL", "CUDA")
        self.library.impl(_FORWARD, self._forward, "CUDA", with_keyset=True)
        self.library.impl(_BACKWARD, self._backward, "CUDA", with_keyset=True)

    def remove(self):
        self.library = None

    def _route(self, query, key, value, is_causal, scale):
        """What runs a dropout-free call without a debug mask: a _Served (our plan), or the
        reason torch's kernel does (a str); cached per call signature."""
        from cute_flash.api import call_signature, plan_for

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
                route = _Served(plan, query.device, query.dtype)
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
        out, lse = route.plan.run(query, key, value, True)
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
