"""float32 inputs: attention on the TF32 tensor cores.

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
  parts are made in the kernel's registers. Head dims up to 128; the forward uses it up to
  D = 16 only (HALVES_MIN_HEAD_DIM).
* "highest", forward above D = 16: the same three products on fp16 parts ("float32x3h", the
  scaled halves; kernels/half_operands.py, kernels/fwd_sm90.py), on the fp16 WGMMA at twice
  TF32's rate and half its bytes: 1.9-2.2x the 3xTF32 forward, and more accurate (2-4e-7 against
  3-7e-7 relative error; perf/NOTES.md, forty-fourth session). fp16 keeps 11 significant bits
  but only five exponent bits, so every (batch, head) of q, k and v is scaled by a power of two
  that puts its largest |x| at the top of fp16's range before the split (hi = fp16(x 2^e),
  lo = fp16(x 2^e - hi): 22 bits down to 2^-17 of that largest |x|), the kernel scales P by
  2^14 before splitting it (P <= 1, whose small values would otherwise lose their low part to
  fp16's subnormals), and the powers of two come back out exactly: the scores' factor joins
  the softmax's scale, O's its last rescale (the operand scales (B, N, 2), per query head).
  Above D = 128, up to 256, P V runs on 128-column chunks of V and O, one launch each
  (value_chunks).
  V needs no transpose here: the fp16 WGMMA reads it MN-major.

The tensor cores drop a float32 operand's low 13 mantissa bits (truncation): every product
is pulled towards zero, and attention's error came out 3-4x that of torch's TF32 attention,
whose operands are rounded (perf/NOTES.md, eighteenth session). So the operands are rounded
first, in the copies below, and P in the kernel's registers (kernels/ptx.round_to_tf32).

The TF32 WGMMA reads both operands K-major, and in P V the reduction runs over the keys: V
goes to the kernel transposed, (B, Nkv, D, Sk) with the keys contiguous. P stays in the
registers the first GEMM left it in, where a thread holds columns 2t and 2t + 1 of each group
of 8 keys while the TF32 A operand wants t and t + 4 (kernels/layouts.acc_as_tf32_operand_a);
the copy therefore also permutes the keys within each group of 8 (key 2t + h to position
4h + t), padding Sk to a multiple of 8 with zeros.

One pass per call makes every copy (kernels/tf32_operands.py: q and k rounded or split, V
transposed, permuted, rounded or split; kernels/half_operands.py for the halves, which reduces
each (batch, head)'s largest |x| in the same call); the forward kernel then reads those.

Gradients follow the precision the same way (backward_dtype_name, at the backward's call):
one TF32 pass per GEMM under "high" / "medium", three under "highest" (on the scaled halves
above D = 16, halves_backward_operands, dO scaled as q, k and v and dS per row in the kernels:
docs/DESIGN.md; 3xTF32, "float32x3", below), on tiles
up to 128 (at D = 128 a float32x3 CTA has one consumer warpgroup: its tiles hold both parts).
Above 128, up to 256, the scaled halves at either precision, their gradients in 128-column
chunks: one launch of the dK / dV kernel and of the dQ kernel per chunk, each reading Q, K, V
and dO whole (S and dP recomputed per chunk) and writing its columns of dK and dV or dQ
(rules.gradient_chunks). The TF32 dK / dV kernel
(kernels/bwd_sm90.py) contracts dV += P^T dO and dK += dS^T Q over the queries with P^T and
dS^T in registers, so it reads
Q^T and dO^T with their queries permuted in groups of 8 (the same permutation as V^T's keys),
and the dQ kernel (kernels/bwd_dq_sm90.py) reads K^T permuted likewise; q, k, v and dO go
rounded, or split as the forward's q and k (backward_operands, one pass before the kernels);
the halves' kernels read Q, dO and K MN-major instead (no transposes). As in the forward, the
split kernels sum each block's product in an accumulator of its own and add it to dK, dV or dQ
in float32.
"""

import math

import torch

from cute_flash.kernels.rules import SCALED_HALVES, SPLIT_BACKWARD_MAX_HEAD_DIM, SPLIT_FLOAT32, TF32, VALUE_CHUNK

