"""Packed variable-length batches ("varlen"): the public entry points, their checks and their
torch op.

The sequences of a batch lie one after the other along one token axis: q (total_q, N, D),
k and v (total_k, Nkv, D), sequence b owning rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q
(and of k with cu_seqlens_k). The kernels read the offsets on the device
(kernels/sequences.py): no host sync and one launch for the whole batch.

What is checked on every call is what the host knows without a sync (shapes, dtypes, devices,
the max lengths). The offsets' values are the caller's contract: int32, starting at 0,
non-decreasing, ending at the totals, no sequence longer than max_seqlen_*, and
seqused_k[b] <= the sequence's keys. validate=True (or CUTE_FLASH_VALIDATE=1) checks them
too, at the cost of a device sync. Without it, values that break the contract give wrong
rows, never an access outside the tensors (the kernels clamp every offset into them) and
never a hang (the backward's completion counts do not depend on them). max_seqlen_q /
max_seqlen_k only pick the tile config: the grids are sized from the totals.

Keys in pages (a paged KV cache, as vLLM keeps it; inference, no gradients): k and v
(num_pages, page_size, Nkv, D) with block_table (B, max_pages) int32 listing sequence b's
pages in order, seqused_k[b] its keys (cu_seqlens_k is not read and may be None): sequence b's
key j lies in page block_table[b, j // page_size], row j % page_size (kernels/key_pages.py).
validate=True also checks the table's pages in use and the lengths against the pages.
"""

import os
from dataclasses import dataclass

import torch

from cute_flash import compat, varlen_plan
from cute_flash.head_dims import aligned_head_dim, with_aligned_rows
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.torch_helpers import batch_of_one
from cute_flash.validation import (
    DENSE_DTYPES,
    SUPPORTED_DTYPES,
    check_int32_vector,
    check_kernel_device,
    check_variant,
    validate,
)


def _check_max_seqlen(name, value, total):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if value == 0 and total > 0:
        raise ValueError(f"{name} is 0, but the packed tensor has {total} rows (some sequence is longer)")


def validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    seqused_k=None, block_table=None, dtypes=DENSE_DTYPES) -> float:
    """The host-side checks of a packed call (no device sync); returns the softmax scale. With
    block_table, k and v are pages (num_pages, page_size, Nkv, D) (the module's docstring),
    16-bit only (a KV cache's); packed rows may be float32 too (the forward on the scaled
    halves, cute_flash.float32)."""
    if block_table is not None:
        return _validate_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               seqused_k, block_table)
    for name, t in zip(("q", "k", "v"), (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total tokens, heads, head_dim) in a packed batch, "
                             f"got {t.dim()} with shape {tuple(t.shape)}")
    if q.shape[2] != k.shape[2]:
        # v may have a head dim of its own (cute_flash.head_dims).
        raise ValueError(f"q and k must have the same head dim (dim 2), got q={q.shape[2]}, k={k.shape[2]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same total tokens and heads (dims 0, 1), got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    # dtypes, devices, head counts, strides, the head dim's range and the scale: as dense
    # calls check them, on the (1, N, total, D) views the kernels take.
    scale = validate(*(batch_of_one(t) for t in (q, k, v)), softmax_scale, dtypes)
    check_int32_vector("cu_seqlens_q", cu_seqlens_q, None, q.device)
    if cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must have B + 1 >= 2 entries, got {cu_seqlens_q.shape[0]}")
    check_int32_vector("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], q.device)
    if seqused_k is not None:
        check_int32_vector("seqused_k", seqused_k, cu_seqlens_q.shape[0] - 1, q.device)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0])
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0])
    return scale


