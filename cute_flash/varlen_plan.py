"""The eager fast path of packed calls (cute_flash.varlen): what a call's signature decides,
recorded on its first call (the checks passed, the softmax scale, the problem, the forward
kernel and which operands TMA needs copies of), so that later calls with that signature only
allocate and launch, as the dense path's plans (cute_flash.api) do. The backward's decisions
are cached by launch_bwd.backward_packed's own plans.

A small packed batch's training step was host-bound: checks, config lookups and views cost
more host time than its kernels take (perf/NOTES.md, twenty-fourth session). The offsets'
values are never part of a plan: the kernels read them on the device.
"""

from dataclasses import dataclass

import torch

from cute_flash.head_dims import ROW_ALIGN
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.torch_helpers import batch_of_one, cached_plan, current_device_index, tma_compatible, tma_operands

_plans = {}
_MAX_PLANS = 4096  # bounded, as the dense path's


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def signature(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink, max_seqlen_q, max_seqlen_k, causal,
              softmax_scale, window_size, alignment, softcap) -> tuple:
    """Everything a plan depends on (raises AttributeError/TypeError on arguments that are not
    tensors where tensors belong: the general path then names the problem). Each operand's
    pointer alignment is its own entry (which of them TMA needs copies of)."""
    return (
        _meta(q), _meta(k), _meta(v), _meta(cu_seqlens_q), _meta(cu_seqlens_k), _meta(seqused_k), _meta(sink),
        # One offsets tensor for queries and keys: equal lengths (launch_fwd.equal_offsets).
        cu_seqlens_q is cu_seqlens_k,
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, type(max_seqlen_q), max_seqlen_q,
        type(max_seqlen_k), max_seqlen_k, causal, softmax_scale, window_size, alignment, softcap,
        current_device_index(),
    )


@dataclass(frozen=True)
class PackedPlan:
    """A packed call's forward, decided once per signature."""

    scale: float
    problem: AttentionProblem
    max_seqlens: tuple  # (max_seqlen_q, max_seqlen_k) as ints: they pick the backward's config too
    kernel: object
    copy_operands: tuple  # per q, k, v: TMA needs a copy of its (1, N, total, D) view
    lse_shape: tuple  # (N, total_q)
    out_shape: tuple  # (total_q, N, Dv)

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, sink):
        """(out (total_q, N, Dv), lse (N, total_q)), as launch_fwd.forward_packed."""
        from cute_flash.launch_fwd import launch_packed

        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        operands = tma_operands([batch_of_one(q), batch_of_one(k), batch_of_one(v)], self.copy_operands)
        launch_packed(self.kernel, operands, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, None, self.scale)
        return out, lse


def plan_for(key, make):
    """The plan of a signature: made by make() on first sight (None: the general path runs such
    calls, and runs its checks every time)."""
    return cached_plan(_plans, key, make, _MAX_PLANS)


def make_plan(q, k, v, max_seqlen_q, max_seqlen_k, scale: float, problem: AttentionProblem,
              equal_lengths: bool = False):
    """The PackedPlan of a call whose checks have passed, or None for calls the plans leave to
    the general path: a head dim TMA cannot take without padding, no query or no key, or q on
    another device than the current one. equal_lengths: launch_fwd.equal_offsets of the call
    (part of its signature)."""
    from cute_flash import launch_fwd

    if (q.shape[-1] % ROW_ALIGN or v.shape[-1] % ROW_ALIGN or q.shape[0] == 0 or k.shape[0] == 0
            or q.device.index != current_device_index()):
        return None
    max_seqlens = (int(max_seqlen_q), int(max_seqlen_k))
    kernel = launch_fwd.packed_kernel(q, k, v, problem, *max_seqlens, equal_lengths)
    return PackedPlan(
        scale=scale,
        problem=problem,
        max_seqlens=max_seqlens,
        kernel=kernel,
        copy_operands=tuple(not tma_compatible(batch_of_one(t)) for t in (q, k, v)),
        lse_shape=(q.shape[1], q.shape[0]),
        out_shape=(q.shape[0], q.shape[1], v.shape[-1]),
    )
