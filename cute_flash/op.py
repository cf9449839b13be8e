"""The torch ops: `cute_flash::flash_attention_fwd` and `cute_flash::flash_attention_bwd`,
torch.library custom ops, the first differentiable through the second.

Registering them (rather than calling the kernels from Python directly) lets torch.compile
and meta tensors trace through via the fake implementations, and gives autograd a node that
saves only q, k, v, O and the LSE (O(S) memory; P is recomputed in the backward).

The schemas take the problem's primitive fields (causal, window, alignment, softcap) and the
optional sink tensor; the ops build the AttentionProblem (kernels/problem.py) that the
launch, config and compile layers take.
"""

import torch

from cute_flash.api import _heads_in_rows, _rows_problem, problem_of
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.validation import check_kernel_device


def _problem(q, k, causal, window_left, window_right, bottom_right, softcap, sink) -> AttentionProblem:
    """api.problem_of of the schema's primitives."""
    return problem_of(q, k, causal, (window_left, window_right), "bottom_right" if bottom_right else "top_left",
                      softcap, sink)


@torch.library.custom_op("cute_flash::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, window_left: int = -1,
    window_right: int = -1, bottom_right: bool = False, softcap: float = 0.0, sink: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_kernel_device(q)
    from cute_flash import launch_fwd  # the compile path, so only when a kernel is needed

    problem = _problem(q, k, causal, window_left, window_right, bottom_right, softcap, sink)
    if _heads_in_rows(q, k, v, causal, (window_left, window_right)):
        # As the eager entry point: a banded grouped prefill runs the group as each tile's rows
        # (same O and LSE layout, so the backward op runs the grouped problem on them).
        problem = _rows_problem(problem, q, k)
    return launch_fwd.forward(q, k, v, problem, softmax_scale, sink)


@flash_attention_fwd.register_fake
def _flash_attention_fwd_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, bottom_right=False,
                              softcap=0.0, sink=None, deterministic=False):
    batch, heads, seqlen_q, _ = q.shape
    out = q.new_empty((batch, heads, seqlen_q, v.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("cute_flash::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int = -1,
    window_right: int = -1, bottom_right: bool = False, softcap: float = 0.0, sink: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink is an empty tensor without a sink."""
    check_kernel_device(q)
    from cute_flash import launch_bwd

    problem = _problem(q, k, causal, window_left, window_right, bottom_right, softcap, sink)
    dq, dk, dv, dsink = launch_bwd.backward_with_sink(q, k, v, out, dout, lse, problem, softmax_scale, sink,
                                                      dlse=dlse, deterministic=deterministic)
    return dq, dk, dv, dsink if dsink is not None else q.new_empty((0,), dtype=torch.float32)


@flash_attention_bwd.register_fake
def _flash_attention_bwd_fake(dout, dlse, q, k, v, out, lse, causal, softmax_scale, window_left=-1, window_right=-1,
                              bottom_right=False, softcap=0.0, sink=None, deterministic=False):
    from cute_flash.launch_bwd import new_gradients

    # Same layout as the real backward (not empty_like: strided inputs get contiguous grads).
    dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
    return (*new_gradients(q, k, v), dsink)


_PRIMITIVES = ("causal", "softmax_scale", "window_left", "window_right", "bottom_right", "softcap")


def _setup_context(ctx, inputs, output):
    q, k, v, *primitives, sink, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sink)
    ctx.primitives, ctx.deterministic = primitives, deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.cute_flash.flash_attention_bwd(
        dout, dlse, q, k, v, out, lse, *ctx.primitives, sink, ctx.deterministic
    )
    return dq, dk, dv, *(None for _ in _PRIMITIVES), dsink if sink is not None else None, None


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _forward_under_autocast(_keyset, q, k, v, *args):
    """Under torch.autocast("cuda"), q, k and v run in the autocast dtype, as SDPA's do (RoPE
    in float32 hands attention float32 q and k). torch.library.register_autocast casts to a
    dtype fixed at registration; this reads the active one."""
    dtype = torch.get_autocast_dtype("cuda")
    q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)):
        return flash_attention_fwd(q, k, v, *args)


_autocast_library = torch.library.Library("cute_flash", "FRAGMENT")
_autocast_library.impl("flash_attention_fwd", _forward_under_autocast, "AutocastCUDA", with_keyset=True)
