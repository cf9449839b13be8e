"""float32 inputs (cute_flash.float32): the forward on TF32 tensor cores at the accuracy
torch.get_float32_matmul_precision() asks for -- one TF32 pass under "high" / "medium",
float32 accuracy (3xTF32) under "highest" -- gradients likewise (above head dim 128 the scaled
halves at either precision, in gradient chunks), and the operand copies the kernels take
(V, Q^T, K^T, dO^T transposed and permuted, TF32 rounding, hi | lo parts).

GPU cases: fresh random inputs, every element against a float64 reference, next to the error
of torch's own attention in float32 at the same precision on the same data; kernel outputs
poisoned with NaN where the test owns them."""

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import cute_flash
from cute_flash.float32 import (
    KEY_GROUP,
    kernel_dtype_name,
    kernel_operands,
    keys_in_use_tops,
    tops_over_rows_in_use,
    value_chunks,
)
from cute_flash.reference import attention_reference

# Relative (Frobenius) error of O against float64, and the LSE's absolute error. Measured on the
# H100 over this file's cases (perf/NOTES.md, eighteenth session): O <= 5.5e-4 (torch's own TF32
# attention: up to 5.6e-4 on the same data), LSE <= 1.3e-3. Operands left to the tensor cores'
# truncation gave O 1.2-1.6e-3 and LSE up to 4.8e-3: these bounds fail on that.
TF32_TOLERANCE = 1e-3
TF32_LSE_TOLERANCE = 2.5e-3
# "highest": the bar for float32 accuracy (relative error against float64).
FLOAT32_TOLERANCE = 1e-5
FLOAT32_LSE_TOLERANCE = 1e-5


# The operands the kernels take (cute_flash.float32), in torch ops: the reference the operand
# pass (kernels/tf32_operands.py) is compared with, bit for bit.
DROPPED_BITS = 13  # float32's 23 mantissa bits less TF32's 10


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
    half = 1 << (DROPPED_BITS - 1)
    mask = -(1 << DROPPED_BITS)
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


def reference_operands(dtype_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int):
    """What cute_flash.float32.kernel_operands must return, in torch ops."""
    if dtype_name == "float32":
        return tf32_operands(q, k, v)
    return split_parts(q, tile, -1), split_parts(k, tile, -1), split_parts(values_for_tf32(v), tile, -2)


@contextlib.contextmanager
def matmul_precision(precision):
    """torch's float32 matmul precision set for a block (global state: always restored)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield precision
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.fixture
def tf32_allowed():
    with matmul_precision("high"):
        yield


@pytest.fixture(params=["high", "highest"])
def precision(request):
    with matmul_precision(request.param):
        yield request.param


@pytest.fixture
def highest_precision():
    with matmul_precision("highest"):
        yield


# CPU: the layout of V^T and the errors.


@pytest.mark.parametrize("seqlen", [1, 7, 8, 17, 64])
def test_values_for_tf32_puts_key_2t_plus_h_at_column_4h_plus_t(seqlen):
    v = torch.randn(2, 3, seqlen, 5)
    vt = values_for_tf32(v)
    padded = -(-seqlen // KEY_GROUP) * KEY_GROUP
    assert vt.shape == (2, 3, 5, padded) and vt.is_contiguous()
    for key in range(padded):
        group, within = divmod(key, KEY_GROUP)
        t, h = divmod(within, 2)
        column = group * KEY_GROUP + 4 * h + t
        want = v[:, :, key] if key < seqlen else torch.zeros(2, 3, 5)
        assert torch.equal(vt[:, :, :, column], want), (key, column)


def test_rounding_to_tf32_is_to_the_nearest_with_ties_away():
    x = torch.cat([torch.randn(10000) * 10.0 ** torch.randint(-30, 30, (10000,)).float(),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0])])
    rounded = rounded_to_tf32(x)
    assert (rounded.view(torch.int32) & 0x1FFF == 0).all(), "low 13 mantissa bits left"
    # The two TF32 neighbours of x: truncated and one TF32 ulp above it (in magnitude).
    low = (x.view(torch.int32) & -0x2000).view(torch.float32)
    high = (x.view(torch.int32).add(0x2000) & -0x2000).view(torch.float32)
    finite = torch.isfinite(x)
    d_low, d_high = (x.double() - low.double()).abs(), (high.double() - x.double()).abs()
    want = torch.where(d_high <= d_low, high, low)  # ties away from zero
    assert torch.equal(rounded[finite], want[finite])
    assert torch.equal(rounded[~finite], x[~finite])
    ties = torch.tensor([1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11), 1.0 + 3 * 2.0 ** -11])
    assert rounded_to_tf32(ties).tolist() == [1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -10), 1.0 + 2 * 2.0 ** -10]


def test_tf32_operands_round_q_k_and_the_permuted_v():
    q, k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 1, 13, 16), torch.randn(1, 1, 13, 16)
    q32, k32, vt = tf32_operands(q, k, v)
    assert torch.equal(q32, rounded_to_tf32(q)) and torch.equal(k32, rounded_to_tf32(k))
    assert torch.equal(vt, rounded_to_tf32(values_for_tf32(v)))
    assert not torch.equal(q32, q), "q itself is never changed: the rounded values are a copy"


def test_values_for_tf32_takes_strided_views():
    v = torch.randn(2, 20, 3, 8).transpose(1, 2)  # flash-attn's (B, S, N, D) as (B, N, S, D)
    assert torch.equal(values_for_tf32(v), values_for_tf32(v.contiguous()))


@pytest.mark.parametrize("precision, name", [("high", "float32"), ("medium", "float32"), ("highest", "float32x3h")])
def test_the_matmul_precision_picks_the_kernels(precision, name):
    with matmul_precision(precision):
        assert kernel_dtype_name(128) == name
        assert kernel_dtype_name(17) == name
        # At float32 accuracy the narrowest heads keep 3xTF32's 16-wide tile.
        assert kernel_dtype_name(16) == ("float32x3" if name == "float32x3h" else name)
        if name == "float32":
            assert kernel_dtype_name(256) == name


def test_float32_accuracy_above_head_dim_128_runs_the_halves_in_value_chunks(highest_precision):
    """O and its per-block P V accumulator of a 256-wide value tile would take 256 registers:
    above 128 the halves' P V runs on 128-column chunks of V and O, one launch each."""
    assert kernel_dtype_name(136) == kernel_dtype_name(256) == "float32x3h"
    assert value_chunks("float32x3h", 256) == [(0, 128), (128, 128)]
    assert value_chunks("float32x3h", 200) == [(0, 128), (128, 72)]
    assert value_chunks("float32x3h", 128) is None and value_chunks("float32", 256) is None


