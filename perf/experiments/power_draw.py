"""SM clock and board power while each implementation runs fwd+bwd back to back (GPU script).

    python perf/experiments/power_draw.py [--shape 4,64,8192,128] [--seconds 4] [--repeats 2] [--causal 0]

An H100 at its power limit lowers its SM clock, so a kernel that needs more energy per
attention FLOP also runs at a lower clock. This runs each implementation (cute_flash,
flash-attn-4, SDPA cuDNN) for a few seconds at a time, in turn, while `nvidia-smi` samples
clock, power, temperature and throttle reasons every 100 ms, and prints per window the
median clock and power and the ms per fwd+bwd.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdl_overlap import implementations  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,64,8192,128")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--causal", type=int, default=0)
    parser.add_argument("--impls", default="cute_flash,flash_attn_4,sdpa_cudnn")
    parser.add_argument("--log", default="nvsmi.csv")
    args = parser.parse_args()
    b, n, s, d = (int(x) for x in args.shape.split(","))
    impls = implementations(bool(args.causal))
    calls = {}
    for name in args.impls.split(","):
        if name not in impls:
            continue
        layout, fn = impls[name]
        shape = (b, n, s, d) if layout == "bnsd" else (b, s, n, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3))
        dout = torch.randn(shape, device="cuda", dtype=torch.float16)

        def call(fn=fn, q=q, k=k, v=v, dout=dout):
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(dout)
        call()
        torch.cuda.synchronize()
        calls[name] = call
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=open(args.log, "w"))
    time.sleep(1.0)
    windows = []
    try:
        for _ in range(args.repeats):
            for name, call in calls.items():
                t0 = time.time()
                count = 0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                while time.time() - t0 < args.seconds:
                    call()
                    count += 1
                    if count % 8 == 0:
                        torch.cuda.synchronize()
                end.record()
                end.synchronize()
                windows.append((name, t0 + 0.5, time.time(), start.elapsed_time(end) / count))
    finally:
        time.sleep(0.5)
        smi.terminate()
        smi.wait()
    samples = []
    for line in open(args.log):
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except (ValueError, IndexError):
            continue
    print(f"fwd+bwd {args.shape} fp16 causal={args.causal}: {args.seconds} s windows")
    print(f"{'impl':14s} {'ms/iter':>8s} {'SM MHz':>7s} {'W':>6s} {'degC':>5s} throttle")
    for name, t0, t1, ms in windows:
        inside = [x for x in samples if t0 <= x[0] <= t1]
        if not inside:
            print(f"{name:14s} {ms:8.3f}  (no nvidia-smi samples)")
            continue
        reasons = sorted({x[4] for x in inside})
        print(f"{name:14s} {ms:8.3f} {statistics.median(x[1] for x in inside):7.0f} "
              f"{statistics.median(x[2] for x in inside):6.0f} {statistics.median(x[3] for x in inside):5.0f} "
              f"{','.join(reasons)}")


if __name__ == "__main__":
    main()
