"""Is a case slower through the public API than through the compiled kernel? (GPU)

    python perf/experiments/api_vs_kernel.py B N S D [--causal]

Times the same inputs four ways in one process: the compiled kernel called directly and the
public API, each with one CUDA-event pair per call and with batches of back-to-back calls.
"""

import argparse
import math
import statistics

import torch

from cute_flash.torch_helpers import DENSE_BATCH

import cute_flash
from cute_flash import launch_fwd
from cute_flash.benchmarking import time_ms
from cute_flash.kernels.problem import AttentionProblem


def per_call_events(fn, warmup=5, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", type=int, nargs=4)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    b, n, s, d = args.shape
    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    kernel = launch_fwd.kernel_for(q.dtype, d, AttentionProblem.of(args.causal), q.device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda")
    scale = 1 / math.sqrt(d)
    paths = {
        "kernel": lambda: kernel(q, k, v, out, lse, None, *DENSE_BATCH, scale),
        "api": lambda: cute_flash.flash_attention(q, k, v, causal=args.causal),
    }
    for rep in range(2):
        for name, fn in paths.items():
            print(f"rep {rep} {name:6s} per-call events {per_call_events(fn):.4f} ms   "
                  f"batched {time_ms(fn):.4f} ms")


if __name__ == "__main__":
    main()
