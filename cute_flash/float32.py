"""float32 inputs: attention on the TF32 tensor cores (the forward; no backward yet).

The forward kernel runs float32 tiles on the TF32 WGMMA (kernels/wgmma.py), which reads 10 of
an operand's 23 mantissa bits and accumulates in float32. Torch says how accurate float32
matmuls must be with torch.get_float32_matmul_precision(), and the kernels follow it:

* "high" / "medium": one TF32 pass per GEMM ("float32" kernels): ~5e-4 relative error, that of
  torch's own attention with TF32 matmuls on the same data (perf/NOTES.md, eighteenth session).
* "highest" (torch's default): float32 accuracy from three TF32 passes ("float32x3" kernels,
  3xTF32): every operand x is split into TF32 parts hi = tf32(x), lo = tf32(x - hi), and a
  product a b is computed as hi hi + hi lo + lo hi (lo lo is below float32's rounding). The
  parts go to the kernel side by side along the head dim: q and k as (.., S, 2T) rows [hi | lo]
  (each half zero-padded to the tile's head dim T), V^T as (.., 2T, S) hi rows over lo rows; P's
  parts are made in the kernel's registers. Head dims up to 128.

The tensor cores drop a float32 operand's low 13 mantissa bits (truncation): every product
is pulled towards zero, and attention's error came out 3-4x that of torch's TF32 attention,
whose operands are rounded (perf/NOTES.md, eighteenth session). So the operands are rounded
first: q and k here, in one rounded copy each, V^T in its copy below, P in the kernel's
registers (kernels/ptx.round_to_tf32).

The TF32 WGMMA reads both operands K-major, and in P V the reduction runs over the keys: V
goes to the kernel transposed, (B, Nkv, D, Sk) with the keys contiguous, in one copy made
here per call. P stays in the registers the first GEMM left it in, where a thread holds
columns 2t and 2t + 1 of each group of 8 keys while the TF32 A operand wants t and t + 4
(kernels/layouts.acc_as_tf32_operand_a); the copy therefore also permutes the keys within
each group of 8 (key 2t + h to position 4h + t), padding Sk to a multiple of 8 with zeros.

These copies (a few passes over q, k and v, in torch ops) cost a few percent of a long
sequence's forward; a fused kernel for them is not written yet.
"""

import torch

PRECISIONS_ALLOWING_TF32 = ("high", "medium")
KEY_GROUP = 8  # the TF32 WGMMA's k step: the permutation's period
TF32_DROPPED_BITS = 13  # float32's 23 mantissa bits less TF32's 10


SPLIT_MAX_HEAD_DIM = 128  # "float32x3" entries: q's and k's tiles hold both parts


def kernel_dtype_name(head_dim: int) -> str:
    """The kernels' dtype name for float32 inputs of this head dim at torch's current float32
    matmul precision (see the module docstring)."""
    if torch.get_float32_matmul_precision() in PRECISIONS_ALLOWING_TF32:
        return "float32"
    if head_dim > SPLIT_MAX_HEAD_DIM:
        raise NotImplementedError(
            f"float32 attention at float32 accuracy (torch.get_float32_matmul_precision() 'highest', torch's "
            f"default) runs head dims up to {SPLIT_MAX_HEAD_DIM}, got {head_dim}; "
            "torch.set_float32_matmul_precision('high') runs every head dim up to 256 on TF32 (about 5e-4 relative "
            "error, as torch's TF32 matmuls)")
    return "float32x3"


def check_no_gradients() -> None:
    """For a float32 call that needs gradients, before the forward's work."""
    raise NotImplementedError("gradients for float32 inputs are not implemented yet (the forward runs on TF32); call "
                              "it without requires_grad or under torch.no_grad(), or use float16 / bfloat16")


def values_for_tf32(v: torch.Tensor) -> torch.Tensor:
    """V (B, Nkv, Sk, D) -> the kernel's V^T: (B, Nkv, D, Sk8) contiguous, Sk8 = Sk rounded up
    to a multiple of 8 (zero keys past Sk), key 8g + 2t + h of V at column 8g + 4h + t."""
    batch, heads, seqlen, head_dim = v.shape
    padded = -(-seqlen // KEY_GROUP) * KEY_GROUP
    if padded != seqlen:
        v = torch.nn.functional.pad(v, (0, 0, 0, padded - seqlen))
    groups = v.reshape(batch, heads, padded // KEY_GROUP, KEY_GROUP // 2, 2, head_dim)  # (.., g, t, h, D)
    return groups.permute(0, 1, 5, 2, 4, 3).reshape(batch, heads, head_dim, padded)  # (.., D, g, h, t)


def rounded_to_tf32(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """t's values rounded to the nearest TF32 value (ties away from zero, as cvt.rna does), as
    float32 with the low 13 mantissa bits zero; in `out` (same shape) when given, else a new
    tensor with t's strides. Finite values round in their binade's integer arithmetic; a
    value that rounds past the largest float becomes inf, as in cvt.rna."""
    bits = t.view(torch.int32)
    half = 1 << (TF32_DROPPED_BITS - 1)
    mask = -(1 << TF32_DROPPED_BITS)
    if out is None:
        rounded = bits + half
    else:
        rounded = out.view(torch.int32)
        torch.add(bits, half, out=rounded)
    return rounded.bitwise_and_(mask).view(torch.float32)


def tf32_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """What a "float32" forward kernel takes for q, k, v: q and k rounded to TF32 (new
    tensors, the callers' strides), V^T rounded to TF32 (values_for_tf32's layout)."""
    vt = values_for_tf32(v)
    return rounded_to_tf32(q), rounded_to_tf32(k), rounded_to_tf32(vt, out=vt)


def split_parts(t: torch.Tensor, tile: int, dim: int) -> torch.Tensor:
    """t's TF32 parts side by side along `dim`: [hi | lo], each half `tile` wide (zero past
    t's own width), hi = tf32(t) and lo = tf32(t - hi), so hi + lo = t to ~2^-22."""
    width = t.shape[dim]
    shape = list(t.shape)
    shape[dim] = 2 * tile
    out = t.new_zeros(shape) if width != tile else t.new_empty(shape)
    hi = rounded_to_tf32(t, out=out.narrow(dim, 0, width))
    rounded_to_tf32(t - hi, out=out.narrow(dim, tile, width))
    return out


def kernel_operands(dtype_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int):
    """q, k, v as the float32 kernel of `dtype_name` (kernel_dtype_name) on tiles of head
    dim `tile` takes them (see the module docstring)."""
    if dtype_name == "float32":
        return tf32_operands(q, k, v)
    return split_parts(q, tile, -1), split_parts(k, tile, -1), split_parts(values_for_tf32(v), tile, -2)
