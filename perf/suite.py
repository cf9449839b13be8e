"""The benchmark sweep: cute_flash against every attention implementation in this process.

    python perf/suite.py --out DIR [--seqlens 512,...|none] [--head-dims 64,128] [--dtypes float16,bfloat16]
                         [--causal 0,1] [--directions fwd,fwd_bwd] [--iters 10] [--budget-s 540]
                         [--seed-cases test_cases/test.txt|none] [--seed-directions fwd,fwd_bwd]
                         [--seed-dtypes float16]

Points: S in {512 ... 32768} at a constant 32768 tokens (B = 32768 / S), N = 2048 / D heads
(a 2048-wide model), D in {64, 128}, causal and not, fp16 and bf16, forward and
forward+backward. Each point times cute_flash, SDPA's flash, cuDNN and efficient backends,
the math backend where its S x S matrix fits, and flash-attn-4 when importable, with CUDA
events (median of >= 10 samples after warm-up, L2 overwritten before each sample). The fp16
matmul ceiling is measured in the same run. Writes DIR/suite.csv, DIR/suite.md, and PNG plots
when matplotlib is importable (else `python perf/plot_suite.py DIR` makes them later).
A line per point is printed as it is measured; `--budget-s` stops cleanly before a limit.
"""

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cute_flash
from cute_flash.benchmarking import attention_flops, matmul_tflops, time_ms
from cute_flash.test_cases import load_cases

TOKENS = 32768
MODEL_DIM = 2048
MATH_MAX_BYTES = 8 * 2**30  # the math backend materialises B*N*S*S scores (and their grad)


def math_scores_fit(shape, direction: str) -> bool:
    """Whether SDPA's math backend may run (B, N, S, D) `direction` within MATH_MAX_BYTES: its
    float32 S x S scores and probabilities, and with a backward ("bwd", "fwd_bwd") their
    gradient too."""
    b, n, s, _ = shape
    return b * n * s * s * 4 * (3 if direction != "fwd" else 2) <= MATH_MAX_BYTES


def implementations(causal, dtype):
    """name -> f(q, k, v) for (B, N, S, D) inputs; None where unavailable."""
    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    impls = {
        "cute_flash": lambda q, k, v: cute_flash.flash_attention(q, k, v, causal=causal),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_math": sdpa(SDPBackend.MATH),
    }
    try:
        from flash_attn.cute import flash_attn_func  # comparison only

        def fa4(q, k, v):  # its native layout is (B, S, N, D): a transposed view costs a copy
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        impls["flash_attn_4"] = ("bsnd", fa4)
    except Exception as exc:
        print(f"flash-attn-4 not importable ({type(exc).__name__}); not timed", file=sys.stderr)
    return impls


