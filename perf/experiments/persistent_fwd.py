"""The forward on a persistent grid (TileConfig.persistent: one CTA per SM taking tiles from a
queue, O in a buffer of its own) against the shipped one-CTA-per-tile grid and flash-attn-4,
in one device call.

Each case compiles the shipped entry (its block_n, or the case's), the same with persistent on
and, where the case changes block_n, the shipped entry as it is. Every persistent kernel is
checked first: outputs poisoned, every element against a float64 reference on odd shapes
(Sq != Sk both ways, tails), and bit for bit against the one-CTA-per-tile kernel of the same
tiles on the timed shape (a tile taken twice or never shows there). Then all sides are timed
as rotated_rounds times them (per round each side once, order rotated, L2 flushed after the
same hold); ratios are per round, over the shipped side.

    python perf/experiments/persistent_fwd.py [--shape 4,32,8192] [--rounds 7]
        [--cases bfloat16:128:128:1,float16:192:128:1:96,...] [--no-check]

A case is dtype:D:Dv:causal[:block_n]. The tile counter rides in the page-table argument
(the kernel's experiment-only seam); it is zeroed before every call, inside the timed region.
"""

import argparse
import dataclasses
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.benchmarking import round_medians, round_ratios, round_table, rotated_rounds  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import load_config_file, without_clusters  # noqa: E402
from cute_flash.kernels import fwd_sm90  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import no_sink, not_packed  # noqa: E402

