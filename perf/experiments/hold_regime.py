"""Does the idle time before a timed call change how fast the call runs? benchmarking.time_ms
holds the stream before each flushed sample for 2 x the step's own host time + 0.05 ms (a
one-thread spin: the GPU idles meanwhile), so a peer with a slow host path gets a longer idle
gap before its kernel than ours does. This times each step flushed, one call per sample, after
the same fixed holds for every step (and after its own automatic hold), in interleaved rounds,
and reads the SM clock just before the call (benchmarking.time_flushed_call). The first run
(perf/logs/2026-11-28-h200-hold-regime.log) also read it just after the call: the same within
1-2 %.

    python perf/experiments/hold_regime.py [--batch 4] [--rounds 7] [--holds auto,0.1,0.5,2,8]
        [--steps ours_causal,kv_plan,fa4_gqa] [--variants causal] [--gqa]

--gqa adds issue 21's GQA self-attention shape (4, 32 / 8, 8192, 128) bf16 causal: ours
(flash_attention) and flash-attn-4 (flash_attn_func, packed GQA by default).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prefill_gqa_ab  # noqa: E402
from cute_flash.benchmarking import host_ms, latency_hold_ms, time_flushed_call  # noqa: E402


def gqa_steps():
    import cute_flash
    from flash_attn.cute import flash_attn_func
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(4, 8192, 32, 128, **bf16)
    k, v = (torch.randn(4, 8192, 8, 128, **bf16) for _ in range(2))
    bnsd = lambda t: t.transpose(1, 2)  # noqa: E731
    return {
        "ours_gqa_self": lambda: cute_flash.flash_attention(bnsd(q), bnsd(k), bnsd(v), causal=True),
        "fa4_gqa_self": lambda: flash_attn_func(q, k, v, causal=True),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--holds", default="auto,0.1,0.5,2,8")
    parser.add_argument("--steps", default="ours_causal,kv_plan,fa4_gqa")
    parser.add_argument("--variants", default="causal")
    parser.add_argument("--gqa", action="store_true")
    args = parser.parse_args()
    prefill_gqa_ab.DIRECT_VARIANTS.extend(x for x in args.variants.split(",") if x)
    with torch.no_grad():
        impls = prefill_gqa_ab.steps(args.batch)
        names = [n for n in args.steps.split(",") if n]
        if args.gqa:
            impls.update(gqa_steps())
            names += ["ours_gqa_self", "fa4_gqa_self"]
        for name in names:
            for _ in range(3):
                impls[name]()
        auto = {name: latency_hold_ms(host_ms(impls[name])) for name in names}
        holds = args.holds.split(",")
        samples = {(n, h): [] for n in names for h in holds}
        for _ in range(args.rounds):
            for h in holds:
                for name in names:
                    hold = auto[name] if h == "auto" else float(h)
                    for _ in range(args.iters):
                        samples[(name, h)].append(time_flushed_call(impls[name], hold))
    print("auto hold ms: " + ", ".join(f"{n} {auto[n]:.3f}" for n in names))
    print(f"{'step':16s} {'hold':>5s} {'ms':>8s} {'MHz':>6s}")
    for h in holds:
        for name in names:
            rows = samples[(name, h)]
            ms, mhz = (statistics.median(r[i] for r in rows) for i in range(2))
            print(f"{name:16s} {h:>5s} {ms:8.4f} {mhz:6.0f}")


if __name__ == "__main__":
    main()