@pytest.mark.parametrize("width, tile", [(16, 16), (24, 32), (128, 128)])
def test_split_parts_are_tf32_halves_that_sum_to_the_input(width, tile):
    t = torch.randn(2, 3, 50, width) * 10.0 ** torch.randint(-20, 20, (2, 3, 50, 1)).float()
    parts = split_parts(t, tile, -1)
    assert parts.shape == (2, 3, 50, 2 * tile)
    hi, lo = parts[..., :width], parts[..., tile:tile + width]
    assert (parts.view(torch.int32) & 0x1FFF == 0).all(), "a part with more than TF32's bits"
    assert torch.equal(hi, rounded_to_tf32(t))
    assert ((hi.double() + lo.double() - t.double()).abs() <= t.double().abs() * 2.0 ** -21).all()
    assert not parts[..., width:tile].any() and not parts[..., tile + width:].any(), "padding not zero"
    vt = split_parts(values_for_tf32(t), tile, -2)
    assert vt.shape == (2, 3, 2 * tile, 56) and torch.equal(vt[:, :, :width], rounded_to_tf32(values_for_tf32(t)))


@pytest.mark.parametrize("precision, name", [("high", "float32"), ("medium", "float32"), ("highest", "float32x3h")])
def test_the_matmul_precision_picks_the_backward_kernels(precision, name):
    from cute_flash.launch_bwd import kernel_dtype_name as backward_dtype_name

    with matmul_precision(precision):
        assert backward_dtype_name(torch.float32, 64) == name
        assert backward_dtype_name(torch.float32, 17) == name
        # 3xTF32 below the halves' head dims.
        assert backward_dtype_name(torch.float32, 16) == ("float32x3" if name == "float32x3h" else name)
        assert backward_dtype_name(torch.bfloat16, 64) == "bfloat16"
        # Either precision above 128: only the halves have tiles there (their gradients in chunks).
        assert backward_dtype_name(torch.float32, 136) == backward_dtype_name(torch.float32, 256) == "float32x3h"


def test_gradients_above_head_dim_128_come_in_chunks_of_128_columns():
    """A chunk's dK and dV (or dQ) take D = 128's registers; S and dP still run over every
    column. One launch (None) at 128 and below, and for every other dtype."""
    from cute_flash.kernels.rules import gradient_chunks

    assert gradient_chunks("float32x3h", 256) == [(0, 128), (128, 128)]
    assert gradient_chunks("float32x3h", 128) == gradient_chunks("float32x3", 128) == [None]
    assert gradient_chunks("bfloat16", 256) == [None]


def test_the_halves_operand_pass_refuses_two_head_dims():
    """Its kernel reads every tensor's rows q's head dim wide: a narrower v would be read past
    (flash_attention and flash_attention_varlen pad float32 head dims to one)."""
    from cute_flash.float32 import halves_operands

    q = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match=r"one head dim for q, k, v.*\[64, 64, 32\]"):
        halves_operands(q, q, torch.randn(1, 2, 4, 32), 64)


CPU = torch.device("cpu")


def test_the_halves_pass_lays_out_padded_halves_scales_and_partial_maxima():
    """OperandPass's outputs for the scaled halves (no compile: its kernel is looked up on the
    first run): per tensor (.., S, 2 tile) fp16, zeroed where the tile is wider than D (columns
    the pass never writes); the operand scales (B, N, 2) forward, (B, N, 5) backward; the
    partial maxima (B, N + 2 Nkv (+ N), TOP_PARTIALS) int32, zeroed only where tops are given
    (that set is not kept: the caller writes its first entries)."""
    from cute_flash.float32 import OperandPass
    from cute_flash.kernels.half_operands import TOP_PARTIALS

    q, kv = (2, 8, 17, 24), (2, 2, 300, 24)
    fwd = OperandPass("float32x3h", False, (q, kv, kv), 64, CPU)
    assert fwd.specs == (((2, 8, 17, 128), torch.float16, True), ((2, 2, 300, 128), torch.float16, True),
                         ((2, 2, 300, 128), torch.float16, True), ((2, 8, 2), torch.float32, False),
                         ((2, 12, TOP_PARTIALS), torch.int32, False))
    assert fwd.specs_given_tops[-1] == ((2, 12, TOP_PARTIALS), torch.int32, True)
    assert fwd.specs_given_tops[:-1] == fwd.specs[:-1]
    assert fwd.nbytes == 2 * 128 * 2 * (8 * 17 + 2 * 2 * 300) + 4 * 2 * 8 * 2 + 4 * 2 * 12 * TOP_PARTIALS
    bwd = OperandPass("float32x3h", True, (q, kv, kv, q), 64, CPU)
    assert [spec[0] for spec in bwd.specs] == [(2, 8, 17, 128), (2, 2, 300, 128), (2, 2, 300, 128),
                                               (2, 8, 17, 128), (2, 8, 5), (2, 20, TOP_PARTIALS)]
    full = OperandPass("float32x3h", False, ((1, 4, 8, 64),) * 3, 64, CPU)
    assert not any(zeroed for _, _, zeroed in full.specs), "a tile as wide as D has no column to zero"


