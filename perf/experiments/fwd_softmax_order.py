"""The forward's softmax tail in three orders, same run as flash-attn-4 (GPU script, one call).
Runs against commit d06365c only (its fwd_sm90.O_RESCALE knob and ptx.keep_defined_here were
removed after the experiment refuted them, perf/NOTES.md twenty-sixth session).

    python perf/experiments/fwd_softmax_order.py [--out DIR] [--rounds 5]

ncu (2026-11-25, perf/logs/2026-11-25-h100-ncu-fwd-peer.txt) put our forward's warps 22 % longer
in the softmax than flash-attn-4's: after the P V wait our P conversions (F2FP) ran as a burst
at the end of the iteration, sunk past the conditional O rescale's branch, instead of between
the exp2s. Variants (fwd_sm90.O_RESCALE, read when the kernel is traced):
  vote           O rescaled when a row of the warp moved its max (the shipped kernel)
  vote_pinned_p  the same, the P conversions held before the branch (ptx.keep_defined_here)
  always         O rescaled every block, no branch (flash-attn-4's choice)
Each variant is compiled uncached, checked bitwise against `vote` and against a float32
reference on odd shapes, then all are timed in interleaved rounds (L2 flushed) beside
flash-attn-4 on the same memory (our kernels take (B, N, S, D) views of its (B, S, N, D)).
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash.kernels.fwd_sm90 as fwd_sm90  # noqa: E402
from cute_flash.benchmarking import attention_flops, reference_fp32, run_poisoned as run, time_ms  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import get_config  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402

VARIANTS = ("vote", "vote_pinned_p", "always")
CHECK = [(1, 2, 17, 17), (2, 3, 1000, 1000), (1, 2, 128, 1000), (1, 2, 1000, 77)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="bfloat16:128:0,bfloat16:128:1,float16:128:0,float16:128:1,bfloat16:64:0")
    parser.add_argument("--shape", default="4,32,8192")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "fwd_softmax_order.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    from flash_attn.cute import flash_attn_func
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M')}")
    b, n, s = (int(x) for x in args.shape.split(","))
    table = []
    for case in args.cases.split(","):
        dtype_name, d, causal = case.split(":")
        d, causal = int(d), bool(int(causal))
        dtype = getattr(torch, dtype_name)
        problem = AttentionProblem.of(causal)
        config = get_config(dtype_name, d, causal, "fwd", torch.device("cuda"), seqlens=(s, s))
        kernels = {}
        for name in VARIANTS:
            fwd_sm90.O_RESCALE = name
            kernels[name] = compile_forward(dtype_name, d, problem, config)
        fwd_sm90.O_RESCALE = "vote"
        ok = True
        for (cb, cn, sq, sk) in CHECK:
            q = torch.randn(cb, cn, sq, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(cb, cn, sk, d, device="cuda", dtype=dtype) for _ in range(2))
            scale = 1 / math.sqrt(d)
            base = run(kernels["vote"], q, k, v, scale)
            ref, ref_lse = reference_fp32(q, k, v, causal, scale)
            err = ((base[0].float() - ref).norm() / ref.norm()).item()
            lse_err = (base[1] - ref_lse).abs().max().item()
            good = err < (2e-3 if dtype == torch.float16 else 1e-2) and lse_err < 1e-3
            for name in VARIANTS[1:]:
                out, lse = run(kernels[name], q, k, v, scale)
                same = torch.equal(out, base[0]) and torch.equal(lse, base[1])
                good &= same
                if not same:
                    log(f"  {case} {name} {(cb, cn, sq, sk)}: differs from vote "
                        f"(max |dO| {(out.float() - base[0].float()).abs().max().item():.2e})")
            ok &= good
            log(f"  check {case} {(cb, cn, sq, sk)}: rel_err {err:.2e} lse_err {lse_err:.2e} {'ok' if good else 'FAIL'}")
        qs, ks, vs = (torch.randn(b, s, n, d, device="cuda", dtype=dtype) for _ in range(3))
        q, k, v = (t.transpose(1, 2) for t in (qs, ks, vs))
        out = torch.empty(b, n, s, d, device="cuda", dtype=dtype)
        lse = torch.empty(b, n, s, device="cuda", dtype=torch.float32)
        sink, packed, scale = None, DENSE_BATCH, 1 / math.sqrt(d)
        steps = {name: (lambda f=fn: f(q, k, v, out, lse, sink, *packed, scale)) for name, fn in kernels.items()}
        steps["flash_attn_4"] = lambda: flash_attn_func(qs, ks, vs, causal=causal)
        samples = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                samples[name].append(time_ms(step, warmup=2, iters=10, flush=True))
        med = {name: statistics.median(t) for name, t in samples.items()}
        flops = attention_flops(b, n, s, s, d, causal)
        for name, ms in med.items():
            log(f"  {case} {name:14s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  "
                f"rounds {' '.join(f'{t:.3f}' for t in samples[name])}")
        table.append((case, ok, med))
        torch.cuda.empty_cache()
    log(f"\n(B, N, S) = {args.shape}; ratio = flash-attn-4's time / ours (> 1: ours faster)")
    log(f"{'case':18s} {'ok':4s} " + " ".join(f"{n:>14s}" for n in VARIANTS) + "   fa4 ms")
    for case, ok, med in table:
        log(f"{case:18s} {str(ok):4s} " + " ".join(f"{med[n]:7.3f} {med['flash_attn_4'] / med[n]:5.3f}x"
                                                 for n in VARIANTS) + f"   {med['flash_attn_4']:.3f}")


if __name__ == "__main__":
    main()
