"""kernels/ptx.py on the CPU: exp2_fma's PTX, interpreted instruction by instruction in float32
(torch on the CPU), against 2^x in float64; and its text holds the coefficients it claims."""

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
    """ptx._exp2_fma_asm's PTX, interpreted instruction by instruction on float32 tensors (the
    subset it uses; .b32 / .s32 registers hold the same bits as float32)."""
    x = torch.as_tensor(x, dtype=F32).flatten()
    regs = {"$1": x}
    for line in ptx._exp2_fma_asm().splitlines():
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
