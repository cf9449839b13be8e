"""Where a small forward's host time goes (GPU machine; sixty-third session): cProfile over calls
of cute_flash.flash_attention on bf16 inputs that require grad (the autograd Function's
path) and without grad, functions by their own time; beside that, host us per call of each
and of forward + backward (torch.autograd.grad through the forward's graph; sixty-seventh
session) (rotated rounds, medians) next to SDPA cuDNN's. cProfile inflates every row: read shares.

    python perf/experiments/fwd_host_profile.py [--shape 1,16,1024,64] [--calls 2000] [--top 25]
        [--profile 'ours, grad;ours, fwd+bwd']   (--profile '': the host times only)
"""

import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from host_overhead import per_call_us, rotated_per_call_us  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,16,1024,64")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--profile", default="ours, grad;ours, no grad", help="rows to profile, ';'-separated")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qn, kn, vn = (t.detach() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(*t):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)

    dout = torch.randn_like(qn)

    def ours(*t):
        return cute_flash.flash_attention(*t, causal=True)

    fns = {
        "ours, grad": lambda: ours(q, k, v),
        "ours, no grad": lambda: ours(qn, kn, vn),
        "cudnn, grad": lambda: cudnn(q, k, v),
        "cudnn, no grad": lambda: cudnn(qn, kn, vn),
        # End to end: the forward with its graph, then autograd's backward through it.
        "ours, fwd+bwd": lambda: torch.autograd.grad(ours(q, k, v), (q, k, v), dout),
        "cudnn, fwd+bwd": lambda: torch.autograd.grad(cudnn(q, k, v), (q, k, v), dout),
    }
    for name, values in rotated_per_call_us(fns, 5, 300, per_call_us).items():
        print(f"{str(shape):20s} {name:16s} {statistics.median(values):8.1f} us per call (host)", flush=True)
    for name in filter(None, args.profile.split(";")):
        fn = fns[name]
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"== {name}: cProfile, {args.calls} calls (own time)")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