def test_the_tf32_passes_lay_out_rows_and_permuted_transposes():
    """OperandPass's outputs for TF32 (rows D wide) and 3xTF32 ([hi | lo] rows 2 tile wide,
    zeroed where the tile is wider than D): the forward's q and k rows and V^T (B, Nkv, D, Sk8);
    the backward's q, k, v, dO rows and Q^T, K^T, dO^T, each sequence padded to the
    permutation's period of 8."""
    from cute_flash.float32 import OperandPass

    q, kv = (1, 4, 17, 8), (1, 2, 1000, 8)
    split = OperandPass("float32x3", False, (q, kv, kv), 16, CPU)
    assert split.specs == (((1, 4, 17, 32), torch.float32, True), ((1, 2, 1000, 32), torch.float32, True),
                           ((1, 2, 32, 1000), torch.float32, True))
    q, kv = (1, 4, 17, 64), (1, 2, 1001, 64)
    rounded = OperandPass("float32", True, (q, kv, kv, q), 64, CPU)
    assert rounded.specs == tuple((shape, torch.float32, False) for shape in (
        (1, 4, 17, 64), (1, 2, 1001, 64), (1, 2, 1001, 64), (1, 4, 17, 64),
        (1, 4, 64, 24), (1, 2, 64, 1008), (1, 4, 64, 24)))


def test_head_dims_that_share_a_tile_keep_their_passes_apart():
    """Two head dims on one tile have the same specs but not the same zero columns: their kept
    sets must differ (keyed by the pass's kind), else a narrower head dim would read the wider
    one's values as its padding (the fifty-seventh session's 32 failing GPU tests)."""
    from cute_flash.float32 import OperandPass

    narrow = OperandPass("float32x3h", False, ((1, 2, 16, 24),) * 3, 64, CPU)
    wide = OperandPass("float32x3h", False, ((1, 2, 16, 56),) * 3, 64, CPU)
    assert [spec[:2] for spec in narrow.specs] == [spec[:2] for spec in wide.specs]
    assert narrow.kind != wide.kind


def test_operand_passes_are_made_once_per_signature():
    """operand_pass hands the same OperandPass to calls of one signature (the plans hold it, and
    paths without a plan look it up by shapes) and another to another shape or direction."""
    from cute_flash.float32 import operand_pass

    q, k = torch.empty(1, 2, 16, 40), torch.empty(1, 1, 32, 40)
    first = operand_pass("float32x3h", False, (q, k, k), 64)
    assert operand_pass("float32x3h", False, (q.clone(), k, k), 64) is first
    assert operand_pass("float32x3h", True, (q, k, k, q), 64) is not first
    assert operand_pass("float32x3h", False, (q[:, :, :8], k, k), 64) is not first


def test_the_scales_of_packed_keys_follow_the_rows_in_use_only():
    """keys_in_use_tops: per head, the largest |x| over [cu_k[b], cu_k[b] + seqused_k[b]) of
    every sequence (empty ones too), whatever the other rows hold (NaN, or larger values)."""
    cu_k = torch.tensor([0, 10, 10, 25, 40], dtype=torch.int32)
    used = torch.tensor([4, 0, 15, 0], dtype=torch.int32)
    k, v = torch.randn(40, 3, 8), torch.randn(40, 3, 8)
    for lo, hi in ((4, 10), (25, 40)):
        k[lo:hi], v[lo:hi] = float("nan"), 1e30
    tops = keys_in_use_tops((k, v), cu_k, used)
    rows = torch.cat([torch.arange(int(cu_k[b]), int(cu_k[b] + used[b])) for b in range(4)])
    for got, t in zip(tops, (k, v)):
        assert got.shape == (1, 3) and torch.equal(got[0], t[rows].abs().amax(dim=(0, 2)))
    # A cache's (entries, slots, H, D) layout, entry e's first lengths[e] slots in use (kvcache).
    lengths = torch.tensor([4, 0, 15, 6])
    cache = torch.randn(4, 15, 3, 8)
    for e, n in enumerate(lengths.tolist()):
        cache[e, n:] = float("nan")
    in_use = (torch.arange(15) < lengths.unsqueeze(1)).unsqueeze(2)
    (got,) = tops_over_rows_in_use((cache,), in_use)
    want = torch.cat([cache[e, :n] for e, n in enumerate(lengths.tolist())]).abs().amax(dim=(0, 2))
    assert got.shape == (1, 3) and torch.equal(got[0], want)


def test_packed_batches_take_float32_on_the_scaled_halves():
    """float32 packed rows pass the checks, with gradients too (both directions run on the
    scaled halves at every precision, above 128 in value chunks)."""
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    for leaf in (q, q.clone().requires_grad_()):
        with pytest.raises(ValueError, match="CUDA tensors"):  # past the dtype checks: the device's
            cute_flash.flash_attention_varlen(leaf, q, q, cu, cu, 10, 10)
    assert kernel_dtype_name(17, packed=True) == kernel_dtype_name(8, packed=True) == "float32x3h"
    assert kernel_dtype_name(256, packed=True) == "float32x3h"


@pytest.mark.sass
@pytest.mark.parametrize("head_dim, tile, split", [(128, 128, True), (256, 256, False), (24, 32, True)])
def test_operand_pass_moves_16_byte_vectors_without_spills(head_dim, tile, split, tmp_path):
    """kernels/tf32_operands.py for sm_90a on the CPU: q and k rows in and out, and V^T's rows
    out, as 16-byte accesses (the scalar first version ran at a quarter of the copy bandwidth)."""
    import os
    import subprocess
    import sys

    from cute_flash.sass import disassemble, find_nvdisasm, opcode_counts

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path),
               CUTE_FLASH_DISK_CACHE="0")
    code = ("from cute_flash.compile_fwd import compile_tf32_operands; "
            f"compile_tf32_operands({head_dim}, {tile}, {split})")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600, capture_output=True)
    (cubin,) = tmp_path.glob("*.cubin")
    sass = disassemble(cubin)
    assert "LDG.E.128" in sass and "STG.E.128" in sass
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


# GPU.


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def torch_float32_attention(q, k, v, scale, **variant):
    """Attention with torch's float32 ops at the current matmul precision (TF32 matmuls under
    "high"): the yardstick for the kernel's error."""
    return attention_reference(q, k, v, softmax_scale=scale, dtype=torch.float32, **variant)


