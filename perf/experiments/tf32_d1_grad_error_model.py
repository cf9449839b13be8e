"""How large dq's relative error gets under TF32 at D = 1 (CPU, no GPU): a float64 model of the
TF32 backward's roundings (q, k, v, dO, P and dS rounded to TF32 where they enter a GEMM, the
rest exact) against float64, over 400 random draws of tests/test_float32.py's (2, 3, 17, 1) x
300 keys case. At D = 1, dq = sum_j dS_ij k_j cancels (sum_j dS_ij = 0), so its error has a long
tail; the tests' TF32 tolerance at D = 1 follows it (fifty-seventh session: median 1.2e-3, 99th
percentile 2.6e-3, largest 3.05e-3).

    python perf/experiments/tf32_d1_grad_error_model.py
"""

import torch


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to nearest (ties away) at TF32's 10 explicit mantissa bits, as float64."""
    bits = x.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).double()


def dq_of(q, k, v, dout, rounded):
    """dq of softmax(q k^T) v with `rounded` applied to every GEMM operand."""
    scores = rounded(q) @ rounded(k).transpose(-1, -2)
    p = torch.softmax(scores, dim=-1)
    out = rounded(p) @ rounded(v)
    dp = rounded(dout) @ rounded(v).transpose(-1, -2)
    delta = (dout * out).sum(-1, keepdim=True)
    return rounded(p * (dp - delta)) @ rounded(k)


def main():
    torch.manual_seed(0)
    errors = []
    for _ in range(400):
        q, dout = (torch.randn(2, 3, 17, 1).double() for _ in range(2))
        k, v = (torch.randn(2, 3, 300, 1).double() for _ in range(2))
        want = dq_of(q, k, v, dout, lambda x: x)
        errors.append(((dq_of(q, k, v, dout, tf32) - want).norm() / want.norm()).item())
    errors.sort()
    print(f"median {errors[200]:.2e} p90 {errors[360]:.2e} p99 {errors[396]:.2e} max {errors[-1]:.2e}")


if __name__ == "__main__":
    main()
