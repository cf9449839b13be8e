"""One packed and one dense forward of the same equal-length batch inside a profiler range,
for Nsight Compute to compare (GPU script; both run once before the range).

    ncu --profile-from-start off --kernel-name regex:fwd_sm90 --section ... \
        python perf/experiments/ncu_varlen.py [--batch 64] [--seqlen 1024]
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
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=1024)
    args = parser.parse_args()
    b, s = args.batch, args.seqlen
    q, k, v = (torch.randn(b * s, HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    dense = [t.view(b, s, HEADS, D).transpose(1, 2) for t in (q, k, v)]
    runs = (lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, s, s, causal=True),
            lambda: cute_flash.flash_attention(*dense, causal=True))
    run_in_profiler_range(runs)


if __name__ == "__main__":
    main()