def measure_point(name, impl, shape, dtype, causal, direction, iters):
    b, n, s, d = shape
    layout = "bnsd"
    if isinstance(impl, tuple):
        layout, impl = impl
    if name == "sdpa_math" and not math_scores_fit(shape, direction):
        return None, "S x S scores do not fit"
    make = (lambda: torch.randn(b, s, n, d, device="cuda", dtype=dtype)) if layout == "bsnd" else (
        lambda: torch.randn(b, n, s, d, device="cuda", dtype=dtype))
    grad = direction == "fwd_bwd"
    q, k, v = (make().requires_grad_(grad) for _ in range(3))
    if grad:
        dout = torch.randn_like(q)

        def call():
            q.grad = k.grad = v.grad = None
            impl(q, k, v).backward(dout)
    else:
        def call():
            with torch.no_grad():
                impl(q, k, v)
    try:
        return time_ms(call, warmup=3, iters=iters, flush=True), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    finally:
        del q, k, v
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384,32768")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--directions", default="fwd,fwd_bwd")
    parser.add_argument("--impls", default=None, help="comma list (default: all available)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new points after this")
    parser.add_argument("--seed-cases", default="test_cases/test.txt",
                        help="case file whose shapes are also measured (fp16) for the README headline; 'none' skips")
    parser.add_argument("--seed-directions", default="fwd,fwd_bwd", help="directions of the seed cases")
    parser.add_argument("--seed-dtypes", default="float16", help="dtypes of the seed cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("perf/suite.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    gpu = torch.cuda.get_device_name()
    date = time.strftime("%Y-%m-%d")
    mm_ms, mm_tflops = matmul_tflops()
    print(f"{gpu}, torch {torch.__version__}, {date}; fp16 matmul 8192^3 {mm_tflops:.0f} TFLOP/s")
    # (point, direction, dtype, causal, (B, N, S, D)): the seed cases first (the headline),
    # then the sweep at constant tokens.
    seeds = [] if args.seed_cases == "none" else load_cases(args.seed_cases)
    points = [
        ("seed", direction, dtype, causal, (shape.batch, shape.heads, shape.seqlen, shape.head_dim))
        for direction in args.seed_directions.split(",")
        for dtype in args.seed_dtypes.split(",")
        for causal in (bool(int(c)) for c in args.causal.split(","))
        for shape in seeds
    ] + [
        ("sweep", direction, dtype, causal, (TOKENS // s, MODEL_DIM // d, s, d))
        for direction in args.directions.split(",")
        for dtype in args.dtypes.split(",")
        for d in map(int, args.head_dims.split(","))
        for causal in (bool(int(c)) for c in args.causal.split(","))
        for s in ([] if args.seqlens == "none" else map(int, args.seqlens.split(",")))
    ]
    rows = []
    csv_path = out / "suite.csv"
    fields = ["date", "gpu", "point", "direction", "dtype", "head_dim", "causal", "batch", "heads", "seqlen", "impl",
              "ms", "tflops", "pct_matmul", "note"]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for index, (point, direction, dtype_name, causal, shape) in enumerate(points, 1):
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s reached: {len(points) - index + 1} points not measured")
                break
            dtype = getattr(torch, dtype_name)
            s, d = shape[2], shape[3]
            flops = attention_flops(*shape[:3], s, d, causal) * (3.5 if direction == "fwd_bwd" else 1.0)
            impls = implementations(causal, dtype)
            if args.impls:
                impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
            line = []
            for name, impl in impls.items():
                ms, note = measure_point(name, impl, shape, dtype, causal, direction, args.iters)
                tflops = flops / ms / 1e9 if ms else None
                row = dict(date=date, gpu=gpu, point=point, direction=direction, dtype=dtype_name, head_dim=d, causal=causal,
                           batch=shape[0], heads=shape[1], seqlen=s, impl=name,
                           ms=round(ms, 4) if ms else "", tflops=round(tflops, 1) if tflops else "",
                           pct_matmul=round(100 * tflops / mm_tflops, 1) if tflops else "", note=note)
                writer.writerow(row)
                f.flush()
                rows.append(row)
                line.append(f"{name} {tflops:.0f}" if tflops else f"{name} -")
            print(f"[{index}/{len(points)}] {point} {direction} {dtype_name} {'x'.join(map(str, shape))} causal={int(causal)}: "
                  + ", ".join(line) + " TFLOP/s", flush=True)
    (out / "suite.md").write_text(markdown([r for r in rows if r["point"] == "sweep"], mm_tflops))
    (out / "headline.md").write_text(headline([r for r in rows if r["point"] == "seed"], mm_tflops))
    print(f"wrote {csv_path}, {out / 'suite.md'} and {out / 'headline.md'}")
    try:
        from plot_suite import plot
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plot_suite import plot
    try:
        print(f"plots: {plot(csv_path, out)}")
    except ImportError:
        print("matplotlib not importable: run `python perf/plot_suite.py DIR` where it is")
    summary(rows)
    return 0


def markdown(rows, mm_tflops) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lines = [f"TFLOP/s; fp16 matmul ceiling {mm_tflops:.0f} TFLOP/s.", "",
             "| direction | dtype | D | causal | S | " + " | ".join(impls) + " |",
             "|---|---|---|---|---|" + "---:|" * len(impls)]
    groups = {}
    for r in rows:
        groups.setdefault((r["direction"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"]), {})[r["impl"]] = r
    for key, by_impl in groups.items():
        cells = [str(by_impl[i]["tflops"]) if i in by_impl and by_impl[i]["tflops"] != "" else "–" for i in impls]
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def headline(rows, mm_tflops) -> str:
    """The README's headline: the seed cases, one table per direction, ms (TFLOP/s) of every
    implementation and cute_flash's speed-up over the fastest other one."""
    if not rows:
        return ""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    peers = [i for i in impls if i != "cute_flash"]
    first = rows[0]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    by_dtype = len(dtypes) > 1  # a dtype column, else the dtype in the title
    lines = [f"{first['gpu']}, {', '.join(dtypes)}, measured {first['date']} by `perf/suite.py`; "
             f"fp16 matmul 8192³ in the same run: {mm_tflops:.0f} TFLOP/s. Cells: ms (TFLOP/s)."]
    for direction in dict.fromkeys(r["direction"] for r in rows):
        lines += ["", f"**{'forward' if direction == 'fwd' else 'forward + backward'}**", "",
                  "| case (B×N×S×D) | " + ("dtype | " if by_dtype else "") + "causal | " + " | ".join(impls)
                  + " | speed-up vs fastest other |",
                  "|---|---|" + ("---|" if by_dtype else "") + "---:|" * (len(impls) + 1)]
        groups = {}
        for r in rows:
            if r["direction"] == direction:
                case = "x".join(str(r[f]) for f in ("batch", "heads", "seqlen", "head_dim"))
                label = f"{case} | {r['dtype']}" if by_dtype else case
                groups.setdefault((label, r["causal"]), {})[r["impl"]] = r
        for (case, causal), by_impl in groups.items():
            timed = {i: r for i, r in by_impl.items() if r["ms"] != ""}
            cells = [f"{timed[i]['ms']:.3f} ({timed[i]['tflops']:.0f})" if i in timed else "–" for i in impls]
            others = [timed[i]["ms"] for i in peers if i in timed]
            speedup = f"{min(others) / timed['cute_flash']['ms']:.2f}×" if others and "cute_flash" in timed else "–"
            lines.append(f"| {case} | {causal} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines) + "\n"


def summary(rows):
    """cute_flash's geometric-mean speed-up over each other implementation, per direction."""
    by_point = {}
    for r in rows:
        if r["ms"] != "" and r["point"] == "sweep":
            by_point.setdefault((r["direction"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"]), {})[r["impl"]] = r["ms"]
    for direction in dict.fromkeys(k[0] for k in by_point):
        ratios = {}
        for key, times in by_point.items():
            if key[0] == direction and "cute_flash" in times:
                for impl, ms in times.items():
                    if impl != "cute_flash":
                        ratios.setdefault(impl, []).append(ms / times["cute_flash"])
        parts = [f"{impl} {math.exp(sum(map(math.log, r)) / len(r)):.2f}x ({len(r)} pts)" for impl, r in ratios.items()]
        print(f"summary {direction}: cute_flash speed-up (geomean) over " + ", ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
