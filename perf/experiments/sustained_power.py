"""Under a long load the GPU runs at its power limit, so a kernel's speed there depends on its
energy per unit of work as much as on its cycles. This runs each named step of issue 23's prefill
(perf/experiments/prefill_gqa_ab.py) back to back for --seconds, in interleaved phases, while
nvidia-smi samples the SM clock and the board power, and prints per step: ms per launch, mean SM
clock, mean power, and energy per launch (mean power x ms).

    python perf/experiments/sustained_power.py [--batch 4] [--seconds 4] [--phases 2]
        [--steps ours_causal,fa4_gqa] [--variants causal] [--gqa]

--regimes instead times each step in interleaved rounds two ways in the same run: as the
benchmarks do (benchmarking.time_ms: L2 flushed, one call per sample after a hold) and as a
back-to-back stream (--stream calls between two events, no flush), to see whether a ratio
depends on the regime.
"""

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hold_regime  # noqa: E402
import prefill_gqa_ab  # noqa: E402


def sample_log(path):
    """(timestamp, MHz, W) rows of an nvidia-smi csv log."""
    rows = []
    for line in Path(path).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[1].split()[0].isdigit():
            continue
        stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((stamp, float(parts[1].split()[0]), float(parts[2].split()[0])))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--steps", default="ours_causal,fa4_gqa")
    parser.add_argument("--variants", default="causal")
    parser.add_argument("--log", default="/tmp/smi.csv")
    parser.add_argument("--regimes", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stream", type=int, default=30)
    parser.add_argument("--gqa", action="store_true",
                        help="add hold_regime.py's GQA self-attention steps (ours_gqa_self, fa4_gqa_self)")
    args = parser.parse_args()
    prefill_gqa_ab.DIRECT_VARIANTS.extend(x for x in args.variants.split(",") if x)
    if args.regimes:
        return regimes(args)
    with torch.no_grad():
        impls = prefill_gqa_ab.steps(args.batch)
        if args.gqa:
            impls.update(hold_regime.gqa_steps())
        names = args.steps.split(",")
        for name in names:  # compile and warm
            impls[name]()
        torch.cuda.synchronize()
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                "--format=csv,noheader", "-lms", "50"], stdout=open(args.log, "w"))
        time.sleep(1.0)
        spans = {name: [] for name in names}
        for _ in range(args.phases):
            for name in names:
                start = time.time()
                launches = 0
                while time.time() - start < args.seconds:
                    for _ in range(20):
                        impls[name]()
                    launches += 20
                    torch.cuda.synchronize()
                end = time.time()
                spans[name].append((start, end, launches))
                time.sleep(0.5)
        smi.terminate()
        smi.wait()
    rows = sample_log(args.log)
    print(f"B = {args.batch}, {args.seconds} s per phase, {args.phases} phases each")
    print(f"{'step':18s} {'ms':>8s} {'MHz':>6s} {'W':>6s} {'mJ/launch':>10s}")
    for name, phases in spans.items():
        ms, mhz, watts = [], [], []
        for start, end, launches in phases:
            ms.append((end - start) * 1e3 / launches)
            # skip the phase's first half second: clocks settle after the switch
            inside = [r for r in rows if start + 0.5 <= r[0] <= end]
            mhz += [r[1] for r in inside]
            watts += [r[2] for r in inside]
        m, w = statistics.median(ms), statistics.mean(watts) if watts else float("nan")
        clock = statistics.mean(mhz) if mhz else float("nan")
        print(f"{name:18s} {m:8.4f} {clock:6.0f} {w:6.0f} {w * m:10.1f}   per phase ms {[round(x, 3) for x in ms]}")


def regimes(args):
    from cute_flash.benchmarking import time_ms
    with torch.no_grad():
        impls = prefill_gqa_ab.steps(args.batch)
        names = args.steps.split(",")
        bench = {name: [] for name in names}
        stream = {name: [] for name in names}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.rounds):
            for name in names:
                bench[name].append(time_ms(impls[name], warmup=2, iters=5, flush=True))
                impls[name]()
                start.record()
                for _ in range(args.stream):
                    impls[name]()
                end.record()
                end.synchronize()
                stream[name].append(start.elapsed_time(end) / args.stream)
    base = names[-1]
    b0, s0 = statistics.median(bench[base]), statistics.median(stream[base])
    print(f"B = {args.batch}, {args.rounds} rounds: ms (ratio {base} / this)")
    print(f"{'step':18s} {'flushed':>9s} {'ratio':>6s} {'stream':>9s} {'ratio':>6s}")
    for name in names:
        b, s_ = statistics.median(bench[name]), statistics.median(stream[name])
        print(f"{name:18s} {b:9.4f} {b0 / b:6.3f} {s_:9.4f} {s0 / s_:6.3f}")


if __name__ == "__main__":
    main()
