"""Which 16-bit operand splits reach float32 accuracy in attention, forward and backward: a
CPU emulation in float64 (no kernel; the tensor cores' float32 accumulation is not modelled, so
real kernels land a few times higher: 3xTF32 emulates at ~1.2e-7 and measures 3-7e-7).

Every GEMM A B of the forward (S = Q K^T, O = P V) and the backward (dP = dO V^T, dV = P^T dO,
dK = dS^T Q, dQ = dS K) is taken as hi hi + hi lo + lo hi over two parts of each operand:
  tf32  TF32 parts (3xTF32, the shipped "float32x3");
  bf16  bf16 parts (16 significant bits: misses 1e-5 on this data);
  fp16  fp16 parts of each (batch, head) scaled by a power of two that puts its largest |x|
        at 1 (P scaled by 2^14, as the "float32x3h" forward does), with dS's parts made
        without scaling ("none"), with a fixed power of two from a bound on |dP - delta|
        ("bound"), or per row of the GEMM's A operand ("rowmax": dS per query for dQ, dS^T per
        key for dK, each row's largest |dS| at 2^14: a row's factor comes out of its product).
Printed: the relative (Frobenius) error against float64 of O, dV, dK and dQ.

    python perf/experiments/float32_split_numerics.py
"""

import math

import torch


def tf32(x):
    """x rounded to TF32 (10 stored mantissa bits), to nearest."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**11) / 2**11, exponent)


def parts(x, kind, scale=1.0):
    """(hi, lo) of x times `scale` in `kind`'s format, scaled back (exact: powers of two)."""
    scaled = x * scale
    if kind == "tf32":
        hi = tf32(scaled)
        lo = tf32(scaled - hi)
    else:
        dtype = torch.float16 if kind == "fp16" else torch.bfloat16
        hi = scaled.to(dtype).double()
        lo = (scaled - hi).to(dtype).double()
    return hi / scale, lo / scale


def product(a, b, kind, scale_a=1.0, scale_b=1.0):
    a_hi, a_lo = parts(a, kind, scale_a)
    b_hi, b_lo = parts(b, kind, scale_b)
    return a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi


def head_scale(x, target=1.0):
    """The power of two per (batch, head) that puts the largest |x| just below `target`."""
    top = x.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30)
    return 2.0 ** torch.floor(torch.log2(target / top))


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def errors(seqlen_q, seqlen_k, head_dim, q_scale, kind, ds_mode, causal=False):
    torch.manual_seed(0)
    q = torch.randn(1, 1, seqlen_q, head_dim, dtype=torch.float64) * q_scale
    k, v = (torch.randn(1, 1, seqlen_k, head_dim, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, 1, seqlen_q, head_dim, dtype=torch.float64)
    scale = 1 / math.sqrt(head_dim)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).triu(1) if causal else None

    def softmax(s):
        if mask is not None:
            s = s.masked_fill(mask, -math.inf)
        return torch.exp(s - torch.logsumexp(s, -1, keepdim=True))

    p = softmax(q @ k.transpose(-1, -2) * scale)
    o = p @ v
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    want = dict(o=o, dv=p.transpose(-1, -2) @ do, dk=ds.transpose(-1, -2) @ q * scale, dq=ds @ k * scale)

    halves = kind == "fp16"
    sq, sk, sv, sdo = (head_scale(t) if halves else 1.0 for t in (q, k, v, do))
    t = (lambda x: x.transpose(-1, -2) if torch.is_tensor(x) else x)  # noqa: E731
    p_got = softmax((product(q, k.transpose(-1, -2), kind, sq, t(sk)) * scale).float().double()).float().double()
    p_scale = 2.0 ** 14 if halves else 1.0
    o_got = product(p_got, v, kind, p_scale, t(sv))
    dp = product(do, v.transpose(-1, -2), kind, sdo, t(sv))
    ds_got = (p_got * (dp - (do * o_got).sum(-1, keepdim=True))).float().double()
    ds_rows = ds_cols = 1.0  # dS's scale for dQ (per query row) and dS^T's for dK (per key)
    if halves and ds_mode == "bound":
        ds_rows = ds_cols = 2.0 ** (14 - math.ceil(math.log2(8 * head_dim)))
    elif halves and ds_mode == "rowmax":
        # A row's scale factors out of its product: dQ's rows are queries, dK's keys.
        ds_rows = head_scale(ds_got.unsqueeze(-2), 2.0 ** 14).squeeze(-2)
        ds_cols = head_scale(ds_got.transpose(-1, -2).unsqueeze(-2), 2.0 ** 14).squeeze(-2)
    got = dict(o=o_got, dv=product(p_got.transpose(-1, -2), do, kind, p_scale, sdo),
               dk=product(ds_got.transpose(-1, -2), q, kind, ds_cols, sq) * scale,
               dq=product(ds_got, k, kind, ds_rows, sk) * scale)
    return {name: relative(got[name], want[name]) for name in want}


def main():
    kinds = (("tf32", None), ("bf16", None), ("fp16", "none"), ("fp16", "bound"), ("fp16", "rowmax"))
    for seqlen_q, seqlen_k in ((1024, 1024), (512, 8192), (256, 32768)):
        for q_scale in (1.0, 4.0):
            for kind, ds_mode in kinds:
                errs = errors(seqlen_q, seqlen_k, 128, q_scale, kind, ds_mode)
                print(f"{seqlen_q}x{seqlen_k} q x{q_scale:g} {kind} dS {ds_mode or '-':6s}",
                      " ".join(f"{name} {e:.1e}" for name, e in errs.items()))


if __name__ == "__main__":
    main()