def _validate_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, seqused_k,
                    block_table) -> float:
    """validate_packed for keys in pages: k and v (num_pages, page_size, Nkv, D), seqused_k
    required, cu_seqlens_k unread (None or the usual (B + 1,) offsets)."""
    from cute_flash.kvcache import _check_page_table

    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be pages (num_pages, page_size, Nkv, D) with block_table, got {shape}")
        if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(f"{name}'s pages must lie one after the other (stride(0) = page_size x stride(1)), got "
                             f"strides {t.stride()}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same pages and heads (dims 0-2), got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    if seqused_k is None:
        raise ValueError("keys in pages (block_table) need seqused_k: each sequence's number of keys")
    rows = [paged_rows(t) for t in (k, v)]
    scale = validate_packed(q, *rows, cu_seqlens_q, cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k, softmax_scale, seqused_k, dtypes=SUPPORTED_DTYPES)
    _check_page_table(block_table, cu_seqlens_q.shape[0] - 1, k, q.device)
    return scale


def paged_rows(pages: torch.Tensor) -> torch.Tensor:
    """Pages (num_pages, page_size, Nkv, D) as the packed key rows (num_pages * page_size, Nkv,
    D) the kernels take (a view: _validate_paged checks that the pages lie one after the other)."""
    return pages.flatten(0, 1)


def check_paged_values(seqused_k, block_table, num_pages, page_size):
    """The contract on a paged call's lengths and pages (a device sync): what validate=True adds."""
    pages = block_table.tolist()
    for b, used in enumerate(seqused_k.tolist()):
        if not 0 <= used <= len(pages[b]) * page_size:
            raise ValueError(f"seqused_k[{b}] = {used} is outside [0, {len(pages[b]) * page_size}] (the keys its "
                             f"{len(pages[b])} pages of {page_size} hold)")
        for column, page in enumerate(pages[b][:-(-used // page_size)]):
            if not 0 <= page < num_pages:
                raise ValueError(f"block_table[{b}, {column}] = {page} is outside the {num_pages} pages")


def check_packed_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, seqused_k=None):
    """The contract on the offsets' values (a device sync): what validate=True adds (cu_seqlens_k
    None: keys in pages, check_paged_values)."""
    for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        if cu is None:
            continue
        values = cu.tolist()
        if values[0] != 0 or values[-1] != total:
            raise ValueError(f"{name} must start at 0 and end at the packed tensor's {total} rows, "
                             f"got {values[0]} ... {values[-1]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if min(lengths) < 0:
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if max(lengths) > longest:
            raise ValueError(f"a sequence has {max(lengths)} rows in {name}, more than its max_seqlen ({longest})")
    if seqused_k is not None:
        used, capacity = seqused_k.tolist(), (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        bad = [b for b, (u, c) in enumerate(zip(used, capacity)) if not 0 <= u <= c]
        if bad:
            raise ValueError(f"seqused_k[{bad[0]}] = {used[bad[0]]} is outside [0, {capacity[bad[0]]}] "
                             "(the sequence's keys in cu_seqlens_k)")


def _validating(validate_values) -> bool:
    """Whether to check the offsets' (lengths', tables') values now: validate=True or
    CUTE_FLASH_VALIDATE=1 asked for it, and a device sync can happen. Code that torch.compile
    traces skips it (its values are not known there); under CUDA graph capture, whose stream
    cannot sync, asking for it is an error that says so."""
    if not (bool(validate_values) or os.environ.get("CUTE_FLASH_VALIDATE", "") not in ("", "0")):
        return False
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("validate=True (or CUTE_FLASH_VALIDATE=1) checks the offsets' and lengths' values with a "
                           "device sync, which CUDA graph capture does not allow: validate in an eager call before "
                           "capturing")
    return True


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, return_lse=False, window_size=(-1, -1), alignment="top_left",
                           softcap=0.0, sink=None, seqused_k=None, deterministic=False, validate=False,
                           block_table=None):
    """flash_attention over a packed batch: q (total_q, N, D), k (total_k, Nkv, D) and v
    (total_k, Nkv, Dv) (Dv = D or v's own, as flash_attention), or with block_table ((B,
    max_pages) int32) k and v in pages (num_pages, page_size, Nkv, D / Dv) and seqused_k the
    keys per sequence (the module's docstring; no gradients);
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:
    cu_seqlens_k[b + 1] of k and v (int32 (B + 1,) tensors on q's device); with seqused_k
    ((B,) int32) only its first seqused_k[b] keys. Masks, softcap and sinks as in
    flash_attention, per sequence. max_seqlen_q / max_seqlen_k: the longest sequence's
    lengths (ints; they pick the tile config). Returns out (total_q, N, Dv)
    and with return_lse=True the LSE (N, total_q) float32. validate=True checks the offsets'
    values (a device sync; see the module's docstring for the contract without it).
    Differentiable in q, k, v and sink; deterministic=True: a bitwise reproducible backward."""
    if type(window_size) is list:
        window_size = tuple(window_size)
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, sink))
    plan = _eager_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                       window_size, alignment, softcap, sink, seqused_k, validate, block_table)
    if plan is not None:
        if needs_grad:
            out, lse = _PackedAttentionFunction.apply(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, plan,
                                                      bool(deterministic))
        else:
            out, lse = plan.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink)
        return (out, lse) if return_lse else out
    check_variant(causal, window_size, alignment, softcap, sink,
                  q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0,
                  q.device if isinstance(q, torch.Tensor) else None)
    if isinstance(q, torch.Tensor) and q.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    scale = validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                            seqused_k, block_table)
    page_size = 0
    if block_table is not None:
        if needs_grad:
            raise ValueError("keys in pages (block_table) are a KV cache, for inference: no gradients (call under "
                             "torch.no_grad(), or pass the keys as packed rows)")
        page_size, num_pages = k.shape[1], k.shape[0]
        k, v = paged_rows(k), paged_rows(v)
        cu_seqlens_k = None  # not read: a paged sequence's keys start at its first page
    if _validating(validate):
        check_packed_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                            seqused_k if block_table is None else None)
        if block_table is not None:
            check_paged_values(seqused_k, block_table, num_pages, page_size)
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q  # an int32 tensor of B + 1 entries the kernels never read
    value_head_dim = v.shape[-1]
    # As flash_attention: zero columns up to a row TMA can describe (cute_flash.head_dims);
    # float32 all three to the wider (its operand pass takes one head dim, as in cute_flash.api).
    widths = (aligned_head_dim(q.shape[-1]),) * 2 + (aligned_head_dim(value_head_dim),)
    if q.dtype == torch.float32:
        widths = (max(widths),) * 3
    q, k, v = (with_aligned_rows(t, width) for t, width in zip((q, k, v), widths))
    bottom_right = alignment == "bottom_right"
    if needs_grad and q.is_cuda and not torch.compiler.is_compiling():
        check_kernel_device(q)
        problem = packed_problem(q, k, causal, window_size[0], window_size[1], bottom_right, softcap, sink, seqused_k)
        call = _EagerCall(scale, problem, (int(max_seqlen_q), int(max_seqlen_k)))
        out, lse = _PackedAttentionFunction.apply(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, call,
                                                  bool(deterministic))
    else:
        out, lse = packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
                                  scale, window_size, bottom_right, softcap, sink, deterministic,
                                  direct=not needs_grad and q.is_cuda, page_table=block_table, page_size=page_size)
    out = out[..., :value_head_dim]
    return (out, lse) if return_lse else out