def check_against_float64(out, lse, q, k, v, scale, **variant):
    precision = torch.get_float32_matmul_precision()
    tolerance, lse_tolerance = ((FLOAT32_TOLERANCE, FLOAT32_LSE_TOLERANCE) if precision == "highest"
                                else (TF32_TOLERANCE, TF32_LSE_TOLERANCE))
    ref, ref_lse = attention_reference(q, k, v, softmax_scale=scale, dtype=torch.float64, **variant)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite (or unwritten) elements of O"
    err = rel_err(out, ref)
    yardstick = rel_err(torch_float32_attention(q, k, v, scale, **variant)[0], ref)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    print(f"\nFLOAT32-ERROR {precision} shape={tuple(q.shape)}x{k.shape[2]} {variant} O {err:.2e} "
          f"(torch {yardstick:.2e}) LSE {lse_err:.2e}")
    assert err < tolerance, f"relative error {err:.2e} (torch's float32 attention at {precision!r}: {yardstick:.2e})"
    assert lse_err < lse_tolerance, f"LSE error {lse_err:.2e}"
    return err, yardstick


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["float32", "float32x3"])
@pytest.mark.parametrize("head_dim, tile", [(8, 16), (16, 16), (24, 32), (64, 64), (72, 128), (128, 128)])
@pytest.mark.parametrize("seqlen_k", [1, 13, 1000])
def test_operand_pass_matches_the_torch_reference_bit_for_bit(name, head_dim, tile, seqlen_k):
    """kernels/tf32_operands.py against reference_operands, on flash-attn's strided layout,
    into memory the caching allocator last held NaN in (every element must be written)."""
    q = rand(2, 333, 3, head_dim).transpose(1, 2)  # (B, S, N, D) viewed as (B, N, S, D)
    k, v = (rand(2, seqlen_k, 1, head_dim).transpose(1, 2) for _ in range(2))
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    got = kernel_operands(name, q, k, v, tile)
    want = reference_operands(name, q, k, v, tile)
    for g, w, label in zip(got, want, ("q", "k", "V^T")):
        assert g.shape == w.shape, label
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"{label}: {(g != w).sum().item()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [8, 16, 24, 32, 40, 64, 72, 96, 128, 160, 192, 200, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (17, 300), (300, 17), (1, 1), (129, 7)])
def test_forward_matches_float64_at_the_precisions_accuracy(precision, head_dim, causal, sq, sk):
    q, k, v = rand(2, 3, sq, head_dim), rand(2, 3, sk, head_dim), rand(2, 3, sk, head_dim)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_against_float64(out, lse, q, k, v, 1 / math.sqrt(head_dim), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, value_head_dim", [(96, 64), (40, 128), (192, 128)])
@pytest.mark.parametrize("sq, sk", [(300, 1000), (1000, 17)])
def test_value_head_dim_of_its_own(precision, head_dim, value_head_dim, sq, sk):
    """v of another head dim: the float32 operand pass takes one, so flash_attention pads the
    narrower tensors to the wider with zero columns (O at v's width)."""
    q, k, v = rand(2, 3, sq, head_dim), rand(2, 3, sk, head_dim), rand(2, 3, sk, value_head_dim)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 3, sq, value_head_dim)
    check_against_float64(out, lse, q, k, v, 1 / math.sqrt(head_dim), causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequences_keep_the_accuracy(precision, head_dim, causal):
    """8191 keys: O sums over a thousand key blocks, where an accumulation's error grows."""
    q, k, v = rand(1, 2, 300, head_dim), rand(1, 2, 8191, head_dim), rand(1, 2, 8191, head_dim)
    variant = dict(causal=causal, alignment="bottom_right")
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, **variant)
    check_against_float64(out, lse, q, k, v, 1 / math.sqrt(head_dim), **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kernel_writes_every_element_of_poisoned_outputs(precision, head_dim):
    from cute_flash import launch_fwd
    from cute_flash.kernels.problem import AttentionProblem
    from cute_flash.torch_helpers import DENSE_BATCH

    q, k, v = rand(2, 4, 333, head_dim), rand(2, 4, 1001, head_dim), rand(2, 4, 1001, head_dim)
    scale = 1 / math.sqrt(head_dim)
    problem = AttentionProblem.of(True, alignment="bottom_right")
    kernel = launch_fwd.kernel_for(torch.float32, head_dim, problem, q.device, (333, 1001))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    name, tile = launch_fwd.kernel_tile(torch.float32, head_dim, q.device)  # (with value chunks: the pair's)
    *operands, scales = kernel_operands(name, q, k, v, tile)
    kernel(*operands, out, lse, None, *DENSE_BATCH[:4], scales, scale)
    torch.cuda.synchronize()
    check_against_float64(out, lse, q, k, v, scale, causal=True, alignment="bottom_right")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 128])
def test_scaled_halves_keep_every_heads_accuracy_whatever_its_magnitude(highest_precision, head_dim):
    """The "highest" forward's fp16 halves scale each (batch, head) by its own power of two
    (kernels/half_operands.py): heads of q and v 2^-60 .. 2^60 in one call (k the reciprocal,
    so the scores stay of order one), each head against float64 on its own, so that the
    largest heads cannot hide a small one's error."""
    magnitudes = torch.tensor([2.0 ** -60, 1e-9, 1.0, 3e5, 2.0 ** 60], device="cuda").view(1, 5, 1, 1)
    q, k, v = rand(2, 5, 300, head_dim) * magnitudes, rand(2, 5, 700, head_dim) / magnitudes, rand(2, 5, 700, head_dim)
    v = v * magnitudes
    scale = 1 / math.sqrt(head_dim)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, softmax_scale=scale, dtype=torch.float64, causal=True)
    for head in range(5):
        err = rel_err(out[:, head], ref[:, head])
        lse_err = (lse[:, head].double() - ref_lse[:, head]).abs().max().item()
        assert err < FLOAT32_TOLERANCE and lse_err < FLOAT32_LSE_TOLERANCE, (head, err, lse_err)


