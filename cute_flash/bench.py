"""`python -m cute_flash bench`: check, then time, cute_flash on the benchmark cases.

For each case of the case file (test_cases/test.txt by default) and each causal mode:
1. run cute_flash once on NaN-poisoned output and compare every element of O and the LSE
   with a float32 reference; a failed check is reported and the case is not timed;
2. time cute_flash (public API) and SDPA's cuDNN and flash backends (plus any peers the
   caller passes: perf/compare.py adds flash-attn-4) in this same process: CUDA events,
   warm-up, median;
3. print a table (ms, TFLOP/s, % of the measured fp16 matmul rate, speed-up over each peer)
   and write every measurement to a CSV.
"""

import csv
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cute_flash.kernels.problem import AttentionProblem

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
LSE_TOLERANCE = 1e-3


def hopper_problem() -> str | None:
    """None when a Hopper GPU is usable, else why not (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"found {torch.cuda.get_device_name()} with compute capability {major}.{minor}"
    return None


def sdpa_peers(causal):
    """name -> factory(q, k, v) returning a zero-argument timed callable: SDPA's cuDNN and
    flash backends. (Other libraries are passed in by perf/compare.py; the package itself
    imports none of them.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def make(q, k, v):
            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return call
        return make

    return {"sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def check_case(q, k, v, problem, scale):
    """(ok, relative error of O, max abs error of the LSE) of the kernel on poisoned outputs."""
    from cute_flash import launch_fwd
    from cute_flash.benchmarking import reference_fp32, relative_error, run_poisoned

    out, lse = run_poisoned(
        launch_fwd.kernel_for(q.dtype, q.shape[-1], problem, q.device, (q.shape[2], k.shape[2])), q, k, v, scale)
    torch.cuda.synchronize()
    ref, ref_lse = reference_fp32(q, k, v, problem.causal, scale)
    err = relative_error(out, ref)
    finite = torch.isfinite(ref_lse)
    lse_ok = bool(torch.isfinite(lse[finite]).all()) and bool((lse[~finite] == ref_lse[~finite]).all())
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if lse_ok and finite.any() else (
        0.0 if lse_ok else float("inf"))
    return err <= TOLERANCE[q.dtype] and lse_err <= LSE_TOLERANCE, err, lse_err


def run_bench(cases, causal_modes, dtype, out_dir: Path, warmup: int, iters: int, log=print,
              extra_peers=None) -> list:
    """`extra_peers(causal)`, if given, returns more name -> factory(q, k, v) entries to time."""
    import cute_flash
    from cute_flash.benchmarking import attention_flops, matmul_tflops, time_ms

    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name()
    date = time.strftime("%Y-%m-%d")
    log(f"cute_flash {cute_flash.__version__} bench on {device_name}, torch {torch.__version__}, {date}")
    mm_ms, mm_tflops = matmul_tflops()
    log(f"matmul 8192^3 fp16: {mm_ms:.3f} ms = {mm_tflops:.0f} TFLOP/s (the ceiling)")
    rows = []
    failures = 0
    for causal in causal_modes:
        peers = sdpa_peers(causal)
        if extra_peers is not None:
            peers.update(extra_peers(causal))
        for case in cases:
            b, n, s, d = case.shape
            q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(3))
            scale = 1.0 / math.sqrt(d)
            ok, err, lse_err = check_case(q, k, v, AttentionProblem.of(causal), scale)
            log(f"check {case} causal={causal}: rel_err={err:.2e} lse_err={lse_err:.2e} {'ok' if ok else 'FAIL'}")
            if not ok:
                failures += 1
                continue
            flops = attention_flops(b, n, s, s, d, causal)
            timings = {"cute_flash": time_ms(lambda: cute_flash.flash_attention(q, k, v, causal=causal),
                                             warmup, iters)}
            for name, make in peers.items():
                try:
                    timings[name] = time_ms(make(q, k, v), warmup, iters)
                except Exception as exc:  # a peer without support for this case is skipped
                    log(f"{name} on {case} causal={causal} not timed: {type(exc).__name__}: {exc}")
            for name, ms in timings.items():
                tflops = flops / ms / 1e9
                rows.append(dict(
                    date=date, gpu=device_name, dtype=str(dtype).replace("torch.", ""), case=str(case),
                    causal=causal, impl=name, ms=round(ms, 4), tflops=round(tflops, 1),
                    pct_matmul=round(100 * tflops / mm_tflops, 1),
                    cute_flash_speedup=round(ms / timings["cute_flash"], 3),
                    matmul_tflops=round(mm_tflops, 1),
                ))
            del q, k, v
    csv_path = out_dir / "bench.csv"
    if rows:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        log(f"wrote {csv_path}")
        (out_dir / "bench.md").write_text(markdown_table(rows))
    log("")
    log(format_table(rows))
    if failures:
        log(f"{failures} case(s) FAILED the correctness check and were not timed")
    return rows if not failures else None


def format_table(rows) -> str:
    """One line per (case, causal): cute_flash ms and TFLOP/s, each peer's ms and cute_flash's
    speed-up over it (peer ms / cute_flash ms)."""
    if not rows:
        return "(no measurements)"
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "cute_flash"]
    header = f"{'case':18s} {'causal':6s} {'cute_flash ms':>13s} {'TFLOP/s':>8s} {'%mm':>5s}"
    for impl in impls:
        header += f" {impl + ' ms':>17s} {'speed-up':>8s}"
    lines = [header]
    groups = {}
    for r in rows:
        groups.setdefault((r["case"], r["causal"]), {})[r["impl"]] = r
    for (case, causal), by_impl in groups.items():
        ours = by_impl["cute_flash"]
        line = f"{case:18s} {str(causal):6s} {ours['ms']:13.3f} {ours['tflops']:8.0f} {ours['pct_matmul']:5.0f}"
        for impl in impls:
            r = by_impl.get(impl)
            line += f" {r['ms']:17.3f} {r['cute_flash_speedup']:7.2f}x" if r else f" {'-':>17s} {'-':>8s}"
        lines.append(line)
    return "\n".join(lines)


def markdown_table(rows) -> str:
    """The README's results table: one row per (case, causal), ms and TFLOP/s of every
    implementation and cute_flash's speed-up over the fastest other one."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    peers = [i for i in impls if i != "cute_flash"]
    first = rows[0]
    lines = [
        f"{first['gpu']}, {first['dtype']}, measured {first['date']}; fp16 matmul 8192³: "
        f"{first['matmul_tflops']:.0f} TFLOP/s. Cells: ms (TFLOP/s).",
        "",
        "| case (B×N×S×D) | causal | " + " | ".join(impls) + " | speed-up vs fastest other |",
        "|---|---|" + "---:|" * (len(impls) + 1),
    ]
    groups = {}
    for r in rows:
        groups.setdefault((r["case"], r["causal"]), {})[r["impl"]] = r
    for (case, causal), by_impl in groups.items():
        cells = [f"{by_impl[i]['ms']:.3f} ({by_impl[i]['tflops']:.0f})" if i in by_impl else "–" for i in impls]
        others = [by_impl[i]["ms"] for i in peers if i in by_impl]
        speedup = f"{min(others) / by_impl['cute_flash']['ms']:.2f}×" if others else "–"
        lines.append(f"| {case} | {causal} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines) + "\n"