def _eager_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
                alignment, softcap, sink, seqused_k, validate_values, block_table):
    """The recorded plan (cute_flash.varlen_plan) for an eager CUDA call of packed rows, checked
    on its signature's first call; None where the general path runs: keys in pages, the value
    checks (validate), autocast, tracing, and the calls make_plan leaves to it."""
    if (block_table is not None or not isinstance(q, torch.Tensor) or not q.is_cuda or q.dtype == torch.float32
            or torch.compiler.is_compiling() or torch.is_autocast_enabled("cuda") or _validating(validate_values)):
        return None  # (float32: the operand pass of cute_flash.float32 before the kernel)
    try:
        key = varlen_plan.signature(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink, max_seqlen_q, max_seqlen_k,
                                    causal, softmax_scale, window_size, alignment, softcap)
        hash(key)
    except (AttributeError, TypeError):
        return None  # not tensors where tensors belong, or unhashable arguments: the general path names them

    def make():
        from cute_flash import launch_fwd

        check_variant(causal, window_size, alignment, softcap, sink, q.shape[1] if q.dim() == 3 else 0, q.device)
        scale = validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                seqused_k)
        check_kernel_device(q)
        problem = packed_problem(q, k, causal, window_size[0], window_size[1], alignment == "bottom_right", softcap,
                                 sink, seqused_k)
        return varlen_plan.make_plan(q, k, v, max_seqlen_q, max_seqlen_k, scale, problem,
                                     launch_fwd.equal_offsets(cu_seqlens_q, cu_seqlens_k, seqused_k, None))

    return varlen_plan.plan_for(key, make)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, learnable_sink=None, seqused_k=None,
                           deterministic=False, return_lse=False, block_table=None, dropout_p=0.0, page_table=None,
                           num_splits=1, pack_gqa=None):
    """flash-attn's varlen entry point (its names; causal and windows aligned bottom-right per
    sequence): the same kernels as flash_attention_varlen (block_table, or flash-attn-4's name
    page_table: keys in pages). flash-attn's conventions as flash_attn_func's
    (cute_flash.compat): everything after max_seqlen_k by keyword, None window sides, 16-bit
    sinks, dropout_p 0, num_splits / pack_gqa left to cute_flash."""
    compat.no_dropout(dropout_p)
    return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                  softmax_scale=softmax_scale, return_lse=return_lse,
                                  window_size=compat.window(window_size), alignment="bottom_right", softcap=softcap,
                                  sink=compat.sink(learnable_sink), seqused_k=seqused_k, deterministic=deterministic,
                                  block_table=compat.block_table(block_table, page_table))


