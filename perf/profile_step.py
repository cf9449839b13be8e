"""Where the time of one training step of attention goes (GPU script): torch.profiler over
a few forward+backward calls of cute_flash and of SDPA cuDNN on one shape, kernels and host
ops side by side.

    python perf/profile_step.py [--shape 1,64,1024,128] [--causal]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cute_flash  # noqa: E402
from cute_flash.benchmarking import time_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,64,1024,128")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--cprofile", type=int, default=0, help="also cProfile N calls of cute_flash (host side)")
    args = parser.parse_args()
    b, n, s, d = map(int, args.shape.split(","))
    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, n, s, d, device="cuda", dtype=torch.float16)

    def ours():
        cute_flash.flash_attention(q, k, v, causal=args.causal).backward(dout)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=args.causal).backward(dout)

    if args.cprofile:
        import cProfile
        import pstats

        ours()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.cprofile):
            ours()
        torch.cuda.synchronize()
        prof.disable()
        print(f"== cProfile of {args.cprofile} cute_flash fwd+bwd calls (host)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    for name, fn in (("cute_flash", ours), ("sdpa_cudnn", cudnn)):
        ms = time_ms(fn, warmup=5, iters=20)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"== {name}: {ms:.3f} ms per fwd+bwd (time_ms), profile of 5 calls")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
