"""The backward preprocess inside the main kernel (fused_preprocess) vs the separate
preprocess kernel (GPU script).

    python perf/fused_prep.py [--rounds 20] [--shape 4,64,8192,128] [--no-check]

1. Correctness: for a set of cases with many heads (so that most heads are prepared by the
   main kernel) dq, dk, dv of the fused config are compared with the float64 reference and
   with the same config without fusion, also with compile_bwd.PREP_AHEAD_WAVES = 0 (each head
   prepared by the CTAs of the head launched just before it: the tightest hand-off).
2. Speed: paired rounds on the large shape, fp16, causal and not: each round times one
   backward (compile_bwd.backward, CUDA events) of the YAML config with and without
   fused_preprocess, in alternating order, back to back or with idle gaps between rounds;
   per-round ratios, as in perf/pdl_overlap.py.
"""

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cute_flash import compile_bwd  # noqa: E402
from cute_flash.benchmarking import time_one_call_ms  # noqa: E402
from cute_flash.config import get_config  # noqa: E402
from cute_flash.launch import _TORCH_DTYPE_NAMES, forward  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def configs(dtype, head_dim, causal, seqlens):
    base = get_config(_TORCH_DTYPE_NAMES[dtype], head_dim, causal, "bwd", torch.device("cuda"), seqlens=seqlens)
    return dataclasses.replace(base, fused_preprocess=False), dataclasses.replace(base, fused_preprocess=True)


def rel_err(a, b):
    b = b.double()
    scale = b.abs().max().item()
    diff = (a.double() - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def run_backward(config, q, k, v, out, dout, lse, causal, scale):
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    return compile_bwd.backward(q, k, v, out, dout, lse, causal, scale, config=config, grads=grads)


def check():
    cases = [  # B, N, Sq, Sk, D, dtype, causal
        (2, 48, 1000, 1000, 128, torch.float16, False),
        (2, 48, 1000, 1000, 128, torch.float16, True),
        (2, 48, 1000, 1000, 128, torch.bfloat16, False),
        (1, 40, 777, 1500, 128, torch.float16, True),
        (1, 40, 1500, 777, 128, torch.bfloat16, False),
        (2, 48, 1000, 1000, 64, torch.float16, False),
        (2, 48, 1000, 1000, 64, torch.bfloat16, True),
        (4, 64, 17, 17, 128, torch.float16, False),
        (4, 64, 1, 300, 64, torch.float16, True),
        (1, 8, 4096, 4096, 128, torch.float16, False),
        (1, 300, 129, 257, 128, torch.float16, False),
    ]
    failures = 0
    for b, n, sq, sk, d, dtype, causal in cases:
        torch.manual_seed(sq * 7 + sk)
        q = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
        dout = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
        scale = 1 / math.sqrt(d)
        out, lse = forward(q, k, v, causal, scale)
        base, fused = configs(dtype, d, causal, (sq, sk))
        ref = run_backward(base, q, k, v, out, dout, lse, causal, scale)
        small = b * n * sq * sk <= 2 * 48 * 1000 * 1000
        if small:
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            o64, _ = attention_reference(*leaves, causal=causal, softmax_scale=scale)
            (o64 * dout.double()).sum().backward()
            exact = [t.grad for t in leaves]
        for waves in (compile_bwd.PREP_AHEAD_WAVES, 0):
            saved = compile_bwd.PREP_AHEAD_WAVES
            compile_bwd.PREP_AHEAD_WAVES = waves
            try:
                got = run_backward(fused, q, k, v, out, dout, lse, causal, scale)
                plan = compile_bwd.prepare_ahead_plan(fused, None, causal, b, n, sk, torch.cuda.get_device_properties(0).multi_processor_count, None, True)
            finally:
                compile_bwd.PREP_AHEAD_WAVES = saved
            torch.cuda.synchronize()
            vs_base = max(rel_err(g, r) for g, r in zip(got, ref))
            finite = all(torch.isfinite(g).all().item() for g in got)
            vs_exact = max(rel_err(g, e) for g, e in zip(got, exact)) if small else float("nan")
            ok = finite and vs_base <= TOLERANCE[dtype] / 4 and (not small or vs_exact <= TOLERANCE[dtype])
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {(b, n, sq, sk, d)} {str(dtype)[6:]} causal={causal} waves={waves} "
                  f"plan(prep_ahead, prep_ctas)={plan} vs non-fused {vs_base:.2e} vs float64 {vs_exact:.2e}", flush=True)
    return failures


def speed(shape, rounds, gaps):
    """Paired rounds: one backward with and one without fused_preprocess per round, the order
    alternating; after each round the GPU idles `gap` seconds (0: back to back, so the clock
    settles at the power limit; 1: each round starts from a cooler, faster GPU)."""
    b, n, s, d = shape
    rows = []
    for gap in gaps:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v, dout = (torch.randn(b, n, s, d, device="cuda", dtype=torch.float16) for _ in range(4))
            scale = 1 / math.sqrt(d)
            out, lse = forward(q, k, v, causal, scale)
            base, fused = configs(torch.float16, d, causal, (s, s))
            calls = {
                "bwd_base": lambda: run_backward(base, q, k, v, out, dout, lse, causal, scale),
                "bwd_fused": lambda: run_backward(fused, q, k, v, out, dout, lse, causal, scale),
            }
            for fn in calls.values():
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            samples = {name: [] for name in calls}
            for r in range(rounds):
                order = list(calls) if r % 2 == 0 else list(reversed(list(calls)))
                for name in order:
                    samples[name].append(time_one_call_ms(calls[name]))
                if gap:
                    time.sleep(gap)
            ratio = statistics.median(x / y for x, y in zip(samples["bwd_base"], samples["bwd_fused"]))
            for name, xs in samples.items():
                rows.append((gap, causal, name, statistics.median(xs), min(xs)))
            rows.append((gap, causal, "base/fused per round", ratio, float("nan")))
    print("\ngap s  causal  what                   median ms   min ms")
    for gap, causal, name, med, low in rows:
        print(f"{gap:5} {causal!s:7} {name:22} {med:9.3f} {low:9.3f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--shape", default="4,64,8192,128")
    parser.add_argument("--gaps", default="0,1", help="seconds of idle GPU after each round")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    failures = 0 if args.no_check else check()
    speed(tuple(int(x) for x in args.shape.split(",")), args.rounds, [float(g) for g in args.gaps.split(",")])
    print(f"\ncorrectness failures: {failures}")


if __name__ == "__main__":
    main()
