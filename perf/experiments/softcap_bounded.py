"""The softcap's forward without a running maximum (OnlineSoftmax's bounded scores) against the
same kernel with it, the forward without a softcap and flash-attn-4's softcap forward (one
device call).

Every variant is compiled here, uncached (score_transform.BOUNDED_SOFTMAX is not in the compile
key), checked against a float64 reference first (outputs poisoned, every element, rows that see
no key or a single key, every score far below -c), then timed as fwd_pair_clock.py times: per
round each side once, the order rotated, each sample flushed after the same hold, so the ratios
(taken per round against the forward without a softcap) compare calls at one clock.

    python perf/experiments/softcap_bounded.py [--shape 4,32,8192,128] [--caps 30,50]
        [--causal 1,0] [--rounds 9] [--hold 1.0] [--no-check] [--variants running,bounded,...]

Variants (VARIANTS): the running maximum as before (running), bounded scores with a quarter of
the exp2 on the FMA pipe (bounded, shipped), with none (bnd_sfu), 1 of 8 or 3 of 8.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cute_flash.kernels.score_transform as score_transform  # noqa: E402
from cute_flash.benchmarking import (  # noqa: E402
    relative_error, round_medians, round_ratios, round_table, rotated_rounds, run_poisoned)
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import load_config_file, without_clusters  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402
from softcap_exp2 import CHECKS, check_inputs  # noqa: E402


VARIANTS = {  # name: (bounded scores, OnlineSoftmax's fma_columns)
    "running": (False, (1, 4)),
    "bounded": (True, (1, 4)),
    "bnd_sfu": (True, None),
    "bnd_1of8": (True, (1, 8)),
    "bnd_3of8": (True, (3, 8)),
}


def compiled(d, causal, cap, variant, config, bottom_right=False):
    score_transform.BOUNDED_SOFTMAX, share = VARIANTS[variant]
    score_transform.SOFTCAP_FMA_EXP2_COLUMNS = {256: share}
    problem = AttentionProblem.of(causal, softcap=cap, alignment="bottom_right" if bottom_right else "top_left")
    return compile_forward("bfloat16", d, problem, config)


def check(kernel, d, causal, cap, case):
    cb, cn, sq, sk, bottom_right, negative = case
    q, k, v = check_inputs(cb, cn, sq, sk, d, negative)
    out, lse = run_poisoned(kernel, q, k, v, 1.0 / math.sqrt(d))
    alignment = "bottom_right" if bottom_right else "top_left"
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softcap=cap, alignment=alignment)
    # The error of the same math in bf16 (torch), the FlashAttention tests' yardstick.
    low, _ = attention_reference(q, k, v, causal=causal, softcap=cap, alignment=alignment, dtype=torch.bfloat16)
    seen = torch.isfinite(ref_lse)
    lse_err = (lse.double() - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
    empty_ok = bool((lse[~seen] == -math.inf).all()) and bool((out[~seen] == 0).all()) if (~seen).any() else True
    max_err = (out.double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    good = max_err <= 2 * low_err + 1e-5 and lse_err < 2e-3 and empty_ok
    return good, f"rel {relative_error(out, ref):.2e} max {max_err:.2e} (bf16 math {low_err:.2e}) lse {lse_err:.2e}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192,128")
    parser.add_argument("--caps", default="30,50")
    parser.add_argument("--causal", default="1,0")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--variants", default="running,bounded")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func

    b, n, s, d = (int(x) for x in args.shape.split(","))
    table = load_config_file(Path(__file__).resolve().parents[2] / "configs" / "h100.yaml")
    scale = 1.0 / math.sqrt(d)
    sink, packed = None, DENSE_BATCH
    summary = []
    for causal in (bool(int(x)) for x in args.causal.split(",")):
        # MHA: clusters of query heads do not apply.
        config = without_clusters(table.lookup("bfloat16", d, causal, "fwd", seqlen=s))
        base = compile_forward("bfloat16", d, AttentionProblem.of(causal), config)
        for cap in (float(x) for x in args.caps.split(",")):
            kernels = {name: compiled(d, causal, cap, name, config) for name in args.variants.split(",")}
            if not args.no_check:
                for name in kernels:
                    right = compiled(d, causal, cap, name, config, bottom_right=True)
                    for case in CHECKS:
                        good, text = check(right if case[4] else kernels[name], d, causal, cap, case)
                        print(f"check {name} causal={causal} cap={cap} {case}: {text}: {'ok' if good else 'FAIL'}")
            q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
            out = torch.empty_like(qv)
            lse = torch.empty(qv.shape[:3], dtype=torch.float32, device="cuda")
            sides = {"no softcap": lambda: base(qv, kv, vv, out, lse, sink, *packed, scale)}
            for name, fn in kernels.items():
                sides[name] = lambda fn=fn: fn(qv, kv, vv, out, lse, sink, *packed, scale)
            sides["fa4"] = lambda: flash_attn_func(q, k, v, causal=causal, softcap=cap)
            with torch.no_grad():
                rows = rotated_rounds(sides, args.rounds, args.hold)
            print(f"\n{args.shape} bf16 causal={causal} softcap={cap}, {args.rounds} rounds; "
                  f"ratio = this ms / no-softcap ms in the same round")
            print("\n".join(round_table(rows, lambda name: (name, "no softcap"), width=11)))
            summary += [(causal, cap, name, round_medians(rows, name)[0], round_ratios(rows, name, "no softcap")[0])
                        for name in sides]
    print("\nsummary: causal cap side ms ratio-to-no-softcap")
    for causal, cap, name, ms, ratio in summary:
        print(f"{int(causal)} {cap:4.0f} {name:11s} {ms:8.4f} {ratio:6.3f}")


if __name__ == "__main__":
    main()