def packed_problem(q, k, causal, window_left, window_right, bottom_right, softcap, sink, seqused_k, page_size=0):
    """The AttentionProblem of a packed call's (checked) primitives."""
    return AttentionProblem.of(causal, (window_left, window_right), "bottom_right" if bottom_right else "top_left",
                               softcap, sink is not None, k.shape[1] != q.shape[1], packed=True,
                               keys_used=seqused_k is not None, page_size=page_size)


def packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   window_size, bottom_right, softcap, sink, deterministic=False, direct=False, page_table=None,
                   page_size=0):
    """The packed forward's (out, lse) for checked arguments: launched directly when `direct`
    and not traced (eager calls without gradients: the custom op's dispatch costs 60-110 us of
    host time per call, perf/NOTES.md, fifteenth session, more than a small batch's kernel),
    else through the op (autograd, torch.compile)."""
    if direct and not torch.compiler.is_compiling():
        check_kernel_device(q)
        from cute_flash import launch_fwd

        problem = packed_problem(q, k, causal, window_size[0], window_size[1], bottom_right, softcap, sink, seqused_k,
                                 page_size)
        return launch_fwd.forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
                                         int(max_seqlen_k), problem, softmax_scale, sink, page_table=page_table)
    return torch.ops.cute_flash.flash_attention_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q), int(max_seqlen_k), bool(causal),
        softmax_scale, int(window_size[0]), int(window_size[1]), bool(bottom_right), float(softcap), sink,
        bool(deterministic), page_table, int(page_size))