@pytest.mark.gpu
def test_a_non_finite_input_stays_in_the_rows_it_reaches(highest_precision):
    """An infinity in q makes its own row non-finite, as in float32 attention; every other row
    of its head (whose scaling it turns off: kernels/half_operands.py) keeps float32 accuracy."""
    q, k, v = rand(1, 2, 200, 128), rand(1, 2, 300, 128), rand(1, 2, 300, 128)
    q[0, 0, 17, 5] = float("inf")
    out = cute_flash.flash_attention(q, k, v)
    assert not torch.isfinite(out[0, 0, 17]).any()
    finite = torch.ones(200, dtype=torch.bool, device="cuda")
    finite[17] = False
    clean = q.clone()
    clean[0, 0, 17] = 0.0
    ref, _ = attention_reference(clean, k, v, softmax_scale=1 / math.sqrt(128), dtype=torch.float64)
    assert rel_err(out[0, :, finite], ref[0, :, finite]) < FLOAT32_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sq, sk", [(1000, 777), (300, 2000)])
def test_every_variant_together(precision, head_dim, sq, sk):
    """GQA, a bottom-right window, softcap and a sink in one float32 call."""
    q, k, v = rand(2, 8, sq, head_dim), rand(2, 2, sk, head_dim), rand(2, 2, sk, head_dim)
    sink = torch.randn(8, device="cuda")
    variant = dict(causal=True, window_size=(200, 0), alignment="bottom_right", softcap=5.0, sink=sink)
    out, lse = cute_flash.flash_attention(q, k, v, return_lse=True, **variant)
    check_against_float64(out, lse, q, k, v, 1 / math.sqrt(head_dim), **variant)


@pytest.mark.gpu
def test_decode_step_with_grouped_heads(precision):
    """Sq = 1 with grouped heads: flash_attention's packed decode (query heads as rows)."""
    q, k, v = rand(64, 32, 1, 128), rand(64, 8, 3000, 128), rand(64, 8, 3000, 128)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, alignment="bottom_right", return_lse=True)
    check_against_float64(out, lse, q, k, v, 1 / math.sqrt(128), causal=True, alignment="bottom_right")


@pytest.mark.gpu
def test_flash_attn_func_layout_and_the_custom_op(precision):
    q, k, v = rand(2, 500, 4, 64), rand(2, 700, 2, 64), rand(2, 700, 2, 64)  # (B, S, N, D)
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    views = [t.transpose(1, 2) for t in (q, k, v)]
    check_against_float64(out.transpose(1, 2), lse, *views, 1 / 8.0, causal=True, alignment="bottom_right")
    # The custom op (torch.compile's path) launches through cute_flash.launch_fwd.forward.
    out_op, lse_op = torch.ops.cute_flash.flash_attention_fwd(*views, True, 1 / 8.0, -1, -1, True, 0.0, None, False)
    assert torch.equal(out_op, out.transpose(1, 2))


@pytest.mark.gpu
def test_the_precision_is_read_per_call():
    """One call signature, two precisions: the plan cache keys on the precision."""
    q, k, v = rand(1, 2, 300, 64), rand(1, 2, 300, 64), rand(1, 2, 300, 64)
    ref, _ = attention_reference(q, k, v, dtype=torch.float64)
    errors = {}
    for precision in ("high", "highest", "high"):
        with matmul_precision(precision):
            errors[precision] = rel_err(cute_flash.flash_attention(q, k, v), ref)
    assert errors["highest"] < FLOAT32_TOLERANCE < TF32_TOLERANCE / 10 < errors["high"] < TF32_TOLERANCE


# Gradients: relative (Frobenius) error of each of dq, dk, dv against float64 autograd. TF32
# ("high"), measured on the H100 over the cases below (perf/NOTES.md, twenty-second session):
# <= 1.05e-3, and 1.7e-3 at D = 1 (one rounded product per score; torch's matmul skips TF32 there).
# At D = 1 dq = sum_j dS_ij k_j cancels (sum_j dS_ij = 0) and its error has a long tail: a float64
# model of the TF32 roundings at (2, 3, 17, 1) x 300 keys (perf/experiments/tf32_d1_grad_error_model.py)
# gave median 1.2e-3, 1 % of 400 draws above 2.6e-3, the largest 3.05e-3, and one GPU draw read
# 3.005e-3 (perf/NOTES.md, fifty-seventh session): TF32_D1_GRAD_TOLERANCE there.
# "highest": the float32 bar, as the forward's.
TF32_GRAD_TOLERANCE = 3e-3
TF32_D1_GRAD_TOLERANCE = 5e-3
FLOAT32_GRAD_TOLERANCE = 1e-5
SPLIT_GRAD_HEAD_DIMS = [1, 8, 16, 24, 32, 40, 64, 72, 80, 96, 112, 128, 136, 160, 192, 200, 256]


@pytest.fixture(params=["high", "highest"])
def grad_precision(request):
    """Both precisions the backward runs at; the tolerance follows (grad_tolerance)."""
    with matmul_precision(request.param):
        yield request.param


def grad_tolerance(head_dim: int | None = None):
    if torch.get_float32_matmul_precision() == "highest":
        return FLOAT32_GRAD_TOLERANCE
    return TF32_D1_GRAD_TOLERANCE if head_dim == 1 else TF32_GRAD_TOLERANCE
# Where float64's gradient is exactly zero (one visible key: dS = P (dP - delta) = 0), the
# largest element's magnitude; delta from the dO that dP used leaves only float32 rounding of
# dP - delta (unit-scale inputs): this at 128 columns and one row, growing as the square root
# of the columns and of the rows summed into the gradient (dK: every query's), as the terms'
# scale does (the fuzz met 1.2e-5 with 11 rows at 128 columns). Above D = 128 under "high"
# the backward is the scaled halves' (float32-accurate dP) but O came from the TF32 forward,
# so dP - delta is O's TF32 error: the TF32 tolerance there (the fuzz met 4.0e-3 with 19 rows
# at 136 columns, 6e-5 of the terms' scale).
ZERO_GRADIENT_ERROR = 1e-5


