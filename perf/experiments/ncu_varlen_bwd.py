"""One packed and one dense forward + backward of the same equal-length batch inside a profiler
range, for Nsight Compute to compare the main backward kernels (GPU script; both run once
before the range). The dense call takes (B, N, S, D) views of the packed tensors: the same
memory, so only the packed kernels' own work differs.

    ncu --profile-from-start off --kernel-name regex:bwd_sm90 --section ... \
        python perf/experiments/ncu_varlen_bwd.py [--batch 8] [--seqlen 2048]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import run_in_profiler_range  # noqa: E402

HEADS, D = 32, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    args = parser.parse_args()
    b, s = args.batch, args.seqlen
    q, k, v = (torch.randn(b * s, HEADS, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b * s, HEADS, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    dense = [t.detach().view(b, s, HEADS, D).transpose(1, 2).requires_grad_() for t in (q, k, v)]
    dense_dout = dout.view(b, s, HEADS, D).transpose(1, 2)
    runs = (lambda: torch.autograd.grad(cute_flash.flash_attention_varlen(q, k, v, cu, cu, s, s, causal=True),
                                        (q, k, v), dout),
            lambda: torch.autograd.grad(cute_flash.flash_attention(*dense, causal=True), dense, dense_dout))
    run_in_profiler_range(runs, grad=True)


if __name__ == "__main__":
    main()