PRECISIONS_ALLOWING_TF32 = ("high", "medium")
KEY_GROUP = 8  # the TF32 WGMMA's k step: the permutation's period
# The forward at float32 accuracy runs on the scaled halves ("float32x3h": twice TF32's rate at
# half its bytes) from this head dim up. Their narrowest tile is 64 wide (rules.forward): at
# D = 32 on it they are still 11-20 % faster than 3xTF32's own 32-wide tile, at D = 16 5-14 %
# slower than its 16-wide one, which serves D <= 16 (perf/NOTES.md, forty-fourth session).
HALVES_MIN_HEAD_DIM = 17


def operand_buffers(kind: tuple, specs: tuple, device, keep: bool = True) -> tuple:
    """The operand pass's outputs, one tensor per (shape, dtype, zeroed) of `specs` (zeroed:
    columns the pass never writes, zero from the start): a kept set where one may serve
    (cute_flash.work_buffers; a small call's allocations cost more host time than its pass),
    new tensors with keep=False. `kind` names the pass and the columns it writes (its head
    dim: head dims that share a tile share the specs, but not the zero columns)."""
    def make():
        return tuple((torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
                     for shape, dtype, zeroed in specs)

    if not keep:
        return make()
    from cute_flash.work_buffers import kept_set

    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in specs)
    return kept_set((kind, specs), nbytes, make, device)


def kernel_dtype_name(head_dim: int, packed: bool = False) -> str:
    """The kernels' dtype name for float32 inputs of this head dim at torch's current float32
    matmul precision (see the module docstring). A packed batch (`packed`) runs the scaled
    halves at every precision (above VALUE_CHUNK in value chunks, as dense ones): they read V
    as the 16-bit kernels do, where TF32's V^T permutes keys in groups of 8 counted from the
    tensor's first row, not each sequence's (rules.float32_problem)."""
    if packed:
        return SCALED_HALVES
    if torch.get_float32_matmul_precision() in PRECISIONS_ALLOWING_TF32:
        return "float32"
    # (Above VALUE_CHUNK the halves' P V runs in chunks of V's columns: value_chunks.)
    return SCALED_HALVES if head_dim >= HALVES_MIN_HEAD_DIM else SPLIT_FLOAT32


def value_chunks(dtype_name: str, value_head_dim: int) -> list | None:
    """The scaled halves' forward above VALUE_CHUNK value columns: O and each block's P V
    accumulator of a 256-wide value tile would take 256 registers per thread, so P V runs on
    VALUE_CHUNK-wide chunks of V and O, one launch of the (tile, VALUE_CHUNK) pair kernel each
    (S = Q K^T recomputed per chunk; the operand pass lays V out chunk by chunk,
    kernels/half_operands.py): [(first column, columns)] of the chunks; None for one launch."""
    if dtype_name != SCALED_HALVES or value_head_dim <= VALUE_CHUNK:
        return None
    return [(c, min(VALUE_CHUNK, value_head_dim - c)) for c in range(0, value_head_dim, VALUE_CHUNK)]


def backward_dtype_name(head_dim: int) -> str:
    """The backward kernels' dtype name for float32 inputs of this head dim at torch's current
    float32 matmul precision (see the module docstring). Above SPLIT_BACKWARD_MAX_HEAD_DIM the
    scaled halves at either precision: only they have tiles there (their gradients in chunks,
    rules.gradient_chunks); under "high" they are more accurate than TF32 asks."""
    if head_dim > SPLIT_BACKWARD_MAX_HEAD_DIM:
        return SCALED_HALVES
    if torch.get_float32_matmul_precision() in PRECISIONS_ALLOWING_TF32:
        return TF32
    return SCALED_HALVES if head_dim >= HALVES_MIN_HEAD_DIM else SPLIT_FLOAT32