def zero_gradient_error(head_dim: int, rows: int) -> float:
    tf32_forward = torch.get_float32_matmul_precision() != "highest" and head_dim > 128
    return (TF32_GRAD_TOLERANCE if tf32_forward else ZERO_GRADIENT_ERROR) * math.sqrt(max(head_dim, 128) / 128 * rows)


def check_gradients_against_float64(q, k, v, scale, sink=None, **variant):
    """dq, dk, dv (and the sink's) of flash_attention against float64 autograd of the reference
    on the same data and upstream gradient, next to torch's float32 attention at the same
    precision; every element finite."""
    def gradients(fn, dtype, out_grad):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        sink_leaf = None if sink is None else sink.detach().to(dtype).requires_grad_()
        out = fn(*leaves, sink_leaf)
        inputs = leaves + ([sink_leaf] if sink is not None else [])
        return out, torch.autograd.grad(out, inputs, out_grad.to(dtype))

    out_grad = rand(*q.shape[:3], v.shape[-1])
    out, got = gradients(lambda q_, k_, v_, s_: cute_flash.flash_attention(
        q_, k_, v_, softmax_scale=scale, sink=s_, **variant), torch.float32, out_grad)
    _, want = gradients(lambda q_, k_, v_, s_: attention_reference(
        q_, k_, v_, softmax_scale=scale, dtype=torch.float64, sink=s_, **variant)[0], torch.float64, out_grad)
    _, torch_tf32 = gradients(lambda q_, k_, v_, s_: torch_float32_attention(q_, k_, v_, scale, sink=s_, **variant)[0],
                              torch.float32, out_grad)
    for g, w, t, label in zip(got, want, torch_tf32, ("dq", "dk", "dv", "dsink")):
        assert g.dtype == torch.float32 and g.shape == w.shape, label
        assert torch.isfinite(g).all(), f"{label}: non-finite elements"
        if not w.any():
            # An exactly zero gradient (dq with one visible key): no relative error to take.
            bound = zero_gradient_error(max(q.shape[-1], v.shape[-1]), max(q.shape[2], k.shape[2]))
            assert g.abs().max() < bound, f"{label}: {g.abs().max():.2e} where the gradient is 0"
            continue
        err, yardstick = rel_err(g, w), rel_err(t, w)
        precision = torch.get_float32_matmul_precision()
        print(f"\nFLOAT32-GRAD-ERROR {precision} shape={tuple(q.shape)}x{k.shape[2]} {variant} {label} {err:.2e} "
              f"(torch {yardstick:.2e})")
        assert err < grad_tolerance(q.shape[-1]), \
            f"{label}: relative error {err:.2e} (torch's attention at {precision!r}: {yardstick:.2e})"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [1, 8, 16, 24, 32, 40, 64, 72, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (17, 300), (300, 17), (1, 1), (129, 7)])
def test_gradients_match_float64_on_tf32(tf32_allowed, head_dim, causal, sq, sk):
    q, k, v = rand(2, 3, sq, head_dim), rand(2, 3, sk, head_dim), rand(2, 3, sk, head_dim)
    check_gradients_against_float64(q, k, v, 1 / math.sqrt(head_dim), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", SPLIT_GRAD_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (17, 300), (300, 17), (1, 1), (129, 7)])
def test_gradients_match_float64_at_float32_accuracy(highest_precision, head_dim, causal, sq, sk):
    q, k, v = rand(2, 3, sq, head_dim), rand(2, 3, sk, head_dim), rand(2, 3, sk, head_dim)
    check_gradients_against_float64(q, k, v, 1 / math.sqrt(head_dim), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sq, sk", [(1000, 777), (300, 2000)])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_gradients_of_every_variant_together(grad_precision, head_dim, sq, sk, heads, kv_heads):
    """GQA or MHA, a bottom-right window, softcap and a sink, on flash-attn's strided layout."""
    q = rand(2, sq, heads, head_dim).transpose(1, 2)
    k, v = (rand(2, sk, kv_heads, head_dim).transpose(1, 2) for _ in range(2))
    variant = dict(causal=True, window_size=(200, 0), alignment="bottom_right", softcap=5.0)
    check_gradients_against_float64(q, k, v, 1 / math.sqrt(head_dim), sink=torch.randn(heads, device="cuda"),
                                    **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 128, 256])
def test_scaled_halves_gradients_keep_every_heads_accuracy_whatever_its_magnitude(highest_precision, head_dim):
    """The "highest" backward's fp16 halves scale each (batch, head) of q, k, v and dO by its
    own power of two and dS by one per row (kernels/half_operands.py): heads of q, v 2^-40 ..
    2^40 (k the reciprocal: scores of order one) under an upstream gradient of the opposite
    magnitudes, each head's gradients against float64 on their own."""
    magnitudes = torch.tensor([2.0 ** -40, 1e-6, 1.0, 3e5, 2.0 ** 40], device="cuda").view(1, 5, 1, 1)
    q, k, v = rand(2, 5, 300, head_dim) * magnitudes, rand(2, 5, 700, head_dim) / magnitudes, rand(2, 5, 700, head_dim)
    v = v * magnitudes
    dout = rand(2, 5, 300, head_dim) / magnitudes.flip(1)
    scale = 1 / math.sqrt(head_dim)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(cute_flash.flash_attention(*leaves, causal=True), leaves, dout)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*leaves, softmax_scale=scale, dtype=torch.float64, causal=True)[0],
                               leaves, dout.double())
    for head in range(5):
        for g, w, label in zip(got, want, ("dq", "dk", "dv")):
            err = rel_err(g[:, head], w[:, head])
            assert err < FLOAT32_GRAD_TOLERANCE, (head, label, err)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, value_head_dim", [(64, 40), (192, 256), (192, 128)])
