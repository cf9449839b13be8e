"""Check and time forward-kernel variants on the GPU in one process (one device call).

    python perf/experiments/fwd_variants.py [--out DIR] [--variants NAME,...] [--quick]

For each tile-config variant: compile, check a few odd shapes against a float32 reference
(outputs poisoned with NaN first, every element compared), then time the benchmark shapes
beside SDPA's cuDNN and flash backends, flash-attn-4 (if importable; "fa4" without its LSE store,
"fa4_lse" with it, as a training forward runs) and an 8192^3 fp16
matmul, all in the same run, in interleaved rounds (--rounds). Writes a CSV and prints a short table last.
--value-head-dim times a pair of head dims (v and O of their own width); --softcap C compiles the
variants with that softcap and times the first variant without it beside them (its overhead; the
peers run without a softcap).
"""

import argparse
import csv
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from cute_flash.benchmarking import attention_flops, matmul_tflops, reference_fp32 as reference, run_poisoned
from cute_flash.compile_fwd import compile_forward
from cute_flash.config import TileConfig
from cute_flash.kernels import tile_scheduler
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.reference import attention_reference
from cute_flash.torch_helpers import DENSE_BATCH

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from peers import interleaved_medians, runnable_steps  # noqa: E402

BASE = dict(block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2, pingpong=True)
VARIANTS = {
    "base": {},
    "no_pingpong": dict(pingpong=False),
    "n176": dict(block_n=176),
    "n160": dict(block_n=160),
    "stages3": dict(num_stages=3),
    "n64": dict(block_n=64, num_stages=4),
    "m192": dict(block_m=192, num_mma_warpgroups=3),
    "m192_n64": dict(block_m=192, num_mma_warpgroups=3, block_n=64, num_stages=3),
    "n192": dict(block_n=192),
    # FA3's D <= 96 forward tile: three consumer warpgroups on 144 keys.
    "m192_n144": dict(block_m=192, num_mma_warpgroups=3, block_n=144),
    "m192_n112": dict(block_m=192, num_mma_warpgroups=3, block_n=112),
    "n144": dict(block_n=144),
    # flash-attn-4's D = 192 forward tile (128 x 112; the tuner tried 64-96 and 128).
    "n112": dict(block_n=112),
    "n96": dict(block_n=96),
    "n80": dict(block_n=80),
    "n64s2": dict(block_n=64),
    # flash-attn-4 and FA3 turn ping-pong off above D = 128 (their scheduler barrier is for
    # tile head dims <= 128): the wide tiles without it.
    "n64_no_pingpong": dict(block_n=64, pingpong=False),
    "n80_no_pingpong": dict(block_n=80, pingpong=False),
    "n96_no_pingpong": dict(block_n=96, pingpong=False),
    "n112_no_pingpong": dict(block_n=112, pingpong=False),
    "m192_no_pingpong": dict(block_m=192, num_mma_warpgroups=3, pingpong=False),
    "m192_n112_no_pingpong": dict(block_m=192, num_mma_warpgroups=3, block_n=112, pingpong=False),
}
SHIPPED_SECTION_BYTES = tile_scheduler.L2_SECTION_BYTES
BENCH_SHAPES = [(1, 64, 1024, 128), (2, 64, 4096, 128), (4, 64, 8192, 128)]
CHECK_SHAPES = [  # (B, N, Sq, Sk, D)
    (1, 1, 1, 1, 128), (2, 3, 17, 17, 128), (1, 2, 1000, 1000, 128), (1, 2, 128, 1000, 128),
    (1, 2, 1000, 77, 128), (1, 1, 8191, 8191, 128), (2, 2, 384, 384, 128),
]


def variant_settings(name):
    """(TileConfig fields, L2_SECTION_BYTES or None for the shipped value) of a variant name,
    "<tile variant>[_l2<MiB>][_rbefore_pv]":
    - "_l2<MiB>" compiles the tile with tile_scheduler.L2_SECTION_BYTES = MiB (0: causal tiles
      longest first within each head only, the order before the sections); "l2<MiB>" the base tile;
    - "_rbefore_pv" with rescale_before_pv on ("rbefore_pv" alone: the base tile)."""
    late = name == "rbefore_pv" or name.endswith("_rbefore_pv")
    name = name.removesuffix("rbefore_pv").rstrip("_")
    base, _, mib = name.rpartition("l2") if "l2" in name else (name, "", "")
    base = base.rstrip("_") or "base"
    return {**BASE, **VARIANTS[base], **({"rescale_before_pv": True} if late else {})}, (int(mib) * 2**20 if mib else None)


