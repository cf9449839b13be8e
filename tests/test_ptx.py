"""kernels/ptx.py on the CPU: exp2_fma's and exp2_fma_bounded's PTX, interpreted instruction by
instruction in float32 (torch on the CPU), against 2^x in float64; and their text holds the
coefficients they claim."""

import re
import struct

import pytest
import torch

from cute_flash.kernels import ptx

F32 = torch.float32


def _bits(t):
    """float32 -> its 32 bits as non-negative int64."""
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b):
    """32 bits (int64, any value: wrapped mod 2^32) -> float32."""
    b = b & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(F32)

def _fma32(a, b, c):
    # a * b is exact in float64 (two 24-bit significands); one rounding to float32 after the add
    # (a double rounding far below the polynomial's own error).
    return (a.double() * b.double() + c.double()).to(F32)


def _operand(regs, token, n):
    token = token.strip()
    if token.startswith("0f"):
        return torch.full((n,), struct.unpack(">f", bytes.fromhex(token[2:]))[0], dtype=F32)
    if token.isdigit():
        return int(token)
    return regs[token]


def exp2_fma_replayed(x):
    """ptx._exp2_fma_asm's PTX, interpreted instruction by instruction on float32 tensors."""
    return replayed(ptx._exp2_fma_asm(), x)


def exp2_fma_bounded_replayed(x, scale, offset):
    """ptx._exp2_fma_bounded_asm's PTX for 2^(x * scale - offset), interpreted likewise."""
    x = torch.as_tensor(x, dtype=F32).flatten()
    return replayed(ptx._exp2_fma_bounded_asm(offset), x, torch.full_like(x, scale))


def replayed(asm, x, *more):
    """PTX interpreted on float32 tensors (the subset these functions use; .b32 / .s32
    registers hold the same bits as float32): $1 = x, $2 ... = more; returns $0."""
    x = torch.as_tensor(x, dtype=F32).flatten()
    regs = {"$1": x, **{f"${i + 2}": m for i, m in enumerate(more)}}
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *srcs = [a.strip() for a in args.split(",")]
        vals = [_operand(regs, a, x.numel()) for a in srcs]
        if op == "max.f32":
            out = torch.maximum(*vals)
        elif op == "add.rn.f32":
            out = vals[0] + vals[1]
        elif op == "sub.rn.f32":
            out = vals[0] - vals[1]
        elif op == "fma.rn.f32":
            out = _fma32(*vals)
        elif op in ("mov.f32", "mov.b32"):
            out = vals[0].clone()
        elif op == "shl.b32":
            out = _from_bits(_bits(vals[0]) << vals[1])
        elif op == "add.s32":
            out = _from_bits(_bits(vals[0]) + _bits(vals[1]))
        else:
            raise AssertionError(f"an instruction the replay does not know: {line}")
        regs[dst] = out
    return regs["$0"]


def test_exp2_fma_is_exact_to_its_stated_error():
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-125.0, 0.0, 400001, dtype=torch.float64),
                   torch.rand(100000, generator=generator, dtype=torch.float64) * 125.5 - 125.0,
                   -torch.arange(126, dtype=torch.float64)]).to(F32)
    got = exp2_fma_replayed(x).double()
    want = torch.exp2(x.double())
    assert torch.isfinite(got).all() and (got > 0).all()
    assert (got / want - 1).abs().max().item() < 3e-6


@pytest.mark.parametrize("x", [-125.5, -200.0, -1e30, float("-inf")])
def test_exp2_fma_clamps_below_minus_125(x):
    """Below the clamp (and -inf, a masked score) the result is 2^-125 (to the polynomial's
    error), a normal float, never a wrapped exponent: OnlineSoftmax takes it only for unmasked
    scores."""
    got = exp2_fma_replayed([x])[0].item()
    assert abs(got / 2.0**-125 - 1) < 3e-6


def test_the_ptx_carries_the_coefficients_and_the_constants():
    asm = ptx._exp2_fma_asm()
    hex_of = lambda v: "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]  # noqa: E731
    for coeff in ptx.EXP2_FMA_COEFFS:
        assert hex_of(coeff) in asm
    assert hex_of(-125.0) in asm and hex_of(1.5 * 2**23) in asm
    # The Horner chain: one FMA per coefficient but the leading one.
    assert len(re.findall(r"\bfma\.rn\.f32\b", asm)) == len(ptx.EXP2_FMA_COEFFS) - 1


# (softcap c, its bounded offset M): exponents x * c log2(e) - M for tanh values x in [-1, 1]
# (ScoreTransform.bounded_offset_log2), from no offset to the largest cap kept bounded.
BOUNDED_CASES = [(30.0, 0), (44.0, 0), (50.0, 9), (65.0, 30)]


@pytest.mark.parametrize("cap, offset", BOUNDED_CASES)
def test_exp2_fma_bounded_is_exact_to_bf16s_rounding(cap, offset):
    """2^(x c log2(e) - M) over the whole bounded range to 8e-5 relative (the fit's 7.5e-5; P is
    rounded to bf16 after it, 2^-9), normal numbers only, including both ends of the range
    and exponents exactly halfway between integers (ties of the rounding to n)."""
    from cute_flash.kernels.score_transform import LOG2_E, ScoreTransform
    from cute_flash.kernels.problem import AttentionProblem
    import cutlass
    assert ScoreTransform(AttentionProblem.of(True, softcap=cap)).bounded_offset_log2(cutlass.BFloat16) == offset
    scale = torch.tensor(cap * LOG2_E, dtype=F32)
    generator = torch.Generator().manual_seed(1)
    halves = ((torch.arange(-125, 64, dtype=torch.float64) + 0.5 + offset) / scale.double()).to(F32)
    x = torch.cat([torch.linspace(-1.0, 1.0, 400001, dtype=torch.float64).to(F32),
                   torch.rand(100000, generator=generator, dtype=torch.float64).to(F32) * 2 - 1,
                   halves[halves.abs() <= 1], torch.tensor([-1.0, 1.0, 0.0, -0.0], dtype=F32)])
    got = exp2_fma_bounded_replayed(x, scale.item(), offset).double()
    want = torch.exp2(x.double() * scale.double() - offset)
    assert (got >= 2.0**-126).all() and torch.isfinite(got).all()
    assert (got / want - 1).abs().max().item() < 8e-5


def test_the_bounded_ptx_carries_its_coefficients_and_folds_the_offset():
    asm = ptx._exp2_fma_bounded_asm(30)
    hex_of = lambda v: "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]  # noqa: E731
    for coeff in ptx.EXP2_BOUNDED_COEFFS:
        assert hex_of(coeff) in asm
    assert hex_of(1.5 * 2**23 - 30) in asm and "max.f32" not in asm
    # Two FMAs for the exponent's product and the reduced argument, then the Horner chain.
    assert len(re.findall(r"\bfma\.rn\.f32\b", asm)) == 2 + len(ptx.EXP2_BOUNDED_COEFFS) - 1
