"""The seeds' benchmark grid: cute_flash beside every attention implementation that takes the
dtype, in one run (GPU script).

    python perf/seed_grid.py --out DIR [--seqlens 128,...,65536] [--head-dims 16,32,64,128]
                             [--dtypes bfloat16,float32] [--heads 16] [--budget-s 540]
                             [--float32-precision high] [--rounds 3]

Points: batch 1, `--heads` heads, causal, S = 128 ... 65536 (powers of two), D in {16, 32,
64, 128}, bf16 and float32; directions fwd (forward alone, no graph), bwd (the backward alone:
torch.autograd.grad on a retained graph) and fwd_bwd (end to end). Peers per dtype: SDPA's
flash and cuDNN backends and flash-attn-4 for bf16; SDPA's efficient and math backends for
float32 (the math backend only where its S x S scores fit). A peer that refuses a point is
recorded with the reason; cute_flash is expected to run every point (a refusal is printed
as a FAILED point). CUDA events, L2 flushed before each sample (benchmarking.time_ms); at each
point the implementations are timed in `--rounds` interleaved rounds after one common hold,
the order rotated per round (peers.interleaved_medians, as perf/variants.py, varlen.py and
kvcache.py time), and each one's ms is the median of its rounds: below S = 4096 every call
is host-bound (0.1-0.4 ms of Python and launches), and implementations timed one after
another, seconds apart, read the host's drift as their difference (perf/NOTES.md,
sixty-sixth session).
Writes DIR/grid.csv, DIR/grid.md (cute_flash over the fastest peer per point, then every
implementation's ms) and DIR/grid.png (when matplotlib is importable).
`python perf/seed_grid.py --redraw DIR` rewrites grid.md and grid.png from DIR/grid.csv (no GPU).
"""

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bar_plot import save_png  # noqa: E402  (perf/ is on the path)
from suite import implementations, math_scores_fit  # noqa: E402

from peers import interleaved_medians, runnable_steps  # noqa: E402

from cute_flash.benchmarking import attention_flops  # noqa: E402

PEERS = {"bfloat16": ("sdpa_flash", "sdpa_cudnn", "flash_attn_4"), "float32": ("sdpa_efficient", "sdpa_math")}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # backward = 5 GEMMs of the forward's 2


def timed_call(impl, layout, shape, dtype, direction):
    """A zero-argument callable running one `direction` of impl on fresh random inputs."""
    b, n, s, d = shape
    dims = (b, s, n, d) if layout == "bsnd" else (b, n, s, d)
    q, k, v = (torch.randn(*dims, device="cuda", dtype=dtype, requires_grad=direction != "fwd") for _ in range(3))
    if direction == "fwd":
        def call():
            with torch.no_grad():
                impl(q, k, v)
        return call
    dout = torch.randn(dims, device="cuda", dtype=dtype)
    if direction == "fwd_bwd":
        def call():
            torch.autograd.grad(impl(q, k, v), (q, k, v), dout)
        return call
    out = impl(q, k, v)

    def call():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return call