def check(fn, dtype, causal, log, head_dim, value_head_dim, softcap=0.0):
    worst = 0.0
    ok = True
    for (b, n, sq, sk, d) in CHECK_SHAPES:
        d = head_dim
        q = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, n, sk, value_head_dim, device="cuda", dtype=dtype)
        scale = 1.0 / math.sqrt(d)
        out, lse = run_poisoned(fn, q, k, v, scale)
        torch.cuda.synchronize()
        if softcap:
            ref, ref_lse = (t.float() for t in attention_reference(q, k, v, causal, scale, torch.float32, softcap=softcap))
        else:
            ref, ref_lse = reference(q, k, v, causal, scale)
        finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
        err = ((out.float() - ref).norm() / ref.norm()).item() if finite else float("inf")
        lse_err = (lse - ref_lse).abs().max().item() if finite else float("inf")
        worst = max(worst, err)
        good = finite and err < (2e-3 if dtype == torch.float16 else 1e-2) and lse_err < 1e-3
        ok &= good
        log(f"  check {(b, n, sq, sk, d)} causal={causal}: rel_err={err:.2e} lse_err={lse_err:.2e} "
            f"{'ok' if good else 'FAIL'}")
    return ok, worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--quick", action="store_true", help="large shape only")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--value-head-dim", type=int, default=None, help="v's head dim (default: --head-dim)")
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="the variants with this softcap, beside the first one without (its overhead, same run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default=None, help="B,N,S: time this shape instead of the benchmark shapes")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "fwd_variants.log"), "w")

    def log(msg):
        print(msg)
        log_file.write(msg + "\n")
        log_file.flush()

    dtype = getattr(torch, args.dtype)
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  date {time.strftime('%Y-%m-%d')}")
    shapes = [(b, n, s, args.head_dim) for (b, n, s, _) in BENCH_SHAPES]
    shapes = shapes[-1:] if args.quick else shapes
    if args.shape:
        shapes = [(*(int(x) for x in args.shape.split(",")), args.head_dim)]
    rows = []

    mm_ms, mm_tflops = matmul_tflops()
    log(f"matmul 8192^3 fp16: {mm_ms:.3f} ms = {mm_tflops:.0f} TFLOP/s")

    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # comparison only; absent on most machines
        fa4 = None
        log(f"flash-attn-4 unavailable: {exc}")

    for causal in [bool(int(c)) for c in args.causal.split(",")]:
        for shape in shapes:
            b, n, s, d = shape
            dv = args.value_head_dim or d
            q, k = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(2))
            v = torch.randn(b, n, s, dv, device="cuda", dtype=dtype)
            flops = attention_flops(b, n, s, s, d, causal)
            steps = {}
            for name, backend in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa_flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                def sdpa(backend=backend):
                    with torch.nn.attention.sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                steps[name] = sdpa
            if fa4 is not None:
                qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                steps["fa4"] = lambda: fa4(qt, kt, vt, causal=causal)
                # Without grad flash-attn-4 compiles its forward without the LSE store; with
                # return_lse it is the kernel a training forward runs (ours always stores the
                # LSE). The two differ by -3 to +5 % by shape (perf/NOTES.md, thirty-first
                # session): the faster one is the peer.
                steps["fa4_lse"] = lambda: fa4(qt, kt, vt, causal=causal, return_lse=True)
            steps = runnable_steps(steps, f"{shape} causal={causal}")
            out = torch.empty_like(v)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
            scale = 1.0 / math.sqrt(d)
            sink, packed = None, DENSE_BATCH
            names = args.variants.split(",")
            runs = [(vname, vname, args.softcap) for vname in names]
            if args.softcap:
                runs.insert(0, (f"{names[0]}_no_softcap", names[0], 0.0))
            for vname, config_name, softcap in runs:
                fields, section_bytes = variant_settings(config_name)
                cfg = TileConfig(**fields)
                tile_scheduler.L2_SECTION_BYTES = SHIPPED_SECTION_BYTES if section_bytes is None else section_bytes
                try:
                    fn = compile_forward(args.dtype, d, AttentionProblem.of(causal, softcap=softcap), cfg,
                                         value_head_dim=dv, value_tile_head_dim=dv)
                except Exception as exc:
                    log(f"variant {vname} causal={causal}: compile failed: {exc}")
                    continue
                if shape == shapes[0]:
                    ok, worst = check(fn, dtype, causal, log, d, dv, softcap)
                    log(f"variant {vname} causal={causal}: correctness {'PASS' if ok else 'FAIL'} (worst {worst:.2e})")
                steps[vname] = (lambda f=fn: f(q, k, v, out, lse, sink, *packed, scale))
            # Interleaved rounds (L2 flushed before each sample): the lent machines drift by
            # several percent between minutes, so only same-round ratios count.
            for name, ms in interleaved_medians(steps, args.rounds, 10).items():
                impl, variant = (name, "") if name in ("cudnn", "sdpa_flash", "fa4", "fa4_lse") else ("cute_flash", name)
                rows.append(dict(impl=impl, variant=variant, shape=str(shape), causal=causal, ms=ms,
                                 tflops=flops / ms / 1e9))
                log(f"  {name:14s} {shape} causal={causal}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
            steps = None
            torch.cuda.empty_cache()

    with open(os.path.join(args.out, "fwd_variants.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    log(f"\nmatmul ceiling {mm_tflops:.0f} TFLOP/s")
    log(f"{'impl':12s} {'variant':12s} {'shape':22s} {'causal':6s} {'ms':>8s} {'TFLOP/s':>8s} {'%mm':>5s}")
    for r in rows:
        log(f"{r['impl']:12s} {r['variant']:12s} {r['shape']:22s} {str(r['causal']):6s} "
            f"{r['ms']:8.3f} {r['tflops']:8.0f} {100 * r['tflops'] / mm_tflops:5.0f}")


if __name__ == "__main__":
    sys.exit(main())
