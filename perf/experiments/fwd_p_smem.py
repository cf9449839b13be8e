"""Forward tiles with P in shared memory (TileConfig.p_in_shared_memory), same run as
flash-attn-4 (GPU script, one call). Runs against commit 8890c27 only: the knob was removed
after this experiment refuted it (perf/NOTES.md, twenty-seventh session).

    python perf/experiments/fwd_p_smem.py [--out DIR] [--rounds 5] [--cases bfloat16:96:0,...]

flash-attn-4 runs D <= 96 on 192-row tiles with P V reading P from shared memory ("RS is
catastrophic with 192x tiles") on 144 keys (128 causal), while our three-warpgroup tiles keep P
in registers and fall off a cliff above 112 keys (perf/NOTES.md, nineteenth session): with 160
registers per thread, P's 16-bit copy (block_n / 2 registers) is what does not fit. Each variant
below is compiled, checked against a float32 reference on odd shapes (outputs poisoned first),
then all are timed in interleaved rounds (L2 flushed) beside flash-attn-4 on the same memory
(our kernels take (B, N, S, D) views of its (B, S, N, D) tensors).
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
from cute_flash.benchmarking import attention_flops, reference_fp32, run_poisoned as run, time_ms  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import TileConfig, get_config  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402

# name -> (block_m, block_n, p_in_shared_memory); "tuned" is the shipped entry.
VARIANTS = {
    96: {"smem_m192_n112": (192, 112, True), "smem_m192_n128": (192, 128, True),
         "smem_m192_n144": (192, 144, True), "smem_m192_n160": (192, 160, True)},
    64: {"smem_m192_n128": (192, 128, True), "smem_m192_n160": (192, 160, True),
         "smem_m192_n192": (192, 192, True)},
    128: {"smem_m128_n128": (128, 128, True)},
}
CHECK = [(1, 2, 17, 17), (2, 3, 1000, 1000), (1, 2, 128, 1000), (1, 2, 1000, 77), (1, 1, 8191, 8191)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="bfloat16:96:0,bfloat16:96:1,float16:96:0,bfloat16:64:0,bfloat16:128:0")
    parser.add_argument("--shape", default="4,32,8192")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "fwd_p_smem.log"), "w")

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
        tuned = get_config(dtype_name, d, causal, "fwd", torch.device("cuda"), seqlens=(s, s))
        configs = {"tuned": tuned}
        for name, (bm, bn, smem) in VARIANTS[d].items():
            configs[name] = TileConfig(block_m=bm, block_n=bn, num_stages=2, num_mma_warpgroups=bm // 64,
                                       pingpong=True, p_in_shared_memory=smem)
        kernels, ok = {}, {}
        for name, config in configs.items():
            t0 = time.time()
            kernels[name] = compile_forward(dtype_name, d, problem, config)
            worst = 0.0
            good = True
            for (cb, cn, sq, sk) in CHECK:
                q = torch.randn(cb, cn, sq, d, device="cuda", dtype=dtype)
                k, v = (torch.randn(cb, cn, sk, d, device="cuda", dtype=dtype) for _ in range(2))
                scale = 1 / math.sqrt(d)
                out, lse = run(kernels[name], q, k, v, scale)
                ref, ref_lse = reference_fp32(q, k, v, causal, scale)
                finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
                err = ((out.float() - ref).norm() / ref.norm()).item() if finite else float("inf")
                lse_err = (lse - ref_lse).abs().max().item() if finite else float("inf")
                worst = max(worst, err)
                good &= finite and err < (2e-3 if dtype == torch.float16 else 1e-2) and lse_err < 1e-3
            ok[name] = good
            log(f"  {case} {name}: {config} compiled+checked in {time.time() - t0:.0f} s, worst rel err "
                f"{worst:.2e} {'ok' if good else 'FAIL'}")
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
            log(f"  {case} {name:16s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  "
                f"rounds {' '.join(f'{t:.3f}' for t in samples[name])}")
        table.append((case, ok, med))
        torch.cuda.empty_cache()
    log(f"\n(B, N, S) = {args.shape}; each cell: ms, flash-attn-4's time / ours (> 1: ours faster)")
    for case, ok, med in table:
        cells = [f"{name} {'' if ok[name] else 'FAIL '}{ms:.3f} {med['flash_attn_4'] / ms:.3f}x"
                 for name, ms in med.items() if name != "flash_attn_4"]
        log(f"{case:16s} fa4 {med['flash_attn_4']:.3f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