def _refusal(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def samples_per_point(seqlen: int) -> int:
    """Samples per implementation at a point (each one >= 1 ms of back-to-back calls,
    benchmarking.time_ms). Below S = 4096 a call is 0.1-0.5 ms of host time and the host's
    jitter moved 12-sample medians by up to 2x between neighbouring points for every
    implementation alike (perf/NOTES.md, sixty-seventh session), so those points take 40
    (~0.1 s per implementation); above, the GPU bounds the call and 10 (5 from S = 16384, whose
    calls take tens of ms) agree within a few %."""
    if seqlen < 4096:
        return 40
    return 10 if seqlen < 16384 else 5


def measure_point(impls: dict, shape, dtype, direction, rounds: int) -> dict:
    """{name: (ms or None, note)} for every implementation of `impls` (name -> impl, in order)
    at one point: each one's call built, then peers.runnable_steps and interleaved_medians
    (one hold for all, `rounds` rotated rounds, each ms the median of its rounds); a refusal
    (building the call, its trial call or a round: a peer's or, a failure, cute_flash's) is
    its note. samples_per_point(S) samples each, spread over the rounds."""
    s = shape[2]
    results, calls, refusals = {}, {}, {}
    for name, impl in impls.items():
        layout = "bnsd"
        if isinstance(impl, tuple):
            layout, impl = impl
        if name == "sdpa_math" and not math_scores_fit(shape, direction):
            results[name] = (None, "S x S scores do not fit")
            continue
        try:
            calls[name] = timed_call(impl, layout, shape, dtype, direction)
        except Exception as exc:
            refusals[name] = exc
    iters = max(2, -(-samples_per_point(s) // rounds))
    runnable = runnable_steps(calls, f"{direction} D={shape[3]} S={s}", refusals)
    if runnable:
        medians = interleaved_medians(runnable, rounds, iters, refusals)
        results.update((name, (ms, "")) for name, ms in medians.items())
    results.update((name, (None, _refusal(exc))) for name, exc in refusals.items())
    calls.clear()
    runnable.clear()
    torch.cuda.empty_cache()
    return {name: results[name] for name in impls}


def read_rows(path) -> list:
    """grid.csv's rows with the types main() writes them with (ms and tflops "" where not run)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["head_dim"], r["seqlen"] = int(r["head_dim"]), int(r["seqlen"])
        r["ms"], r["tflops"] = (float(r[key]) if r[key] else "" for key in ("ms", "tflops"))
    return rows


def groups(rows):
    """(dtype, direction, that pair's rows) in the rows' order, for each pair that has rows:
    one markdown table each."""
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for direction in dict.fromkeys(r["direction"] for r in rows):
            sel = [r for r in rows if r["dtype"] == dtype and r["direction"] == direction]
            if sel:
                yield dtype, direction, sel


def speedups(rows) -> list:
    """Markdown lines: per (dtype, direction) a table of the fastest peer's ms over cute_flash's
    (above 1: cute_flash faster) and that peer's name, S down, D across."""
    lines = []
    for dtype, direction, sel in groups(rows):
        dims = list(dict.fromkeys(r["head_dim"] for r in sel))
        lines += [f"### {dtype} {direction}: fastest peer's ms / cute_flash's (peer)", "",
                  "| S | " + " | ".join(f"D = {d}" for d in dims) + " |", "|---|" + "---|" * len(dims)]
        for s in dict.fromkeys(r["seqlen"] for r in sel):
            cells = []
            for d in dims:
                ms = {r["impl"]: r["ms"] for r in sel if (r["seqlen"], r["head_dim"]) == (s, d) and r["ms"]}
                peers = {name: t for name, t in ms.items() if name != "cute_flash"}
                if "cute_flash" not in ms or not peers:
                    cells.append("-")
                    continue
                best = min(peers, key=peers.get)
                cells.append(f"{peers[best] / ms['cute_flash']:.2f} ({best})")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def markdown(rows) -> str:
    """The speed-ups, then one table per (dtype, direction): ms per implementation, S down, D
    across."""
    lines = speedups(rows)
    for dtype, direction, sel in groups(rows):
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        lines += [f"### {dtype} {direction} (ms; '-' = not run, see grid.csv)", "",
                  "| S | D | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
        for s, d in dict.fromkeys((r["seqlen"], r["head_dim"]) for r in sel):
            cells = {r["impl"]: r["ms"] for r in sel if r["seqlen"] == s and r["head_dim"] == d}
            lines.append(f"| {s} | {d} | " + " | ".join(str(cells.get(i) or "-") for i in impls) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    directions = list(dict.fromkeys(r["direction"] for r in rows))
    fig, axes = plt.subplots(len(dtypes), len(directions), figsize=(5 * len(directions), 4 * len(dtypes)),
                             squeeze=False)
    # One colour per implementation and one marker per head dim: 16 lines share a panel, more
    # than matplotlib's colour cycle tells apart.
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colours = {impl: plt.get_cmap("tab10")(k % 10) for k, impl in enumerate(impls)}
    markers = {d: "osD^v<>p*h"[k % 10] for k, d in enumerate(dict.fromkeys(r["head_dim"] for r in rows))}
    for i, dtype in enumerate(dtypes):
        for j, direction in enumerate(directions):
            ax = axes[i][j]
            for impl in dict.fromkeys(r["impl"] for r in rows if r["dtype"] == dtype):
                for d in markers:
                    pts = [(r["seqlen"], r["tflops"]) for r in rows if r["dtype"] == dtype and
                           r["direction"] == direction and r["impl"] == impl and r["head_dim"] == d and r["tflops"]]
                    if pts:
                        ax.plot(*zip(*pts), marker=markers[d], markersize=4, color=colours[impl],
                                label=f"{impl} D={d}", linestyle="-" if impl == "cute_flash" else "--",
                                linewidth=1.8 if impl == "cute_flash" else 1.0)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{dtype} {direction}, causal, batch 1")
            ax.set_xlabel("S")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    save_png(fig, path)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--seqlens", default=",".join(str(2 ** p) for p in range(7, 17)))
    parser.add_argument("--head-dims", default="16,32,64,128")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--directions", default="fwd,bwd,fwd_bwd")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new points after this")
    parser.add_argument("--float32-precision", default=None, choices=("highest", "high", "medium"),
                        help="torch.set_float32_matmul_precision for the run (cute_flash's float32 forward runs on "
                             "TF32 under 'high' / 'medium'); recorded in the CSV's note column")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point (measure_point)")
    parser.add_argument("--redraw", metavar="DIR", help="rewrite DIR/grid.md and grid.png from DIR/grid.csv, then stop")
    args = parser.parse_args()
    if args.redraw:
        rows = read_rows(Path(args.redraw) / "grid.csv")
        (Path(args.redraw) / "grid.md").write_text(markdown(rows))
        print("wrote grid.md" + (", grid.png" if plot(rows, Path(args.redraw) / "grid.png") else ""))
        return 0
    if args.float32_precision:
        torch.set_float32_matmul_precision(args.float32_precision)
    if not torch.cuda.is_available():
        sys.exit("perf/seed_grid.py needs a CUDA GPU")
    if not args.out:
        parser.error("--out is required (or --redraw DIR)")
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    started, date, gpu = time.monotonic(), time.strftime("%Y-%m-%d"), torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, {date}")
    points = [(dtype, direction, d, s) for dtype in args.dtypes.split(",") for direction in args.directions.split(",")
              for d in map(int, args.head_dims.split(",")) for s in map(int, args.seqlens.split(","))]
    fields = ["date", "gpu", "dtype", "direction", "head_dim", "seqlen", "batch", "heads", "causal", "impl", "ms",
              "tflops", "note"]
    rows, failures = [], 0
    with open(out / "grid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for index, (dtype_name, direction, d, s) in enumerate(points, 1):
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                print(f"budget reached: {len(points) - index + 1} points not measured")
                break
            shape = (1, args.heads, s, d)
            dtype = getattr(torch, dtype_name)
            available = implementations(True, dtype)
            impls = {name: available[name] for name in ("cute_flash",) + PEERS[dtype_name] if name in available}
            flops = attention_flops(1, args.heads, s, s, d, True) * FLOP_FACTOR[direction]
            line = []
            for name, (ms, note) in measure_point(impls, shape, dtype, direction, args.rounds).items():
                if name == "cute_flash" and ms is None:
                    failures += 1
                row = dict(date=date, gpu=gpu, dtype=dtype_name, direction=direction, head_dim=d, seqlen=s, batch=1,
                           heads=args.heads, causal=True, impl=name, ms=round(ms, 4) if ms else "",
                           tflops=round(flops / ms / 1e9, 1) if ms else "",
                           note=note or (f"float32 matmul precision {torch.get_float32_matmul_precision()}"
                                         if dtype_name == "float32" else ""))
                writer.writerow(row)
                f.flush()
                rows.append(row)
                line.append(f"{name} {ms:.3f}" if ms else f"{name} - ({note[:40]})")
            print(f"[{index}/{len(points)}] {dtype_name} {direction} D={d} S={s}: " + ", ".join(line) + " ms",
                  flush=True)
    (out / "grid.md").write_text(markdown(rows))
    print(f"wrote {out / 'grid.csv'}, {out / 'grid.md'}" + (", grid.png" if plot(rows, out / "grid.png") else ""))
    if failures:
        print(f"{failures} point(s) FAILED for cute_flash")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
