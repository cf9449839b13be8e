"""Why dQ of tiny causal cases misses a norm-relative bound (GPU diagnostic, kept for the record).

delta_i = rowsum(dO_i * O_i) is computed, as in every FlashAttention backward, from the saved
16-bit output O. Where the exact dQ cancels (a row that sees a single key has dQ = 0), what
is left is that rounding: dS_ij = P_ij (dP_ij - delta_i) with delta off by ~eps * |dO| |O|.
This script runs one such case many times and reports, per backward path, dQ's error against
(a) the float64 reference and (b) the float64 reference whose delta uses the rounded O.

    python perf/experiments/delta_rounding.py [--trials 30]
"""

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def grads_float64(q, k, v, dout, causal, scale, out_for_delta=None):
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v if out_for_delta is None else out_for_delta.double()
    ds = p * (dout @ v.transpose(-1, -2) - (dout * o).sum(-1, keepdim=True))
    return ds @ k * scale


def main():
    import cute_flash
    from cute_flash import launch_bwd
    from cute_flash.config import get_config
    from cute_flash.kernels.problem import AttentionProblem

    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args()
    b, n, sq, sk, d, dtype, causal = 1, 1, 2, 123, 64, torch.bfloat16, True
    scale = 1 / math.sqrt(d)
    config = get_config("bfloat16", d, causal, "bwd", torch.device("cuda"))
    dq_config = dataclasses.replace(get_config("bfloat16", d, causal, "bwd_dq", torch.device("cuda")), min_seqlen_q=1)
    worst = {}
    for _ in range(args.trials):
        q, k, v = (torch.randn(b, n, s, d, device="cuda").to(dtype) for s in (sq, sk, sk))
        out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
        dout = torch.randn_like(out)
        exact = grads_float64(q, k, v, dout, causal, scale)
        rounded = grads_float64(q, k, v, dout, causal, scale, out_for_delta=out)
        for path, dqc in (("fused", None), ("separate", dq_config)):
            dq, _, _ = launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                                       config=config, dq_config=dqc)
            for ref_name, ref in (("exact delta", exact), ("delta from rounded O", rounded)):
                err = ((dq.double() - ref).norm() / ref.norm()).item()
                key = (path, ref_name)
                worst[key] = max(worst.get(key, 0.0), err)
    print(f"(B,N,Sq,Sk,D) = {(b, n, sq, sk, d)} bf16 causal, {args.trials} trials: worst dQ norm-relative error")
    for (path, ref_name), err in worst.items():
        print(f"  {path:9s} vs float64 with {ref_name:22s} {err:.2e}")


if __name__ == "__main__":
    main()
