"""Kernel by kernel: where a small packed batch's forward + backward goes (issue 22's 8k-token
case, perf/varlen.py's batch), cute_flash beside flash-attn-4's varlen, torch.profiler.

    python perf/experiments/varlen_bwd_profile.py [--tokens 8192] [--seed 0] [--iters 10]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from varlen import HEAD_DIM, document_lengths, flash_attn_4_step, packed_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cprofile", type=int, default=0, help="then cProfile N cute_flash steps (host side)")
    args = parser.parse_args()
    lengths = document_lengths(args.tokens, args.seed)
    print("lengths", lengths)
    longest = max(lengths)
    cu, q, k, v = packed_inputs(lengths)
    dout = torch.randn_like(q)
    fa4 = flash_attn_4_step(q, k, v, cu, longest)

    impls = {
        "cute_flash": lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True),
        # What an eager call with gradients ran before the twenty-fourth session: the custom op
        # and its registered autograd (without flash_attention_varlen's checks).
        "cute_flash via the op": lambda: torch.ops.cute_flash.flash_attention_varlen_fwd(
            q, k, v, cu, cu, None, longest, longest, True, HEAD_DIM ** -0.5)[0],
        "flash_attn_4": fa4,
    }
    for name, fn in impls.items():
        for _ in range(5):
            torch.autograd.grad(fn(), (q, k, v), dout)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            torch.autograd.grad(fn(), (q, k, v), dout)
        end.record()
        end.synchronize()
        print(f"== {name}: {start.elapsed_time(end) / args.iters:.3f} ms per fwd+bwd (back to back)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                torch.autograd.grad(fn(), (q, k, v), dout)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    if args.cprofile:
        import cProfile
        import pstats

        step = impls["cute_flash"]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.cprofile):
            torch.autograd.grad(step(), (q, k, v), dout)
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
