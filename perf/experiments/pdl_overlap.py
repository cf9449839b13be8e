"""Forward+backward with and without the dQ postprocess overlapping the main backward kernel
(GPU script).

    python perf/experiments/pdl_overlap.py [--shape 4,64,8192,128] [--rounds 30] [--csv FILE]

cute_flash runs twice per round: as shipped (the postprocess launched with programmatic
dependent launch, converting the finished heads while the main kernel's last CTAs run) and
with launch_bwd.backward(..., overlap_postprocess=False) (the postprocess after the main
kernel), both through a small autograd.Function like the public API's. Both run beside
flash-attn-4 and SDPA's cuDNN backend: each round times one fwd+bwd of each (CUDA events,
their public autograd path), so that every implementation's samples are taken
within the same fraction of a second -- over a few minutes the GPU's clock and power state
drift by several % (perf/NOTES.md). Prints per implementation the median and minimum over
rounds and the median of its per-round ratio to cute_flash's sample.
"""

import argparse
import csv
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/: breakdown.py

import cute_flash  # noqa: E402
from breakdown import implementations as breakdown_implementations  # noqa: E402
from cute_flash import launch_bwd  # noqa: E402
from cute_flash.benchmarking import time_one_call_ms  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402


class _Attention(torch.autograd.Function):
    """cute_flash's forward, and its backward with or without the overlapped postprocess
    (the public API's autograd, cute_flash.api, with the switch as an argument)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, overlap):
        scale = 1 / math.sqrt(q.shape[-1])
        with torch.no_grad():
            out, lse = cute_flash.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.overlap, ctx.scale = causal, overlap, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = launch_bwd.backward(q, k, v, out, dout, lse, AttentionProblem.of(ctx.causal), ctx.scale,
                                         overlap_postprocess=ctx.overlap)
        return dq, dk, dv, None, None


def implementations(causal):
    """name -> (layout, f(q, k, v)): perf/breakdown.py's, with cute_flash twice."""
    def ours(overlap):
        def run(q, k, v):
            return _Attention.apply(q, k, v, causal, overlap)
        return run

    peers = breakdown_implementations(causal)
    impls = {"cute_flash": ("bnsd", ours(True)), "cute_flash_serial": ("bnsd", ours(False))}
    impls.update((name, impl) for name, impl in peers.items() if name != "cute_flash")
    return impls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,64,8192,128")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    b, n, s, d = (int(x) for x in args.shape.split(","))
    rows = []
    summary = []
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        impls = implementations(causal)
        inputs = {}
        for layout in ("bnsd", "bsnd"):
            shape = (b, n, s, d) if layout == "bnsd" else (b, s, n, d)
            tensors = [torch.randn(shape, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3)]
            inputs[layout] = (tensors, torch.randn(shape, device="cuda", dtype=torch.float16))
        calls = {}
        for name, (layout, fn) in impls.items():
            (q, k, v), dout = inputs[layout]

            def call(fn=fn, q=q, k=k, v=v, dout=dout):
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(dout)
            calls[name] = call
        samples = {name: [] for name in calls}
        # One call of each implementation per round, in turn: the clock and power state
        # drift over seconds, so neighbouring samples are compared, not separate runs.
        for round_index in range(-args.warmup, args.rounds):
            for name, call in calls.items():
                ms = time_one_call_ms(call)
                if round_index >= 0:
                    samples[name].append(ms)
                    rows.append(dict(causal=causal, round=round_index, impl=name, ms=round(ms, 4)))
        base = samples["cute_flash"]
        for name, values in samples.items():
            ratio = statistics.median(v / b0 for v, b0 in zip(values, base))
            summary.append((name, causal, statistics.median(values), min(values), ratio))
            rows.append(dict(causal=causal, round="median", impl=name, ms=round(statistics.median(values), 4)))
        del inputs, calls
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["causal", "round", "impl", "ms"])
            writer.writeheader()
            writer.writerows(rows)
    print(f"\nfwd+bwd {args.shape} fp16, {args.rounds} interleaved rounds (one call each)")
    print(f"{'impl':18s} {'causal':>6s} {'median':>8s} {'min':>8s} {'x ours':>7s}")
    for name, causal, med, low, ratio in summary:
        print(f"{name:18s} {int(causal):6d} {med:8.3f} {low:8.3f} {ratio:7.4f}")


if __name__ == "__main__":
    main()
