"""Packed batches (issue 22), cute_flash and flash-attn-4 alternating step by step under one
torch.profiler session: per step its wall time on the GPU (first kernel's start to the last
one's end), the time some kernel ran (the union of kernel intervals) and each kernel's duration,
medians over the steps. Alternating steps put both at the same clocks (the power limit moves
them between sequential runs); the L2 is flushed before each step. Unlike perf/varlen.py's
event timing, host latency before the first kernel does not count.

    python perf/experiments/varlen_timeline.py [--batches mixed,sorted,equal8x8192] [--steps 8] [--only NAMES]

Batches: "mixed" (perf/varlen.py's, --tokens, --seed), "sorted" (the same, longest first),
"reversed" (shortest first), "equalBxS" (B sequences of S tokens).
"""

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from varlen import HEAD_DIM, HEADS, document_lengths, flash_attn_4_step, packed_inputs  # noqa: E402


def short(name):
    for key in ("bwd_sm90", "bwd_dq", "fwd_sm90", "preprocess", "postprocess"):
        if key in name:
            return key
    return name[:40]


def batch_lengths(spec, tokens, seed):
    mixed = document_lengths(tokens, seed)
    if spec == "mixed":
        return mixed
    if spec == "sorted":
        return sorted(mixed, reverse=True)
    if spec == "reversed":
        return sorted(mixed)
    count, length = spec.removeprefix("equal").split("x")
    return [int(length)] * int(count)


def steps_for(lengths, dense: bool):
    longest = max(lengths)
    cu, q, k, v = packed_inputs(lengths)
    dout = torch.randn_like(q)
    fa4 = flash_attn_4_step(q, k, v, cu, longest)

    def ours():
        return cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    def forward_only(fn):
        def step():
            with torch.no_grad():
                fn()
        return step

    steps = {"cute_flash": lambda: torch.autograd.grad(ours(), (q, k, v), dout),
             "flash_attn_4": lambda: torch.autograd.grad(fa4(), (q, k, v), dout),
             "cute_flash fwd": forward_only(ours), "flash_attn_4 fwd": forward_only(fa4)}
    if dense:  # equal lengths: the same batch as (B, N, S, D) views, through the dense path
        b = len(lengths)
        qd, kd, vd = (t.detach().view(b, longest, HEADS, HEAD_DIM).transpose(1, 2).requires_grad_() for t in (q, k, v))
        dd = dout.view(b, longest, HEADS, HEAD_DIM).transpose(1, 2)

        def dense_step():
            return cute_flash.flash_attention(qd, kd, vd, causal=True)
        steps["cute_flash dense"] = lambda: torch.autograd.grad(dense_step(), (qd, kd, vd), dd)
        steps["cute_flash dense fwd"] = forward_only(dense_step)
    return steps


def timeline(steps, rounds):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for step in steps.values():
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    order = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for name, step in steps.items():
                flush.bitwise_not_()  # L2 flushed (a kernel name no step has)
                torch.cuda._sleep(1000)  # the marker before each step
                step()
                torch.cuda.synchronize()
                order.append(name)
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    kernels = sorted((e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    groups, current = [], None
    for e in kernels:
        if "spin" in e["name"]:
            current = []
            groups.append(current)
        elif current is not None and "bitwise_not" not in e["name"]:
            current.append(e)
    assert len(groups) == len(order), (len(groups), len(order))
    stats = defaultdict(lambda: defaultdict(list))
    for name, group in zip(order, groups):
        group = [e for e in group if e["dur"] > 0]
        start, end = group[0]["ts"], max(e["ts"] + e["dur"] for e in group)
        busy, reach = 0.0, start
        for e in group:
            s, t = max(e["ts"], reach), e["ts"] + e["dur"]
            if t > s:
                busy += t - s
                reach = t
        stats[name]["wall"].append(end - start)
        stats[name]["busy"].append(busy)
        per = defaultdict(float)
        for e in group:
            per[short(e["name"])] += e["dur"]
        for key, dur in per.items():
            stats[name][key].append(dur)
    return {name: {key: statistics.median(values) for key, values in table.items()} for name, table in stats.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="mixed")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", default="", help="comma list of step names to time (default: all)")
    args = parser.parse_args()
    for spec in args.batches.split(","):
        lengths = batch_lengths(spec, args.tokens, args.seed)
        print(f"### {spec}: {len(lengths)} sequences, {sum(lengths)} tokens, longest {max(lengths)}", flush=True)
        steps = steps_for(lengths, len(set(lengths)) == 1)
        if args.only:
            steps = {name: step for name, step in steps.items() if name in args.only.split(",")}
        table = timeline(steps, args.steps)
        keys = sorted({key for row in table.values() for key in row}, key=lambda k: (k not in ("wall", "busy"), k))
        print(f"{'us (medians)':24s}" + "".join(f"{key:>12s}" for key in keys))
        for name, row in table.items():
            print(f"{name:24s}" + "".join(f"{row.get(key, 0):12.1f}" for key in keys), flush=True)


if __name__ == "__main__":
    main()
