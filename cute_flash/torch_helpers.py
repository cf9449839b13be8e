"""Torch-side helpers shared by the launch modules, the eager fast path (api) and the SDPA
registration: dtype names, what TMA can read without a copy, the device to launch on.

No DSL import and nothing compiled here.

TMA descriptors want a 16-byte-aligned base address and 16-byte-aligned strides for every
dimension but the contiguous last one. Views that meet that (e.g. a (B, S, N, D) tensor
transposed to (B, N, S, D)) go to the kernels as they are; anything else is copied once.
"""

import contextlib

import torch

# torch dtype -> the name the configs and the compile keys use.
TORCH_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# The 16-bit input dtypes (kernels.rules.DTYPES as torch dtypes): the paths float32 does not take.
SIXTEEN_BIT = (torch.float16, torch.bfloat16)
TMA_ALIGN_BYTES = 16
# The current CUDA device's index, without torch.cuda.current_device()'s lazy-init check (the
# plan caches' fast paths only run on CUDA tensors, so CUDA is initialised by then).
current_device_index = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


_MISSING = object()


def cached_plan(plans: dict, key, make, max_plans: int):
    """plans[key], made by make() on the key's first sight (a None plan, "take the general
    path", is kept too). The eager paths' plan caches (api, launch_bwd, varlen_plan,
    kvcache_plan) are bounded this way: a workload with ever-changing shapes clears the dict
    rather than grow it."""
    plan = plans.get(key, _MISSING)
    if plan is _MISSING:
        plan = make()
        if len(plans) >= max_plans:
            plans.clear()
        plans[key] = plan
    return plan


def tma_compatible(t: torch.Tensor) -> bool:
    """True when t can back a TMA descriptor without a copy."""
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return False
    element = t.element_size()
    # Fast path (the backward asks this for eight tensors per call; the loop below costs
    # ~4 us of Python each): in a dense row-major tensor every outer stride is a multiple
    # of the row stride.
    if t.is_contiguous() and (t.shape[-1] * element) % TMA_ALIGN_BYTES == 0:
        return True
    if t.stride(-1) != 1:
        return False
    return all(
        size == 1 or (stride * element) % TMA_ALIGN_BYTES == 0 and stride > 0
        for size, stride in zip(t.shape[:-1], t.stride()[:-1])
    )


def as_tma_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can read it, else a fresh contiguous copy. (Not .contiguous(): a
    contiguous view at a misaligned storage offset would come back unchanged.)"""
    if tma_compatible(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def tma_operands(tensors, copies: tuple):
    """tensors with those a plan marked in `copies` (per tensor: TMA cannot read it in place,
    recorded from tma_compatible on the signature's first call) replaced by as_tma_operand's
    copies; the tensors unchanged when none is marked (the plans' common case)."""
    if True not in copies:
        return tensors
    return [as_tma_operand(t) if copy else t for t, copy in zip(tensors, copies)]


def batch_of_one(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, N, D) tensor as the (1, N, total, D) view the kernels take: the view
    t.unsqueeze(0).transpose(1, 2) gives, in one call (each view costs host time per call)."""
    total, heads, dim = t.shape
    rows, head, column = t.stride()
    return t.as_strided((1, heads, total, dim), (total * rows, head, rows, column))


def empty_with_head_dim(like: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An uninitialised tensor of like's shape with the last dim head_dim, its other dims in
    like's memory order (O of a value head dim of its own, laid out as empty_like(q) lays out
    O otherwise: flash_attn_func's (B, S, N, D) view of q gives O in that order too)."""
    if like.shape[-1] == head_dim:
        return torch.empty_like(like)
    outer = sorted(range(like.dim() - 1), key=lambda d: -like.stride(d))
    buffer = torch.empty([like.shape[d] for d in outer] + [head_dim], dtype=like.dtype, device=like.device)
    return buffer.permute(*(outer.index(d) for d in range(like.dim() - 1)), like.dim() - 1)


def call_on_device(fn, other_device: bool, device: torch.device, *args):
    """fn(*args) with `device` made current for the call where other_device (a plan's: whether
    its inputs' device is not the current one, decided once, as entering torch.cuda.device
    costs host time on every call)."""
    if other_device:
        with torch.cuda.device(device):
            return fn(*args)
    return fn(*args)


def device_scope(device: torch.device):
    """Where to launch on `device`: the kernels run on PyTorch's current stream of the
    current device (taken through the TVM-FFI environment), so make `device` current if it
    is not. Entering torch.cuda.device costs host time on every call, hence the no-op
    context when it already is (current_device_index: without torch.cuda.current_device()'s
    lazy-init check, which the launch paths, on CUDA tensors, do not need)."""
    if device.index == current_device_index():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


_device_traits_cache = {}


def device_traits(device: torch.device):
    """(arch string, SM count) of a device, cached: both are read on every call (the SM count
    by the backward's prepare-ahead plan)."""
    traits = _device_traits_cache.get(device.index)
    if traits is None:
        major, minor = torch.cuda.get_device_capability(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        traits = (f"sm_{major}{minor}a", sms)
        _device_traits_cache[device.index] = traits
    return traits


# The forward kernel's optional arguments after the sink (cu_seqlens_q, cu_seqlens_k, seqused_k,
# page_table, operand_scales) for a dense batch of 16-bit or TF32 inputs: it reads none of them
# and is compiled without them (FlashForwardSm90.optional_arguments), so each is None.
DENSE_BATCH = (None,) * 5