def test_gradients_of_a_long_sequence_and_two_head_dims(grad_precision, head_dim, value_head_dim):
    """8191 keys (dK / dV sum over every query block) and v of its own head dim (padded; at
    256 in gradient chunks)."""
    q, k, v = rand(1, 2, 8191, head_dim), rand(1, 2, 8191, head_dim), rand(1, 2, 8191, value_head_dim)
    check_gradients_against_float64(q, k, v, 0.125, causal=True)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(head_dim=st.sampled_from([8, 24, 40, 64, 100, 128, 136, 192, 256]),
       value_head_dim=st.sampled_from([None, 40, 128, 256]), b=st.integers(1, 2), sq=st.integers(1, 500),
       sk=st.integers(1, 500), causal=st.booleans(), layout=st.sampled_from(["bnsd", "bsnd"]),
       precision=st.sampled_from(["high", "highest"]))
# (dK's zero gradient summed over 11 and 19 rows: ZERO_GRADIENT_ERROR's growth with the rows.)
@example(head_dim=8, value_head_dim=128, b=1, sq=11, sk=1, causal=False, layout="bnsd", precision="high")
@example(head_dim=136, value_head_dim=None, b=1, sq=19, sk=1, causal=False, layout="bnsd", precision="high")
def test_fuzz_forward_and_gradients(head_dim, value_head_dim, b, sq, sk, causal, layout, precision):
    """Random head dims (q's and v's, every tile from 16 to 256 and the gradient chunks above
    128), shapes, masks and layouts in float32 at both precisions: O, the LSE and the gradients
    against float64 (check_against_float64, check_gradients_against_float64). The variants
    keep their own tests: this draws the problems `python -m cute_flash precompile` builds."""
    value_head_dim = value_head_dim or head_dim

    def make(s, width, heads):
        if layout == "bsnd":
            return rand(b, s, heads, width).transpose(1, 2)
        return rand(b, heads, s, width)

    q, k, v = make(sq, head_dim, 2), make(sk, head_dim, 2), make(sk, value_head_dim, 2)
    scale = 1 / math.sqrt(head_dim)
    variant = dict(causal=causal)
    with matmul_precision(precision):
        out, lse = cute_flash.flash_attention(q, k, v, softmax_scale=scale, return_lse=True, **variant)
        check_against_float64(out, lse, q, k, v, scale, **variant)
        check_gradients_against_float64(q, k, v, scale, **variant)