def backward_operands(dtype_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      tile: int, tops: tuple | None = None):
    """The float32 backward's operand copies for the kernels of `dtype_name` (backward_dtype_name)
    on tiles of head dim `tile` (kernels/tf32_operands.Tf32BackwardOperands, one launch
    sequence on q's device): ((q, k, v, dout) rounded to TF32, (Q^T, K^T, dO^T), None), the
    transposes (B, H, D, S8) with their sequence permuted within groups of 8 (as V^T in the
    forward) and zero past S; float32x3: each as its TF32 parts (rows (.., S, 2T), transposes
    (.., 2T, S8), as the forward's); the scaled halves: halves_backward_operands (with `tops`,
    _scaled_halves'). Inputs (B, H, S, D) as TMA takes them, one head dim."""
    from cute_flash.compile_bwd import get_tf32_backward_operands
    from cute_flash.torch_helpers import device_scope, device_traits

    if dtype_name == SCALED_HALVES:
        return halves_backward_operands(q, k, v, dout, tile, tops)
    split = dtype_name == SPLIT_FLOAT32
    head_dim = q.shape[-1]
    width = 2 * tile if split else head_dim
    # Columns (transposes' rows) between D and T are never written: zero where they exist.
    zeroed = split and tile != head_dim
    specs = tuple(((*t.shape[:3], width), torch.float32, zeroed) for t in (q, k, v, dout)) + tuple(
        ((*t.shape[:2], width, -(-t.shape[2] // KEY_GROUP) * KEY_GROUP), torch.float32, zeroed) for t in (q, k, dout))
    buffers = operand_buffers((dtype_name, "backward", head_dim), specs, q.device)
    rounded, transposes = buffers[:4], buffers[4:]
    kernel = get_tf32_backward_operands(head_dim, tile, split, device_traits(q.device)[0])
    with device_scope(q.device):
        kernel(q, k, v, dout, rounded, transposes)
    return rounded, transposes, None


def _scaled_halves(tensors: tuple, tile: int, backward: bool, tops: tuple | None = None):
    """`tensors` (q, k, v, and dout for the backward; (B, H, S, D) as TMA takes them) as (..,
    S, 2 tile) fp16 rows [hi | lo] of each (batch, head) scaled by a power of two, and the
    operand scales (B, N, 2) of the forward or (B, N, 5) of the backward
    (kernels/half_operands.py): one call, two launches, that reduce every (batch, head)'s
    largest |x| and split; where the caller gives tops[i] ((1, H) float32: a KV cache's over
    the slots in use, cute_flash.kvcache) that tensor's maxima are those instead."""
    from cute_flash.compile_fwd import get_halves_operands
    from cute_flash.kernels.half_operands import TOP_PARTIALS
    from cute_flash.torch_helpers import device_scope, device_traits

    q = tensors[0]
    head_dim = q.shape[-1]
    if any(t.shape[-1] != head_dim for t in tensors):
        # (The pass reads every tensor's rows head_dim wide: a narrower one would be read past.)
        raise ValueError("the scaled halves' operand pass takes one head dim for q, k, v (and dout), got "
                         f"{[t.shape[-1] for t in tensors]} (flash_attention and flash_attention_varlen pad the "
                         "narrower ones)")
    given = tops is not None and any(top is not None for top in tops)
    heads = sum(t.shape[1] for t in tensors)
    specs = tuple(((*t.shape[:3], 2 * tile), torch.float16, tile != head_dim) for t in tensors) + (
        ((*q.shape[:2], 5 if backward else 2), torch.float32, False),
        # Per (batch, head) of each tensor in turn, its partial maxima as float32 bits (int32).
        ((q.shape[0], heads, TOP_PARTIALS), torch.int32, given))
    # (Columns between D and the tile's T are never written: zeroed. With given tops the
    # partials are written here, so that set is not kept.)
    *outs, scales, partials = operand_buffers((SCALED_HALVES, "backward" if backward else "forward", head_dim),
                                              specs, q.device, keep=not given)
    outs = tuple(outs)
    reduced = (1 << len(tensors)) - 1
    if given:
        # A given maximum as the first partial of its heads, the others zero (bits of 0.0).
        first = 0
        for index, (t, top) in enumerate(zip(tensors, tops)):
            if top is not None:
                partials[:, first: first + t.shape[1], 0] = top.view(torch.int32)
                reduced &= ~(1 << index)
            first += t.shape[1]
    kernel = get_halves_operands(head_dim, tile, device_traits(q.device)[0], backward)
    with device_scope(q.device):
        kernel(*tensors, *outs, partials, reduced, scales)
    return outs, scales


def halves_backward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, tile: int,
                             tops: tuple | None = None):
    """q, k, v and dout as the scaled-halves backward's kernels take them, as halves_operands
    makes q, k and v (dout with a power of two per (batch, head) of its own), and its operand
    scales (B, N, 5) (kernels/half_operands.ScaledHalvesBackward): ((q, k, v, dout) halves, (q,
    k, dout) halves in the unread places of the TF32 kernels' transposes, scales)."""
    outs, scales = _scaled_halves((q, k, v, dout), tile, backward=True, tops=tops)
    q_h, k_h, _, dout_h = outs
    return outs, (q_h, k_h, dout_h), scales


def tops_over_rows_in_use(tensors: tuple, in_use: torch.Tensor) -> tuple:
    """The largest |x| per head of each of `tensors` (rows.., H, D) over the rows `in_use`
    marks ((rows.., 1) bool): (1, H) float32 each, the scaled halves' tops (_scaled_halves).
    Rows not in use (a cache's free slots, rows past seqused_k) may hold anything, NaN too,
    and the scale of a head must not follow them; the kernels mask their scores and zero their
    values (kernels/stale_keys.py)."""
    return tuple(torch.where(in_use, torch.linalg.vector_norm(t, ord=float("inf"), dim=-1), 0.0)
                 .flatten(0, -2).amax(0).view(1, -1) for t in tensors)


def keys_in_use_tops(tensors: tuple, cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor) -> tuple:
    """tops_over_rows_in_use of packed key rows (k and v, (total_k, Nkv, D)) over the rows
    sequences use, [cu_seqlens_k[b], cu_seqlens_k[b] + seqused_k[b]). No sync: each row's
    sequence by a sorted search of the offsets (the caller's contract: non-decreasing)."""
    total = tensors[0].shape[0]
    rows = torch.arange(total, dtype=cu_seqlens_k.dtype, device=cu_seqlens_k.device)
    sequence = (torch.searchsorted(cu_seqlens_k, rows, right=True) - 1).clamp_(0, seqused_k.shape[0] - 1)
    return tops_over_rows_in_use(tensors, (rows - cu_seqlens_k[sequence] < seqused_k[sequence]).unsqueeze(1))


def halves_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int, tops: tuple | None = None):
    """q, k, v as the scaled-halves forward ("float32x3h") on tiles of head dim `tile` takes
    them, and its operand scales (B, N, 2) float32 (_scaled_halves, `tops` its): (q, k, v,
    scales)."""
    outs, scales = _scaled_halves((q, k, v), tile, backward=False, tops=tops)
    return (*outs, scales)


def kernel_operands(dtype_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int):
    """(q, k, v, operand scales) as the float32 kernel of `dtype_name` (kernel_dtype_name) on
    tiles of head dim `tile` takes them (see the module docstring): the scaled halves'
    (halves_operands), else one launch of the TF32 operand pass (kernels/tf32_operands.py) on
    q's device and no scales (None). Inputs (B, N, S, D) as TMA takes them
    (torch_helpers.as_tma_operand)."""
    from cute_flash.compile_fwd import get_tf32_operands
    from cute_flash.torch_helpers import device_scope, device_traits

    if dtype_name == SCALED_HALVES:
        return halves_operands(q, k, v, tile)
    split = dtype_name == SPLIT_FLOAT32
    head_dim = q.shape[-1]
    width = 2 * tile if split else head_dim
    # Columns (V^T rows) between D and the tile's T are never written: zero where they exist.
    zeroed = split and tile != head_dim
    seqlen_k8 = -(-k.shape[2] // KEY_GROUP) * KEY_GROUP
    q_out, k_out, vt = operand_buffers((dtype_name, "forward", head_dim), (
        ((*q.shape[:3], width), torch.float32, zeroed), ((*k.shape[:3], width), torch.float32, zeroed),
        ((*v.shape[:2], width, seqlen_k8), torch.float32, zeroed)), q.device)
    kernel = get_tf32_operands(head_dim, tile, split, device_traits(q.device)[0])
    with device_scope(q.device):
        kernel(q, k, v, q_out, k_out, vt)
    return q_out, k_out, vt, None
