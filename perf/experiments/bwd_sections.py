"""A/B of the causal backward's key-block order (GPU script, one device call): the main
backward kernel compiled with tile_scheduler.L2_SECTION_BYTES = 0 (longest first within each
(head, batch) only) against section budgets (--budgets, MiB: key blocks longest first across
sections of pairs whose Q, dO and dQ rows fit the budget), beside flash-attn-4's backward where importable.

    python perf/experiments/bwd_sections.py [--shapes 1,16,4096,128;4,32,8192,128] [--kv-heads 8]
        [--budgets 32,8] [--dtype bfloat16] [--rounds 7] [--out DIR]

Per shape: one forward (ours) gives O and the LSE, then each order's backward plan runs on the
same operands. Check: dK and dV of every order are bitwise equal (each key block's CTA
computes them alone, whatever the order), dQ (float32 atomic additions in another order) within
1e-3 relative. Timing: interleaved rounds, L2 flushed before each sample, medians
(perf/peers.py). Both variants are compiled uncached once per head dim (the budget is read when
a kernel is built and is not in the cache key). Writes bwd_sections.csv and a log; the table last.
"""

import argparse
import csv
import math
import os
import sys
import time

import torch

from cute_flash import compile_bwd, launch_bwd
from cute_flash.config import get_config
from cute_flash.kernels import tile_scheduler
from cute_flash.kernels.problem import AttentionProblem

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from peers import interleaved_medians, runnable_steps  # noqa: E402

SHIPPED_SECTION_BYTES = tile_scheduler.L2_SECTION_BYTES


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--shapes", default="1,16,4096,128;1,16,8192,128;4,32,8192,128")
    parser.add_argument("--kv-heads", type=int, default=0, help="grouped-query attention with this many kv heads")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budgets", default=str(SHIPPED_SECTION_BYTES >> 20),
                        help="section budgets in MiB beside the per-pair order (0)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "bwd_sections.log"), "a")

    def log(msg):
        print(msg)
        log_file.write(msg + "\n")
        log_file.flush()

    dtype = getattr(torch, args.dtype)
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  date {time.strftime('%Y-%m-%d')}")
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # comparison only
        fa4 = None
        log(f"flash-attn-4 unavailable: {exc}")
    # Uncached compiles: the budget patched below is read when each kernel is built.
    compile_bwd.get_backward = compile_bwd.compile_backward
    orders = {"per_pair": 0, **{f"l2_{mib}": int(mib) << 20 for mib in args.budgets.split(",")}}
    rows = []
    for shape in args.shapes.split(";"):
        b, n, s, d = (int(x) for x in shape.split(","))
        nkv = args.kv_heads or n
        problem = AttentionProblem.of(True, grouped=nkv != n)
        q = torch.randn(b, n, s, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, nkv, s, d, device="cuda", dtype=dtype) for _ in range(2))
        scale = 1.0 / math.sqrt(d)
        from cute_flash import flash_attention
        out, lse = flash_attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
        dout = torch.randn_like(out)
        config = get_config(args.dtype, d, True, "bwd", q.device, seqlens=(s, s))
        steps, grads = {}, {}
        for name, budget in orders.items():
            tile_scheduler.L2_SECTION_BYTES = budget
            plan = launch_bwd.plan_backward(q, k, v, out, dout, lse, problem, config)
            steps[name] = lambda p=plan: p.run(q, k, v, out, dout, lse, scale, None, None, None)
            grads[name] = steps[name]()
        tile_scheduler.L2_SECTION_BYTES = SHIPPED_SECTION_BYTES
        dq0, dk0, dv0 = grads["per_pair"]
        same_kv = all(torch.equal(dk0, dk) and torch.equal(dv0, dv) for _, dk, dv in grads.values())
        dq_err = max(rel_err(dq, dq0) for dq, _, _ in grads.values())
        ok = same_kv and dq_err < 1e-3 and all(torch.isfinite(t).all() for g in grads.values() for t in g)
        log(f"{shape} kv_heads={nkv}: dK, dV bitwise equal: {same_kv}; dQ rel diff {dq_err:.1e}: "
            f"{'PASS' if ok else 'FAIL'}")
        if fa4 is not None:
            qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
            fa_out = fa4(qt, kt, vt, causal=True, softmax_scale=scale)
            fa_out = fa_out[0] if isinstance(fa_out, tuple) else fa_out
            fa_dout = dout.transpose(1, 2).contiguous()
            steps["fa4_bwd"] = lambda: torch.autograd.grad(fa_out, (qt, kt, vt), fa_dout, retain_graph=True)
        steps = runnable_steps(steps, shape)
        for name, ms in interleaved_medians(steps, args.rounds, 5).items():
            rows.append(dict(shape=shape, kv_heads=nkv, dtype=args.dtype, step=name, ms=round(ms, 4), check=ok))
        del steps, grads
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bwd_sections.csv"), "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if f.tell() == 0:
            writer.writeheader()
        writer.writerows(rows)
    log(f"{'shape':18s} {'kv':>3s} {'step':10s} {'ms':>8s} {'vs per_pair':>11s}")
    base = {r["shape"]: r["ms"] for r in rows if r["step"] == "per_pair"}
    for r in rows:
        log(f"{r['shape']:18s} {r['kv_heads']:3d} {r['step']:10s} {r['ms']:8.3f} {base[r['shape']] / r['ms']:11.3f}")


if __name__ == "__main__":
    main()