@pytest.mark.gpu
def test_the_backward_reads_the_precision_per_call():
    """One signature's backward at "high", "highest", "high": the backward's plan cache keys on
    the precision (each call's gradients at its own precision's accuracy)."""
    q, k, v = (rand(1, 2, 300, 64).requires_grad_() for _ in range(3))
    dout = rand(1, 2, 300, 64)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_reference(q64, k64, v64, dtype=torch.float64)[0], (q64, k64, v64),
                               dout.double())
    for precision in ("high", "highest", "high"):
        with matmul_precision(precision):
            got = torch.autograd.grad(cute_flash.flash_attention(q, k, v), (q, k, v), dout)
        errors = [rel_err(g, w) for g, w in zip(got, want)]
        if precision == "highest":
            assert max(errors) < FLOAT32_GRAD_TOLERANCE, errors
        else:
            assert FLOAT32_GRAD_TOLERANCE * 10 < max(errors) < TF32_GRAD_TOLERANCE, errors


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_are_bitwise_reproducible(grad_precision, deterministic):
    """dQ from its own kernel and dK / dV from one CTA each: no order-dependent addition, with
    or without deterministic=True (which runs the same kernels)."""
    q, k, v = (rand(2, 4, 777, 64).requires_grad_() for _ in range(3))
    out_grad = rand(2, 4, 777, 64)
    runs = [torch.autograd.grad(cute_flash.flash_attention(q, k, v, causal=True, deterministic=deterministic),
                                (q, k, v), out_grad)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_the_custom_ops_gradients_are_the_eager_ones(grad_precision):
    """torch.compile's path (the custom ops' registered autograd) runs the same backward as the
    eager autograd Function, at the precision of the backward's call: bit for bit."""
    q, k, v = (rand(2, 4, 300, 64).requires_grad_() for _ in range(3))
    out_grad = rand(2, 4, 300, 64)
    eager = torch.autograd.grad(cute_flash.flash_attention(q, k, v, causal=True), (q, k, v), out_grad)
    out, _ = torch.ops.cute_flash.flash_attention_fwd(q, k, v, True, 0.125)
    through_op = torch.autograd.grad(out, (q, k, v), out_grad)
    for a, b in zip(eager, through_op):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gradients_through_the_lse(grad_precision):
    """A loss of O and of the LSE (return_lse=True): the LSE's gradient joins delta."""
    q, k, v = rand(2, 3, 500, 64), rand(2, 3, 700, 64), rand(2, 3, 700, 64)
    out_grad, lse_grad = rand(2, 3, 500, 64), rand(2, 3, 500)

    def gradients(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        loss = (out * out_grad.to(dtype)).sum() + (lse * lse_grad.to(dtype)).sum()
        return torch.autograd.grad(loss, leaves)

    got = gradients(lambda *t: cute_flash.flash_attention(*t, causal=True, return_lse=True), torch.float32)
    want = gradients(lambda *t: attention_reference(*t, causal=True, dtype=torch.float64), torch.float64)
    for g, w, label in zip(got, want, ("dq", "dk", "dv")):
        err = rel_err(g, w)
        assert err < grad_tolerance(), f"{label}: relative error {err:.2e}"


def halves_reference(tensors, tile, backward: bool = False):
    """What the scaled halves' operand passes make of `tensors` (q, k, v, ...; kernels/half_operands.py),
    in torch ops: each as (.., S, 2 tile) fp16 rows [hi | lo] (zero between D and the tile) of x 2^e
    per (batch, head), the forward's v (not the backward's: its gradient chunks read whole rows) of
    a tile above VALUE_CHUNK as such rows of each VALUE_CHUNK-column chunk one after the other; and
    the exponents e (B, H) int64."""
    from cute_flash.kernels.half_operands import HALVES_TOP_LOG2, VALUE_CHUNK

    outs, exponents = [], []
    for index, t in enumerate(tensors):
        top = torch.linalg.vector_norm(t, ord=float("inf"), dim=(2, 3))
        _, frexp_exponent = torch.frexp(top)  # top = m 2^E, m in [0.5, 1): floor(log2 top) = E - 1
        e = (HALVES_TOP_LOG2 + 1 - frexp_exponent.long()).clamp(-126, 126)
        e = torch.where((top == 0) | ~torch.isfinite(top), 0, e)
        scaled = t * torch.exp2(e.double()).float()[..., None, None]
        hi = scaled.half()
        lo = (scaled - hi.float()).half()
        out = torch.zeros((*t.shape[:3], 2 * tile), dtype=torch.float16, device=t.device)
        chunk = VALUE_CHUNK if index == 2 and tile > VALUE_CHUNK and not backward else tile
        for first in range(0, t.shape[-1], chunk):
            columns = min(chunk, t.shape[-1] - first)
            out[..., 2 * first: 2 * first + columns] = hi[..., first: first + columns]
            out[..., 2 * first + chunk: 2 * first + chunk + columns] = lo[..., first: first + columns]
        outs.append(out)
        exponents.append(e)
    return outs, exponents


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, tile", [(24, 64), (64, 64), (104, 128), (128, 128), (136, 256), (256, 256)])
# (4099 rows: each of the maxima's TOP_CHUNKS CTAs takes several row blocks, some none.)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 13), (333, 1000), (4099, 70)])
def test_halves_operand_passes_match_the_torch_reference_bit_for_bit(head_dim, tile, seqlen_q, seqlen_k):
    """The forward's and the backward's scaled-halves passes (float32.halves_operands,
    backward_operands; the forward's alone above 128, v in value chunks) against
    halves_reference, with heads of very different magnitudes and an all-zero one, into memory
    the caching allocator last held NaN in; and their operand scales, exact powers of two. The
    passes reduce each head's largest |x| themselves; the last row of a head is made its largest
    (the reduction must reach it)."""
    from cute_flash.float32 import backward_operands, halves_operands

    magnitudes = torch.tensor([2.0 ** -70, 1.0, 0.0, 3e7], device="cuda").view(1, 4, 1, 1)
    q, dout = (rand(2, seqlen_q, 4, head_dim).transpose(1, 2) * magnitudes for _ in range(2))
    k, v = (rand(2, seqlen_k, 2, head_dim).transpose(1, 2) * magnitudes[:, 1:3] for _ in range(2))
    for t in (q, k, v, dout):
        t[:, :, -1, -1] = -2 * t.abs().amax(dim=(2, 3))
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    (want_q, want_k, want_v, want_do), (e_q, e_k, e_v, e_do) = halves_reference((q, k, v, dout), tile)
    # The key/value head of each query head: a group of two.
    e_k, e_v = (e.repeat_interleave(2, dim=1) for e in (e_k, e_v))
    down = lambda e: torch.exp2(-e.double()).float()  # noqa: E731
    *fwd, fwd_scales = halves_operands(q, k, v, tile)
    for got, want, label in zip(fwd, (want_q, want_k, want_v), ("q", "k", "v")):
        assert got.shape == want.shape, label
        differ = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
        assert differ == 0, f"{label}: {differ} differ"
    assert torch.equal(fwd_scales, torch.stack([down(e_q + e_k), down(e_v) / 2.0 ** 14], -1))
    (*bwd,), _, bwd_scales = backward_operands("float32x3h", q, k, v, dout, tile)
    want_v = halves_reference((q, k, v, dout), tile, backward=True)[0][2]  # (not in value chunks)
    for got, want, label in zip(bwd, (want_q, want_k, want_v, want_do), ("bwd q", "bwd k", "bwd v", "bwd dout")):
        assert got.shape == want.shape, label
        differ = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
        assert differ == 0, f"{label}: {differ} differ"
    assert torch.equal(bwd_scales, torch.stack([down(e_q + e_k), down(e_v + e_do), down(e_k), down(e_q),
                                                down(e_do) / 2.0 ** 14], -1))


def backward_reference_operands(dtype_name, q, k, v, dout, tile):
    """What cute_flash.float32.backward_operands must return, in torch ops."""
    if dtype_name == "float32x3":
        return (tuple(split_parts(t, tile, -1) for t in (q, k, v, dout)),
                tuple(split_parts(values_for_tf32(t), tile, -2) for t in (q, k, dout)))
    rounded = tuple(rounded_to_tf32(t) for t in (q, k, v, dout))
    transposes = []
    for t in (q, k, dout):
        transposed = values_for_tf32(t)
        transposes.append(rounded_to_tf32(transposed, out=transposed))
    return rounded, tuple(transposes)


@pytest.mark.gpu
@pytest.mark.parametrize("name, head_dim, tile", [("float32", 8, 16), ("float32", 64, 64), ("float32", 128, 128),
                                                  ("float32x3", 8, 16), ("float32x3", 24, 32), ("float32x3", 64, 64)])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 13), (333, 1000)])
def test_backward_operand_pass_matches_the_torch_reference_bit_for_bit(name, head_dim, tile, seqlen_q, seqlen_k):
    from cute_flash.float32 import backward_operands

    q, dout = (rand(2, seqlen_q, 4, head_dim).transpose(1, 2) for _ in range(2))
    k, v = (rand(2, seqlen_k, 2, head_dim).transpose(1, 2) for _ in range(2))
    # Freed NaNs under the outputs' allocations: a padding column left unwritten shows.
    poison = torch.full((64 << 20,), float("nan"), device="cuda")
    del poison
    got = backward_operands(name, q, k, v, dout, tile)
    want = backward_reference_operands(name, q, k, v, dout, tile)
    for got_part, want_part, labels in zip(got, want, (("q", "k", "v", "dout"), ("q^T", "k^T", "dout^T"))):
        for g, w, label in zip(got_part, want_part, labels):
            assert g.shape == w.shape, label
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"{label}: {(g != w).sum().item()} differ"
