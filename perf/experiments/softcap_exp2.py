"""How much of the softmax's exp2 to move off the SFU when a softcap's tanh shares it (one
device call): compile the softcap forward with several shares of columns on the FMA pipe
(kernels/ptx.exp2_fma) and polynomial degrees, check each against a float64 reference
(outputs poisoned, every element, rows that see no key included), then time them in
interleaved rounds beside the forward without a softcap.

    python perf/experiments/softcap_exp2.py [--out DIR] [--rounds 5]

The module constants are not in the compile keys: the variants are compiled here, uncached.
During the experiment (perf/NOTES.md, twenty-first session) the kernels had two more switches,
the softmax taking the transform in unmasked blocks (now FlashForwardSm90's rule for two
consumer warpgroups) and the cap as a fixed row maximum (not shipped); the variants here
differ in SOFTCAP_FMA_EXP2_COLUMNS and the polynomial only.
"""

import argparse
import dataclasses
import math
import os
import statistics

import torch

import cute_flash.kernels.ptx as ptx
import cute_flash.kernels.score_transform as score_transform
from cute_flash.benchmarking import relative_error, run_poisoned, time_ms
from cute_flash.compile_fwd import compile_forward
from cute_flash.config import load_config_file
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.reference import attention_reference
from cute_flash.torch_helpers import DENSE_BATCH

DEGREE_3 = (0.9999282360076904, 0.693260908126831, 0.24260830879211426, 0.05517052486538887)
DEGREE_4 = ptx.EXP2_FMA_COEFFS
VARIANTS = {  # name: (fma columns, coefficients)
    "none on fma": (None, DEGREE_4),
    "1/4": ((1, 4), DEGREE_4),
    "1/2": ((1, 2), DEGREE_4),
    "1/4 deg3": ((1, 4), DEGREE_3),
}
CHECKS = [  # (B, N, Sq, Sk, bottom_right, every score near -c / "large" scores)
    (1, 2, 1000, 1000, False, False), (2, 3, 17, 300, False, False), (1, 2, 300, 17, True, False),
    (1, 1, 1, 129, False, False), (1, 2, 8191, 8191, False, False), (1, 2, 1000, 1000, False, True),
    (1, 2, 1000, 1000, False, "large"),
]


def check_inputs(b, n, sq, sk, d, negative):
    if negative == "large":
        # Scores of about c / 3 (D = 128, softcap 30): some of each warp's beyond a tanh
        # polynomial's range, some within (score_transform.TANH_POLYNOMIALS).
        return (torch.randn(b, n, length, d, device="cuda", dtype=torch.bfloat16) * 3.5 for length in (sq, sk, sk))
    if not negative:
        return (torch.randn(b, n, length, d, device="cuda", dtype=torch.bfloat16) * 2 for length in (sq, sk, sk))
    # Keys near one direction, queries opposite: every score far below -c, so every
    # probability near exp(-2c) relative to the bound c (the fixed maximum's worst case).
    base = torch.randn(d, device="cuda")
    k = (base + 0.1 * torch.randn(b, n, sk, d, device="cuda")).bfloat16()
    q = (-10 * base + 0.1 * torch.randn(b, n, sq, d, device="cuda")).bfloat16()
    return q, k, torch.randn(b, n, sk, d, device="cuda", dtype=torch.bfloat16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shape", default="4,32,8192,128")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "softcap_exp2.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    table = load_config_file("configs/h100.yaml")
    b, n, s, d = (int(x) for x in args.shape.split(","))
    sink, packed = None, DENSE_BATCH
    results = {}
    for causal in (True, False):
        kernels = {}
        config = table.lookup("bfloat16", d, causal, "fwd", seqlen=s)
        kernels["no softcap"] = compile_forward("bfloat16", d, AttentionProblem.of(causal), config)
        for name in args.variants.split(","):
            share, ptx.EXP2_FMA_COEFFS = VARIANTS[name]
            score_transform.SOFTCAP_FMA_EXP2_COLUMNS = {256: share}
            for bottom_right in (False, True):
                problem = dataclasses.replace(AttentionProblem.of(causal), softcap=30.0, bottom_right=bottom_right)
                kernels[(name, bottom_right)] = compile_forward("bfloat16", d, problem, config)
        for name in args.variants.split(","):
            worst = 0.0
            for (cb, cn, sq, sk, bottom_right, negative) in CHECKS:
                q, k, v = check_inputs(cb, cn, sq, sk, d, negative)
                out, lse = run_poisoned(kernels[(name, bottom_right)], q, k, v, 1.0 / math.sqrt(d))
                ref, ref_lse = attention_reference(q, k, v, causal=causal, softcap=30.0,
                                                   alignment="bottom_right" if bottom_right else "top_left")
                err = relative_error(out, ref)
                seen = torch.isfinite(ref_lse)
                lse_err = (lse.double() - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
                empty_ok = bool((lse[~seen] == -math.inf).all()) and bool((out[~seen] == 0).all()) \
                    if (~seen).any() else True
                good = err < 1e-2 and lse_err < 2e-3 and empty_ok
                worst = max(worst, err)
                log(f"check {name} causal={causal} {(cb, cn, sq, sk, bottom_right, negative)}: rel {err:.2e} lse {lse_err:.2e} "
                    f"empty rows ok {empty_ok}: {'ok' if good else 'FAIL'}")
        q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
        timed = {"no softcap": kernels["no softcap"], **{name: kernels[(name, False)] for name in args.variants.split(",")}}
        samples = {name: [] for name in timed}
        for _ in range(args.rounds):
            for name, fn in timed.items():
                samples[name].append(time_ms(lambda: fn(q, k, v, out, lse, sink, *packed, 1.0 / math.sqrt(d)),
                                             iters=10))
        base = statistics.median(samples["no softcap"])
        for name in timed:
            ms = statistics.median(samples[name])
            results[(causal, name)] = (ms, ms / base)
    log(f"\n(B, N, S, D) = {(b, n, s, d)} bf16, softcap 30, {args.rounds} interleaved rounds, median")
    log(f"{'causal':6s} {'variant':12s} {'ms':>8s} {'/ no softcap':>12s}")
    for (causal, name), (ms, ratio) in results.items():
        log(f"{str(causal):6s} {name:12s} {ms:8.3f} {ratio:12.3f}")


if __name__ == "__main__":
    main()