@torch.library.custom_op("cute_flash::flash_attention_varlen_fwd", mutates_args=())
def flash_attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int = -1, window_right: int = -1, bottom_right: bool = False, softcap: float = 0.0,
    sink: torch.Tensor | None = None, deterministic: bool = False, page_table: torch.Tensor | None = None,
    page_size: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed forward; with page_table (B, max_pages) k and v are pages of page_size rows
    as packed rows (num_pages * page_size, Nkv, D), the keys counted by seqused_k."""
    return packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, (window_left, window_right), bottom_right, softcap, sink, deterministic,
                          direct=True, page_table=page_table, page_size=page_size)


@flash_attention_varlen_fwd.register_fake
def _flash_attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                     causal, softmax_scale, window_left=-1, window_right=-1, bottom_right=False,
                                     softcap=0.0, sink=None, deterministic=False, page_table=None, page_size=0):
    total_q, heads, _ = q.shape
    return q.new_empty((total_q, heads, v.shape[-1])), q.new_empty((heads, total_q), dtype=torch.float32)


@torch.library.custom_op("cute_flash::flash_attention_varlen_bwd", mutates_args=())
def flash_attention_varlen_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
    window_left: int = -1, window_right: int = -1, bottom_right: bool = False, softcap: float = 0.0,
    sink: torch.Tensor | None = None, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink is an empty tensor without a sink."""
    check_kernel_device(q)
    problem = packed_problem(q, k, causal, window_left, window_right, bottom_right, softcap, sink, seqused_k)
    batch = (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv, dsink = packed_gradients(dout, dlse, q, k, v, out, lse, batch, problem, softmax_scale, sink,
                                         deterministic)
    return dq, dk, dv, q.new_empty((0,), dtype=torch.float32) if dsink is None else dsink


def packed_gradients(dout, dlse, q, k, v, out, lse, batch: tuple, problem: AttentionProblem, softmax_scale: float,
                     sink, deterministic: bool) -> tuple:
    """(dq, dk, dv, dsink or None without a sink) of a packed call; batch = (cu_seqlens_q,
    cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k). The op's body and the eager
    autograd's backward (its forward checked the device)."""
    from cute_flash import launch_bwd

    dq, dk, dv, delta = launch_bwd.backward_packed(q, k, v, out, dout, lse, batch, problem, softmax_scale, dlse=dlse,
                                                   deterministic=deterministic, want_delta=sink is not None)
    if sink is None:
        return dq, dk, dv, None
    # d loss / d sink_h = -sum over head h's rows of P_sink * delta (launch_bwd.backward_with_sink).
    return dq, dk, dv, -(torch.exp(sink.view(-1, 1) - lse) * delta).sum(dim=1)


class _PackedAttentionFunction(torch.autograd.Function):
    """Eager autograd for packed calls with gradients (as api._AttentionFunction for dense
    ones): the kernels launched directly, without the custom op's dispatcher and its
    registered autograd, whose host time made a small packed batch's training step
    host-bound (perf/NOTES.md, twenty-fourth session). torch.compile traces the op instead.
    Saves q, k, v, O, the LSE and the offsets (O(total) memory)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, call, deterministic):
        out, lse = call.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink)
        ctx.call, ctx.deterministic = call, deterministic
        # An unused LSE gets no zero-filled gradient (dlse is None, not a tensor of zeros).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        call = ctx.call
        batch = (cu_seqlens_q, cu_seqlens_k, seqused_k, *call.max_seqlens)
        dq, dk, dv, dsink = packed_gradients(dout, dlse, q, k, v, out, lse, batch, call.problem, call.scale, sink,
                                             ctx.deterministic)
        return dq, dk, dv, dsink, None, None, None, None, None


@dataclass(frozen=True)
class _EagerCall:
    """What _PackedAttentionFunction needs of a call the plans leave to the general path (a
    varlen_plan.PackedPlan has the same fields and forward)."""

    scale: float
    problem: AttentionProblem
    max_seqlens: tuple

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink):
        from cute_flash import launch_fwd

        return launch_fwd.forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, *self.max_seqlens,
                                         self.problem, self.scale, sink)


@flash_attention_varlen_bwd.register_fake
def _flash_attention_varlen_bwd_fake(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                     max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left=-1,
                                     window_right=-1, bottom_right=False, softcap=0.0, sink=None,
                                     deterministic=False):
    from cute_flash.launch_bwd import new_gradients

    dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
    return (*new_gradients(q, k, v), dsink)


# The forward's arguments between the tensors and the sink that the backward takes as they are.
_PRIMITIVES = ("max_seqlen_q", "max_seqlen_k", "causal", "softmax_scale", "window_left", "window_right",
               "bottom_right", "softcap")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, *primitives, sink, deterministic, _, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink)
    ctx.primitives, ctx.deterministic = primitives, deterministic
    # An unused LSE gets no zero-filled gradient (dlse is None, not a tensor of zeros).
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.cute_flash.flash_attention_varlen_bwd(
        dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, *ctx.primitives, sink, ctx.deterministic)
    # (None for the offsets, the primitives, deterministic and a page table, which a call with
    # gradients never has: flash_attention_varlen refuses it.)
    return (dq, dk, dv, None, None, None, *(None for _ in _PRIMITIVES), dsink if sink is not None else None, None,
            None, None)


flash_attention_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)