CHECK_SHAPES = [(3, 4, 1000, 1000), (2, 3, 17, 1000), (2, 3, 1000, 17), (1, 2, 4100, 4100), (1, 1, 1, 300)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def call(kernel, counter, q, k, v, out, lse, scale):
    """One launch; counter: the persistent grid's tile counter (zeroed here), or None."""
    packed = not_packed(q.device)
    table = packed[3]
    if counter is not None:
        counter.zero_()
        table = counter
    kernel(q, k, v, out, lse, no_sink(q.device), *packed[:3], table, scale)


def poisoned_run(kernel, counter, q, k, v, scale):
    out = torch.full((*q.shape[:3], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    call(kernel, counter, q, k, v, out, lse, scale)
    return out, lse


def check(kernel, counter, dtype, d, dv, causal):
    lines, good = [], True
    for b, n, sq, sk in CHECK_SHAPES:
        q = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, n, sk, dv, device="cuda", dtype=dtype)
        out, lse = poisoned_run(kernel, counter, q, k, v, 1 / math.sqrt(d))
        ref, ref_lse = attention_reference(q, k, v, causal=causal)
        low, _ = attention_reference(q, k, v, causal=causal, dtype=dtype)
        seen = torch.isfinite(ref_lse)
        err = (out.double() - ref)[seen].abs().max().item() if seen.any() else 0.0
        low_err = (low.double() - ref)[seen].abs().max().item() if seen.any() else 0.0
        lse_err = (lse.double() - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
        empty = bool((out[~seen] == 0).all()) and bool((lse[~seen] == -math.inf).all())
        ok = err <= 2 * low_err + 1e-5 and lse_err < 1e-3 and empty and not out.isnan().any()
        good &= ok
        lines.append(f"  {(b, n, sq, sk)}: max {err:.2e} ({dtype} math {low_err:.2e}) lse {lse_err:.2e} "
                     f"{'ok' if ok else 'FAIL'}")
    return good, lines


def sustained(fn, seconds: float) -> str:
    """fn back to back for `seconds` (after as long again to settle the clock): ms per call, and
    the SM clock and board power nvidia-smi samples meanwhile (the clock a side runs at under
    its own steady load, which one call's probe before it cannot see)."""
    end = time.time() + seconds
    while time.time() < end:
        fn()
        torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, calls = torch.cuda.Event(enable_timing=True), 0
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            fn()
        calls += 10
        stop.record()
        stop.synchronize()
    smi.terminate()
    samples = [tuple(float(x) for x in line.split(",")) for line in smi.communicate()[0].splitlines() if "," in line]
    mhz = sum(c for c, _ in samples) / max(len(samples), 1)
    watts = sum(w for _, w in samples) / max(len(samples), 1)
    return f"{start.elapsed_time(stop) / calls:8.4f} ms/call {mhz:6.0f} MHz {watts:5.0f} W ({len(samples)} samples)"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192")
    parser.add_argument("--cases", default="bfloat16:128:128:1,bfloat16:128:128:0")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--sustain", type=float, default=0.0, help="also run each side back to back this many "
                        "seconds with nvidia-smi sampling the clock")
    parser.add_argument("--variants", default="", help="static (persistent by a static stride), ownO (O's own "
                        "buffer, one CTA per tile), fullgrid (the persistent kernel on a CTA per tile)")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func

    b, n, s = (int(x) for x in args.shape.split(","))
    table = load_config_file(Path(__file__).resolve().parents[2] / "configs" / "h100.yaml")
    counter = torch.zeros((1, 1), dtype=torch.int32, device="cuda")
    summary = []
    for case in args.cases.split(","):
        dtype_name, d, dv, causal, *block_n = case.split(":")
        d, dv, causal = int(d), int(dv), bool(int(causal))
        dtype = DTYPES[dtype_name]
        shipped = without_clusters(table.lookup(dtype_name, d, causal, "fwd", seqlen=s, value_head_dim=dv))
        tiles = dataclasses.replace(shipped, block_n=int(block_n[0])) if block_n else shipped
        problem = AttentionProblem.of(causal)
        value = None if dv == d else dv

        def compiled(config):
            return compile_forward(dtype_name, d, problem, config, value_head_dim=value, value_tile_head_dim=value)

        kernels = {"shipped": (compiled(shipped), None)}
        if tiles != shipped:
            kernels[f"bn{tiles.block_n}"] = (compiled(tiles), None)
        persistent = f"pers{tiles.block_n}"
        kernels[persistent] = (compiled(dataclasses.replace(tiles, persistent=True)), counter)
        for name in args.variants.split(",") if args.variants else ():
            flag = {"static": "EXPERIMENT_STATIC_STRIDE", "ownO": "EXPERIMENT_OWN_O",
                    "fullgrid": "EXPERIMENT_FULL_GRID", "staticfor": "EXPERIMENT_STATIC_FOR"}[name]
            setattr(fwd_sm90, flag, True)
            kernels[name] = (compiled(dataclasses.replace(tiles, persistent=name != "ownO")), counter)
            setattr(fwd_sm90, flag, False)
        scale = 1 / math.sqrt(d)
        q, k = (torch.randn(b, s, n, d, device="cuda", dtype=dtype) for _ in range(2))
        v = torch.randn(b, s, n, dv, device="cuda", dtype=dtype)
        qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
        if not args.no_check:
            good, lines = check(*kernels[persistent], dtype, d, dv, causal)
            base = kernels[f"bn{tiles.block_n}"] if tiles != shipped else kernels["shipped"]
            want, want_lse = poisoned_run(*base, qv, kv, vv, scale)
            got, got_lse = poisoned_run(*kernels[persistent], qv, kv, vv, scale)
            same = torch.equal(want, got) and torch.equal(want_lse, got_lse)
            print(f"check {case}: {'ok' if good and same else 'FAIL'}; bitwise equal to one CTA per tile "
                  f"on ({b}, {n}, {s}): {same}")
            print("\n".join(lines))
        out = torch.empty((b, n, s, dv), dtype=dtype, device="cuda")
        lse = torch.empty((b, n, s), dtype=torch.float32, device="cuda")
        sides = {name: (lambda kc=kc: call(*kc, qv, kv, vv, out, lse, scale)) for name, kc in kernels.items()}
        sides["fa4"] = lambda: flash_attn_func(q, k, v, causal=causal)
        with torch.no_grad():
            rows = rotated_rounds(sides, args.rounds, args.hold)
        print(f"\n({b}, {n}, {s}) {case} (shipped block_n {shipped.block_n}), {args.rounds} rounds; "
              f"ratio = shipped ms / this ms in the same round")
        print("\n".join(round_table(rows, lambda name: ("shipped", name), width=11)))
        summary += [(case, name, round_medians(rows, name)[0], round_ratios(rows, "shipped", name)[0])
                    for name in sides]
        if args.sustain:
            with torch.no_grad():
                for name, fn in sides.items():
                    print(f"sustained {case} {name:9s} {sustained(fn, args.sustain)}")
    print("\nsummary: case side ms speedup-over-shipped")
    for case, name, ms, ratio in summary:
        print(f"{case:22s} {name:9s} {ms:8.4f} {ratio:6.3f}")


if __name__ == "__main__":
    main()
