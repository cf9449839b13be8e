"""Launching the Hopper backward kernels on torch tensors (the backward op's implementation).

The tile config comes from the YAML file (direction `bwd`), like the forward's; direction
`bwd_dq` says from which Sq the dQ comes from its own kernel (no fp32 accumulator). Under
torch.use_deterministic_algorithms(True) the deterministic variant runs: dQ's partial sums
are added in a fixed key-block order (bitwise reproducible; +5 % backward time on the large
shape, perf/NOTES.md).
"""

import dataclasses

import torch

from cute_flash import compile_bwd
from cute_flash.config import get_config
from cute_flash.launch import _TORCH_DTYPE_NAMES


def new_gradients(q, k, v):
    """The (dq, dk, dv) tensors the backward returns: contiguous, whatever the inputs' layout.
    The op's fake implementation allocates through this too: torch.compile checks the real
    outputs' strides against the fake ones (a (B, S, N, D) input viewed as (B, N, S, D) gets a
    contiguous (B, N, S, D) gradient from both)."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def backward(q, k, v, out, dout, lse, causal: bool, softmax_scale: float, dlse=None, grads=None):
    """(dq, dk, dv) for the upstream gradients dout of O and, optionally, dlse of the LSE.

    `grads` may supply the output tensors (dq, dk, dv), e.g. poisoned ones in tests; by
    default they come from new_gradients.
    """
    if grads is None:
        grads = new_gradients(q, k, v)
    key = (_TORCH_DTYPE_NAMES[q.dtype], q.shape[-1], causal)
    seqlens = (q.shape[2], k.shape[2])
    config = get_config(*key, "bwd", q.device, seqlens=seqlens)
    # A file without a bwd_dq entry never uses the separate dQ kernel.
    dq_config = get_config(*key, "bwd_dq", q.device, required=False, seqlens=seqlens)
    if torch.are_deterministic_algorithms_enabled() and not config.deterministic:
        config = dataclasses.replace(config, deterministic=True)
    return compile_bwd.backward(q, k, v, out, dout, lse, causal, softmax_scale, config=config,
                                grads=grads, dlse=dlse, dq_config=dq_config)
