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
above D = 16, backward_operands, dO scaled as q, k and v and dS per row in the kernels:
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

import functools
import math

import torch

from cute_flash.kernels.rules import SCALED_HALVES, SPLIT_BACKWARD_MAX_HEAD_DIM, SPLIT_FLOAT32, TF32, VALUE_CHUNK
from cute_flash.torch_helpers import cached_plan, device_scope, device_traits
from cute_flash.work_buffers import kept_set

PRECISIONS_ALLOWING_TF32 = ("high", "medium")
KEY_GROUP = 8  # the TF32 WGMMA's k step: the permutation's period
# The forward at float32 accuracy runs on the scaled halves ("float32x3h": twice TF32's rate at
# half its bytes) from this head dim up. Their narrowest tile is 64 wide (rules.forward): at
# D = 32 on it they are still 11-20 % faster than 3xTF32's own 32-wide tile, at D = 16 5-14 %
# slower than its 16-wide one, which serves D <= 16 (perf/NOTES.md, forty-fourth session).
HALVES_MIN_HEAD_DIM = 17


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


class OperandPass:
    """One float32 operand pass as a call's shapes fix it (kernels/tf32_operands.py,
    kernels/half_operands.py): its kernel and its outputs' (shape, dtype, zeroed) specs, worked
    out once per signature (operand_pass) because a small float32 call is host-bound and
    building them took ~10 us of Python per call (perf/NOTES.md, fifty-eighth session).

    Its outputs are a kept set (cute_flash.work_buffers; a small call's allocations cost more
    host time than its pass) whose `kind` names the pass and the columns it writes (its head
    dim: head dims that share a tile share the specs, but not the zero columns); columns the
    pass never writes (between D and the tile's T) are zeroed when the set is made."""

    def __init__(self, dtype_name: str, backward: bool, shapes: tuple, tile: int, device):
        head_dim = shapes[0][-1]
        if dtype_name == SCALED_HALVES and any(shape[-1] != head_dim for shape in shapes):
            # (The pass reads every tensor's rows head_dim wide: a narrower one would be read past.)
            raise ValueError("the scaled halves' operand pass takes one head dim for q, k, v (and dout), got "
                             f"{[shape[-1] for shape in shapes]} (flash_attention and flash_attention_varlen "
                             "pad the narrower ones)")
        self.dtype_name, self.backward, self.tile, self.device = dtype_name, backward, tile, device
        self.head_dim, self.tensors = head_dim, len(shapes)
        if dtype_name == SCALED_HALVES:
            from cute_flash.kernels.half_operands import TOP_PARTIALS

            q_shape = shapes[0]
            heads = sum(shape[1] for shape in shapes)
            halves = tuple(((*shape[:3], 2 * tile), torch.float16, tile != head_dim) for shape in shapes)
            scales = ((*q_shape[:2], 5 if backward else 2), torch.float32, False)
            # Per (batch, head) of each tensor in turn, its partial maxima as float32 bits
            # (int32); zeroed where the caller gives tops (_halves), a set not kept.
            partials = (q_shape[0], heads, TOP_PARTIALS), torch.int32
            self.specs = (*halves, scales, (*partials, False))
            self.specs_given_tops = (*halves, scales, (*partials, True))
        else:
            split = dtype_name == SPLIT_FLOAT32
            width = 2 * tile if split else head_dim
            # Columns (transposes' rows) between D and T are never written: zero where they exist.
            zeroed = split and tile != head_dim
            # Rows: q, k, v (and dout) rounded or split; transposes: V^T, or the backward's Q^T,
            # K^T and dO^T, their sequence padded to the permutation's period.
            rows = shapes if backward else shapes[:2]
            transposed = (shapes[0], shapes[1], shapes[3]) if backward else shapes[2:]
            self.specs = tuple(((*shape[:3], width), torch.float32, zeroed) for shape in rows) + tuple(
                ((*shape[:2], width, -(-shape[2] // KEY_GROUP) * KEY_GROUP), torch.float32, zeroed)
                for shape in transposed)
            self.specs_given_tops = self.specs  # (no tops to give)
        self.kind = ((dtype_name, "backward" if backward else "forward", head_dim), self.specs)
        self.nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in self.specs)

    @functools.cached_property
    def kernel(self):
        """The compiled pass (compiled or loaded on the first run, not when the plan is made)."""
        arch = device_traits(self.device)[0]
        if self.dtype_name == SCALED_HALVES:
            from cute_flash.compile_fwd import get_halves_operands

            return get_halves_operands(self.head_dim, self.tile, arch, self.backward)
        split = self.dtype_name == SPLIT_FLOAT32
        if self.backward:
            from cute_flash.compile_bwd import get_tf32_backward_operands

            return get_tf32_backward_operands(self.head_dim, self.tile, split, arch)
        from cute_flash.compile_fwd import get_tf32_operands

        return get_tf32_operands(self.head_dim, self.tile, split, arch)

    def buffers(self, keep: bool = True) -> tuple:
        """The pass's outputs, one tensor per spec: a kept set where one may serve, new tensors
        with keep=False (the partial maxima zeroed: the caller gives tops)."""
        specs = self.specs if keep else self.specs_given_tops

        def make():
            return tuple((torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=self.device)
                         for shape, dtype, zeroed in specs)

        if not keep:
            return make()
        return kept_set(self.kind, self.nbytes, make, self.device)

    def run(self, tensors: tuple, tops: tuple | None = None) -> tuple:
        """The pass over `tensors` (q, k, v, and dout for the backward; (B, H, S, D) as TMA
        takes them) on their device, as the kernels take its outputs: the forward's (q, k, v,
        operand scales), the backward's ((q, k, v, dout), (Q^T, K^T, dO^T), operand scales);
        the TF32 passes have no scales (None), the scaled halves no transposes (None). `tops`:
        _halves."""
        if self.dtype_name == SCALED_HALVES:
            outs, scales = self._halves(tensors, tops)
            return (outs, None, scales) if self.backward else (*outs, scales)
        buffers = self.buffers()
        with device_scope(self.device):
            if self.backward:
                self.kernel(*tensors, buffers[:4], buffers[4:])
            else:
                self.kernel(*tensors, *buffers)
        return (buffers[:4], buffers[4:], None) if self.backward else (*buffers, None)

    def _halves(self, tensors: tuple, tops: tuple | None) -> tuple:
        """(halves of each tensor, scales): (.., S, 2 tile) fp16 rows [hi | lo] of each (batch,
        head) scaled by a power of two, and the operand scales (B, N, 2) of the forward or (B,
        N, 5) of the backward: one call, two launches, that reduce every (batch, head)'s
        largest |x| and split; where the caller gives tops[i] ((1, H) float32: a KV cache's over
        the slots in use, cute_flash.kvcache) that tensor's maxima are those instead."""
        given = tops is not None and any(top is not None for top in tops)
        # (With given tops the partials are written here, so that set is not kept.)
        *outs, scales, partials = self.buffers(keep=not given)
        reduced = (1 << self.tensors) - 1
        if given:
            # A given maximum as the first partial of its heads, the others zero (bits of 0.0).
            first = 0
            for index, (t, top) in enumerate(zip(tensors, tops)):
                if top is not None:
                    partials[:, first: first + t.shape[1], 0] = top.view(torch.int32)
                    reduced &= ~(1 << index)
                first += t.shape[1]
        with device_scope(self.device):
            self.kernel(*tensors, *outs, partials, reduced, scales)
        return tuple(outs), scales


_passes = {}
_MAX_PASSES = 1024  # as the plan caches: ever-changing shapes clear it rather than grow it


def operand_pass(dtype_name: str, backward: bool, tensors: tuple, tile: int) -> OperandPass:
    """The OperandPass of the kernels of `dtype_name` on tiles of head dim `tile` for tensors
    of these shapes (q, k, v, and dout for the backward), made on the shapes' first sight."""
    shapes = tuple(t.shape for t in tensors)
    key = (dtype_name, backward, shapes, tile, tensors[0].device)
    return cached_plan(_passes, key, lambda: OperandPass(dtype_name, backward, shapes, tile, tensors[0].device),
                       _MAX_PASSES)


def backward_operands(dtype_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      tile: int, tops: tuple | None = None):
    """The float32 backward's operand copies for the kernels of `dtype_name` (backward_dtype_name)
    on tiles of head dim `tile` (OperandPass.run's backward outputs): TF32's ((q, k, v, dout)
    rounded to TF32, (Q^T, K^T, dO^T), None), the transposes (B, H, D, S8) with their sequence
    permuted within groups of 8 (as V^T in the forward) and zero past S; float32x3: each as its
    TF32 parts (rows (.., S, 2T), transposes (.., 2T, S8), as the forward's); the scaled halves
    (kernels/half_operands.ScaledHalvesBackward): ((q, k, v, dout) halves, None (no transposes),
    operand scales (B, N, 5)), dout with a
    power of two per (batch, head) of its own (with `tops`, OperandPass._halves's). Inputs (B, H,
    S, D) as TMA takes them, one head dim."""
    tensors = (q, k, v, dout)
    return operand_pass(dtype_name, True, tensors, tile).run(tensors, tops)


def tops_over_rows_in_use(tensors: tuple, in_use: torch.Tensor) -> tuple:
    """The largest |x| per head of each of `tensors` (rows.., H, D) over the rows `in_use`
    marks ((rows.., 1) bool): (1, H) float32 each, the scaled halves' tops (OperandPass._halves).
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
    them, and its operand scales (B, N, 2) float32 (OperandPass._halves, `tops` its): (q, k, v,
    scales)."""
    return kernel_operands(SCALED_HALVES, q, k, v, tile, tops)


def kernel_operands(dtype_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int,
                    tops: tuple | None = None):
    """(q, k, v, operand scales) as the float32 kernel of `dtype_name` (kernel_dtype_name) on
    tiles of head dim `tile` takes them (see the module docstring): the scaled halves'
    (halves_operands), else one launch of the TF32 operand pass (kernels/tf32_operands.py) on
    q's device and no scales (None). Inputs (B, N, S, D) as TMA takes them
    (torch_helpers.as_tma_operand). A plan keeps its OperandPass and calls its run instead."""
    tensors = (q, k, v)
    return operand_pass(dtype_name, False, tensors, tile).run(tensors, tops)
