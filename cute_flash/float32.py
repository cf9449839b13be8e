"""float32 inputs: attention on the TF32 tensor cores (the forward; no backward yet).

The forward kernel runs float32 tiles on the TF32 WGMMA (kernels/wgmma.py): S = Q K^T and
O = P V read their operands' top 10 mantissa bits and accumulate in float32, so the result
carries TF32's error (about 1e-3 relative, like torch's TF32 matmul on the same data). Torch
decides whether float32 matmuls may do that with torch.get_float32_matmul_precision():
"high" and "medium" allow TF32, "highest" (torch's default) asks for float32 accuracy, which
needs a split of each operand into TF32 parts (3xTF32) that is not written yet; under it a
float32 call is an error that says so, rather than a result less accurate than asked for.

The tensor cores drop a float32 operand's low 13 mantissa bits (truncation): every product
is pulled towards zero, and attention's error came out 3-4x that of torch's TF32 attention,
whose operands are rounded (perf/NOTES.md, eighteenth session). So the operands are rounded
first: q and k here, in one rounded copy each (tf32_operands), V^T in its copy below, P in the
kernel's registers (kernels/ptx.round_to_tf32).

The TF32 WGMMA reads both operands K-major, and in P V the reduction runs over the keys: V
goes to the kernel transposed, (B, Nkv, D, Sk) with the keys contiguous, in one copy made
here per call. P stays in the registers the first GEMM left it in, where a thread holds
columns 2t and 2t + 1 of each group of 8 keys while the TF32 A operand wants t and t + 4
(kernels/layouts.acc_as_tf32_operand_a); the copy therefore also permutes the keys within
each group of 8 (key 2t + h to position 4h + t), padding Sk to a multiple of 8 with zeros.
"""

import torch

PRECISIONS_ALLOWING_TF32 = ("high", "medium")
KEY_GROUP = 8  # the TF32 WGMMA's k step: the permutation's period
TF32_DROPPED_BITS = 13  # float32's 23 mantissa bits less TF32's 10


def check_precision() -> None:
    """Raise unless torch allows TF32 for float32 matmuls (see the module docstring)."""
    precision = torch.get_float32_matmul_precision()
    if precision not in PRECISIONS_ALLOWING_TF32:
        raise NotImplementedError(
            f"float32 attention runs on TF32 tensor cores (about 1e-3 relative error, like torch's TF32 matmuls), "
            f"but torch.get_float32_matmul_precision() is {precision!r}, which asks for float32 accuracy; a "
            "float32-accurate (3xTF32) kernel is not implemented yet. Call "
            "torch.set_float32_matmul_precision('high') to allow TF32, or pass float16 / bfloat16 inputs")


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
    """What the float32 forward kernel takes for q, k, v: q and k rounded to TF32 (new
    tensors, the callers' strides), V^T rounded to TF32 (values_for_tf32's layout)."""
    vt = values_for_tf32(v)
    return rounded_to_tf32(q), rounded_to_tf32(k), rounded_to_tf32(vt, out=vt)
