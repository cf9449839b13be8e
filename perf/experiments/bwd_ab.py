"""A/B of one backward config field on the H100 (GPU script): the YAML config with
field = a vs field = b.

    python perf/experiments/bwd_ab.py --field fused_preprocess --a false --b true [--rounds 20]
    python perf/experiments/bwd_ab.py --field dq_stages --a 1 --b 2 --causal 0 [--shape 4,64,8192,128]
    python perf/experiments/bwd_ab.py --field fields --a '{}' --b '{"block_m": 80, "dq_swap_ab": true}'
(--field fields: --a / --b are YAML/JSON maps of fields to replace.)

1. Correctness: for a set of cases (many heads, odd and even key-block counts, Sq != Sk,
   both dtypes and head dims) dq, dk, dv of the b config are compared with the float64
   reference and with the a config. For fused_preprocess also with launch_bwd's
   prep_ahead_waves = 0 (each head prepared by the CTAs of the head launched just before it:
   the tightest hand-off).
2. Speed: paired rounds on one shape (--speed-dtype, fp16 by default): each round times one backward
   (launch_bwd.backward_with_config, CUDA events) of each config, in alternating order, back to back
   or with idle gaps between rounds; per-round ratios, as in perf/experiments/pdl_overlap.py.
"""

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cute_flash import launch_bwd  # noqa: E402
from cute_flash.benchmarking import time_one_call_ms  # noqa: E402
from cute_flash.config import get_config  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.launch_fwd import forward  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import TORCH_DTYPE_NAMES  # noqa: E402

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


FIELD = "fused_preprocess"
VALUES = (False, True)


def configs(dtype, head_dim, causal, seqlens):
    base = get_config(TORCH_DTYPE_NAMES[dtype], head_dim, causal, "bwd", torch.device("cuda"), seqlens=seqlens)
    return tuple(dataclasses.replace(base, **(value if FIELD == "fields" else {FIELD: value})) for value in VALUES)


def rel_err(a, b):
    b = b.double()
    scale = b.abs().max().item()
    diff = (a.double() - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def run_backward(config, q, k, v, out, dout, lse, causal, scale, waves=launch_bwd.PREP_AHEAD_WAVES):
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    return launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                           config=config, grads=grads, prep_ahead_waves=waves)


def check(causal_modes, dtypes, head_dims):
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
        (2, 24, 2048, 1024, 128, torch.float16, False),
        (2, 24, 1024, 2048, 128, torch.bfloat16, False),
        (1, 16, 333, 4000, 64, torch.float16, False),
    ]
    failures = 0
    for b, n, sq, sk, d, dtype, causal in cases:
        if causal not in causal_modes or dtype not in dtypes or d not in head_dims:
            continue
        torch.manual_seed(sq * 7 + sk)
        q = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
        dout = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
        scale = 1 / math.sqrt(d)
        out, lse = forward(q, k, v, AttentionProblem.of(causal), scale)
        config_a, config_b = configs(dtype, d, causal, (sq, sk))
        ref = run_backward(config_a, q, k, v, out, dout, lse, causal, scale)
        small = b * n * sq * sk <= 2 * 48 * 1000 * 1000
        if small:
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            o64, _ = attention_reference(*leaves, causal=causal, softmax_scale=scale)
            (o64 * dout.double()).sum().backward()
            exact = [t.grad for t in leaves]
        for waves in (launch_bwd.PREP_AHEAD_WAVES, 0) if FIELD == "fused_preprocess" else (launch_bwd.PREP_AHEAD_WAVES,):
            got = run_backward(config_b, q, k, v, out, dout, lse, causal, scale, waves)
            problem = AttentionProblem.of(causal)
            plan = launch_bwd.prepare_ahead_plan(config_b, None, problem, b, n, sk, torch.cuda.get_device_properties(0).multi_processor_count, None, True, waves)
            torch.cuda.synchronize()
            vs_a = max(rel_err(g, r) for g, r in zip(got, ref))
            finite = all(torch.isfinite(g).all().item() for g in got)
            vs_exact = max(rel_err(g, e) for g, e in zip(got, exact)) if small else float("nan")
            ok = finite and vs_a <= TOLERANCE[dtype] / 4 and (not small or vs_exact <= TOLERANCE[dtype])
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {(b, n, sq, sk, d)} {str(dtype)[6:]} causal={causal} waves={waves} "
                  f"plan(prep_ahead, prep_ctas)={plan} vs {FIELD}={VALUES[0]} {vs_a:.2e} "
                  f"vs float64 {vs_exact:.2e}", flush=True)
    return failures


def speed(shape, rounds, gaps, causal_modes, dtype=torch.float16):
    """Paired rounds: one backward of each config per round, the order
    alternating; after each round the GPU idles `gap` seconds (0: back to back, so the clock
    settles at the power limit; 1: each round starts from a cooler, faster GPU)."""
    b, n, s, d = shape
    rows = []
    for gap in gaps:
        for causal in causal_modes:
            torch.manual_seed(0)
            q, k, v, dout = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(4))
            scale = 1 / math.sqrt(d)
            out, lse = forward(q, k, v, AttentionProblem.of(causal), scale)
            config_a, config_b = configs(dtype, d, causal, (s, s))
            calls = {
                "bwd_a": lambda: run_backward(config_a, q, k, v, out, dout, lse, causal, scale),
                "bwd_b": lambda: run_backward(config_b, q, k, v, out, dout, lse, causal, scale),
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
            ratio = statistics.median(x / y for x, y in zip(samples["bwd_a"], samples["bwd_b"]))
            for name, xs in samples.items():
                rows.append((gap, causal, name, statistics.median(xs), min(xs)))
            rows.append((gap, causal, "a/b per round", ratio, float("nan")))
    print(f"\n{FIELD}: a = {VALUES[0]}, b = {VALUES[1]}, shape {shape} {str(dtype)[6:]}")
    print("gap s  causal  what                   median ms   min ms")
    for gap, causal, name, med, low in rows:
        print(f"{gap:5} {causal!s:7} {name:22} {med:9.3f} {low:9.3f}")


def main():
    global FIELD, VALUES
    parser = argparse.ArgumentParser()
    parser.add_argument("--field", default=FIELD)
    parser.add_argument("--a", default="false", help="the field's value in config a (YAML scalar)")
    parser.add_argument("--b", default="true")
    parser.add_argument("--causal", default="0,1", help="causal modes checked and timed")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="dtypes checked")
    parser.add_argument("--head-dims", default="64,128", help="head dims checked")
    parser.add_argument("--speed-dtype", default="float16", help="dtype timed")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--shape", default="4,64,8192,128")
    parser.add_argument("--gaps", default="0,1", help="seconds of idle GPU after each round")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    FIELD, VALUES = args.field, (yaml.safe_load(args.a), yaml.safe_load(args.b))
    causal_modes = [bool(int(c)) for c in args.causal.split(",")]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    head_dims = [int(d) for d in args.head_dims.split(",")]
    failures = 0 if args.no_check else check(causal_modes, dtypes, head_dims)
    speed(tuple(int(x) for x in args.shape.split(",")), args.rounds, [float(g) for g in args.gaps.split(",")],
          causal_modes, getattr(torch, args.speed_dtype))
    print(f"\ncorrectness failures: {failures}")


if __name__ == "__main__":
    main()
