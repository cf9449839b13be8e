"""Our dense forward and flash-attn-4's on the same tensors inside a profiler range, for Nsight
Compute to compare the two forward kernels (GPU script; each runs once before the range).
flash-attn-4 takes (B, S, N, D); ours the (B, N, S, D) views of the same memory, so both read
the same bytes in the same order.

    ncu --profile-from-start off --kernel-name regex:ForwardSm90 --section ... \
        python perf/experiments/ncu_fwd_peer.py [--shape 1,32,8192,128] [--dtype bfloat16]
        [--value-head-dim 128] [--seqlen-k 512]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import run_in_profiler_range  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,32,8192,128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--value-head-dim", type=int, default=None, help="v's head dim (default: D)")
    parser.add_argument("--seqlen-k", type=int, default=None, help="keys (default: the shape's S)")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func

    b, n, s, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    sk = args.seqlen_k or s
    q = torch.randn(b, s, n, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, n, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, n, args.value_head_dim or d, device="cuda", dtype=dtype)
    runs = []
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        runs.append(lambda c=causal: cute_flash.flash_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), causal=c))
        runs.append(lambda c=causal: flash_attn_func(q, k, v, causal=c))
    run_in_profiler_range(runs)


if __name__ == "__main__":
    main()
