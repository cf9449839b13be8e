"""Launching the Hopper forward kernel on torch tensors (the op's CUDA implementation).

Inputs arrive validated (cute_flash.validation). What is left here is what the kernel itself
needs: TMA descriptors want a 16-byte-aligned base address and 16-byte-aligned strides for
every dimension but the contiguous last one. Views that meet that (e.g. a (B, S, N, D) tensor
transposed to (B, N, S, D)) go to the kernel as they are; anything else is copied once.
"""

import contextlib

import torch

from cute_flash import compile_cache
from cute_flash.config import get_config

_TORCH_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TMA_ALIGN_BYTES = 16


def tma_compatible(t: torch.Tensor) -> bool:
    """True when t can back a TMA descriptor without a copy."""
    if t.data_ptr() % _TMA_ALIGN_BYTES:
        return False
    element = t.element_size()
    # Fast path (the backward asks this for eight tensors per call; the loop below costs
    # ~4 us of Python each): in a dense row-major tensor every outer stride is a multiple
    # of the row stride.
    if t.is_contiguous() and (t.shape[-1] * element) % _TMA_ALIGN_BYTES == 0:
        return True
    if t.stride(-1) != 1:
        return False
    return all(
        size == 1 or (stride * element) % _TMA_ALIGN_BYTES == 0 and stride > 0
        for size, stride in zip(t.shape[:-1], t.stride()[:-1])
    )


def as_tma_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can read it, else a fresh contiguous copy. (Not .contiguous(): a
    contiguous view at a misaligned storage offset would come back unchanged.)"""
    if tma_compatible(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float):
    """Run the forward kernel; returns (out, lse) with out (B, N, Sq, D), lse (B, N, Sq) fp32."""
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    out = torch.empty((batch, heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:
        # No key at all: softmax over an empty set. Every row is "fully masked": O = 0 and
        # LSE = -inf, the convention the kernel uses for rows that see no key.
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    kernel = kernel_for(q.dtype, head_dim, causal, q.device, (seqlen_q, seqlen_k))
    q, k, v = (as_tma_operand(t) for t in (q, k, v))
    with device_scope(q.device):
        kernel(q, k, v, out, lse, softmax_scale)
    return out, lse


def device_scope(device: torch.device):
    """Where to launch on `device`: the kernels run on PyTorch's current stream of the
    current device (taken through the TVM-FFI environment), so make `device` current if it
    is not. Entering torch.cuda.device costs host time on every call, hence the no-op
    context when it already is."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def kernel_for(dtype: torch.dtype, head_dim: int, causal: bool, device: torch.device, seqlens=None):
    """The compiled forward for these inputs on this device (compiled on first use), with the
    config that cute_flash.config selects for `seqlens` = (Sq, Sk)."""
    dtype_name = _TORCH_DTYPE_NAMES[dtype]
    config = get_config(dtype_name, head_dim, causal, "fwd", device, seqlens=seqlens)
    arch, _ = _device_traits(device)
    return compile_cache.get_forward(dtype_name, head_dim, causal, config, arch)


_device_traits_cache = {}


def _device_traits(device: torch.device):
    """(arch string, SM count) of a device, cached: both are read on every call (the SM count
    by the backward's prepare-ahead plan)."""
    traits = _device_traits_cache.get(device.index)
    if traits is None:
        major, minor = torch.cuda.get_device_capability(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        traits = (f"sm_{major}{minor}a", sms)
        _device_traits_cache[device.index] = traits
    return traits
