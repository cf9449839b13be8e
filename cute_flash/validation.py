"""Argument checks for cute_flash.flash_attention. Every error names the argument, what was
expected and what was given, before anything reaches a kernel."""

import math
import numbers

import torch

from cute_flash.head_dims import MAX_HEAD_DIM
from cute_flash.torch_helpers import SIXTEEN_BIT

SUPPORTED_DTYPES = SIXTEEN_BIT
# flash_attention's dense forward also takes float32 (on TF32: cute_flash.float32).
DENSE_DTYPES = SUPPORTED_DTYPES + (torch.float32,)
SUPPORTED_HEAD_DIMS = range(1, MAX_HEAD_DIM + 1)  # how each runs: cute_flash.head_dims
NAMES = ("q", "k", "v")


def _dtype_list(dtypes=SUPPORTED_DTYPES):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def validate(q, k, v, softmax_scale, dtypes=DENSE_DTYPES) -> float:
    """Check shapes, dtypes (one of `dtypes`), devices, layout and scale; return the softmax
    scale to use."""
    for name, t in zip(NAMES, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), "
                f"got {t.dim()} with shape {tuple(t.shape)}"
            )
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported dtypes: "
                            f"{_dtype_list(dtypes)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got q={str(q.dtype).replace('torch.', '')}, "
            f"k={str(k.dtype).replace('torch.', '')}, v={str(v.dtype).replace('torch.', '')}"
        )
    sizes = {name: t.shape[0] for name, t in zip(NAMES, (q, k, v))}
    if len(set(sizes.values())) != 1:
        raise ValueError("q, k and v must have the same batch size (dim 0), got "
                         + ", ".join(f"{n}={s}" for n, s in sizes.items()))
    if q.shape[3] != k.shape[3]:
        # v may have a head dim of its own (the value head dim Dv: out has it).
        raise ValueError(f"q and k must have the same head dim (dim 3), got q={q.shape[3]}, k={k.shape[3]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads (dim 1), got k={k.shape[1]}, v={v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"the number of key/value heads ({k.shape[1]}) must divide the number of query heads "
                         f"({q.shape[1]}) (grouped-query attention: query head h reads key/value head "
                         "h // (N / Nkv))")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same sequence length (dim 2), got k={k.shape[2]}, v={v.shape[2]}")
    for name, t in (("q", q), ("v", v)):
        if t.shape[3] not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{name} has head dim {t.shape[3]}; supported head dims: 1 to {MAX_HEAD_DIM}")
    for name, t in zip(NAMES, (q, k, v)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dimension (stride(-1) == 1), got strides {tuple(t.stride())}"
            )
    devices = {name: t.device for name, t in zip(NAMES, (q, k, v))}
    if len(set(devices.values())) != 1:
        raise ValueError("q, k and v must be on the same device, got " + ", ".join(f"{n}={d}" for n, d in devices.items()))
    return resolve_scale(softmax_scale, q.shape[3])




def resolve_scale(softmax_scale, head_dim: int) -> float:
    """The softmax scale to use (1/sqrt(head_dim) for None); a clear error for a bad one."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def check_kernel_device(t: torch.Tensor) -> None:
    """The kernel path needs a CUDA tensor on a Hopper (compute capability 9.x) GPU."""
    if t.device.type != "cuda":
        raise ValueError(
            f"q, k and v must be CUDA tensors on an NVIDIA Hopper GPU for the cute_flash kernel, "
            f"got device '{t.device}'"
        )
    major, minor = torch.cuda.get_device_capability(t.device)
    if major != 9:
        raise RuntimeError(
            f"cute_flash needs an NVIDIA Hopper GPU (compute capability 9.x); "
            f"found {torch.cuda.get_device_name(t.device)} with compute capability {major}.{minor}"
        )


def check_variant(causal, window_size, alignment, softcap, sink, num_heads, device):
    """Check the mask and score arguments of flash_attention (names as the user wrote them)."""
    from cute_flash.kernels.problem import ALIGNMENTS

    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
            raise ValueError(f"window_size {side} must be an int >= -1 (-1: unbounded), got {w!r}")
    if causal and window_size[1] > 0:
        raise ValueError(f"causal=True sees no key after the diagonal, but window_size right is {window_size[1]}: "
                         "pass window_size=(left, 0) or causal=False")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {', '.join(map(repr, ALIGNMENTS))}, got {alignment!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    if sink is not None:
        if not isinstance(sink, torch.Tensor):
            raise TypeError(f"sink must be a torch.Tensor of shape ({num_heads},) or None, got {type(sink).__name__}")
        if sink.dtype != torch.float32:
            raise TypeError(f"sink must be float32, got {str(sink.dtype).replace('torch.', '')}")
        if tuple(sink.shape) != (num_heads,):
            raise ValueError(f"sink must have shape ({num_heads},) (one logit per query head), got {tuple(sink.shape)}")
        if sink.device != device:
            raise ValueError(f"sink must be on q's device ({device}), got {sink.device}")
        check_unit_stride("sink", sink)


def check_int32_vector(name, t, entries, device):
    """An int32 1-D tensor of `entries` entries (None: any) on `device`: offsets, lengths or
    indices the kernels read (cu_seqlens, seqused_k, cache_seqlens, cache_batch_idx)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if entries is not None and t.shape[0] != entries:
        raise ValueError(f"{name} must have {entries} entries, got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")
    check_unit_stride(name, t)


def check_unit_stride(name, t):
    """A 1-D tensor that the kernels read with stride 1, as they are compiled: a strided view
    (a column of a (B, 2) tensor, say) is refused here, by its name, on every path, rather
    than by the compiled function's argument check in the kernel's terms."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (the kernels read it with stride 1), got stride {t.stride(0)}: "
                         f"pass {name}.contiguous()")
