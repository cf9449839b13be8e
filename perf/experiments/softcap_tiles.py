"""The softcap forward on other tiles than the forward without one (one device call).

Hypothesis (perf/NOTES.md, forty-ninth session): the softcap's period at D = 128 follows one
warpgroup's chain (its Q K^T, then its softmax), which is longer than the tensor cores' work of
two warpgroups. Three consumer warpgroups on narrower key blocks (192 rows x 64 or 80 keys,
160 registers each) halve each chain while the tensor cores' work per period grows by half, so
the chain should hide behind the GEMMs of the other two.

Every candidate tile is compiled here (bf16, softcap), checked against a float64 reference
(softcap_exp2.CHECKS: outputs poisoned, every element, rows that see no key), then timed as
softcap_bounded.py times: per round each side once, the order rotated, each ratio taken against
the shipped forward without a softcap in the same round.

    python perf/experiments/softcap_tiles.py [--shape 4,32,8192,128] [--caps 30] [--causal 1,0]
        [--tiles 192x64x3s2,192x80x3s2] [--rounds 7] [--dtype bfloat16] [--fma-columns none,1/8,g1/8]

A tile is BMxBNxWGsSTAGES (pingpong on; a trailing "n" turns it off).
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cute_flash.benchmarking import round_medians, round_ratios, round_table, rotated_rounds, timing_lock  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import TileConfig, load_config_file, softcap_fitted, without_clusters  # noqa: E402
from cute_flash.kernels import probability_sums, score_transform, softmax  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402
from softcap_bounded import check  # noqa: E402
from softcap_exp2 import CHECKS  # noqa: E402
from host_overhead import with_attributes  # noqa: E402


def parse_tile(text):
    pingpong = not text.endswith("n")
    bm, bn, rest = text.rstrip("n").split("x")
    wg, stages = rest.split("s")
    return TileConfig(block_m=int(bm), block_n=int(bn), num_stages=int(stages), num_mma_warpgroups=int(wg),
                      pingpong=pingpong)


def fma_share_switches(text):
    """The module switches of one --fma-columns entry: "a/b" or "none" (for both share tables:
    bounded scores and the running-maximum path, which fp16 takes), and a leading "g" for the
    general exp2_fma on bounded scores too (softmax.BOUNDED_EXP2_FOLDED off)."""
    general = text.startswith("g")
    share = text.lstrip("g")
    table = {256: None if share == "none" else tuple(int(x) for x in share.split("/"))}
    switches = {(score_transform, "SOFTCAP_FMA_EXP2_COLUMNS"): table,
                (score_transform, "SOFTCAP_FMA_EXP2_COLUMNS_GENERAL"): table}
    if general:
        switches[(softmax, "BOUNDED_EXP2_FOLDED")] = False
    return switches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192,128")
    parser.add_argument("--caps", default="30")
    parser.add_argument("--causal", default="1,0")
    parser.add_argument("--tiles", default="192x64x3s2,192x80x3s2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lock", default="", help="a file locked around the timing, so that processes started "
                        "together compile at once and time one after another")
    parser.add_argument("--plain-tiles", default="", help="tiles also timed without a softcap")
    parser.add_argument("--fma-columns", default="", help="the shipped tile also with other shares of the "
                        "softmax's exp2 on the FMA pipe (score_transform.SOFTCAP_FMA_EXP2_COLUMNS): a/b or none, "
                        "comma-separated; a leading g takes the general exp2_fma (fma_share_switches)")
    parser.add_argument("--softmax-sums", action="store_true", help="also the shipped tile with the softmax "
                        "summing the rounded probabilities (probability_sums.ON_TENSOR_CORES off)")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func

    b, n, s, d = (int(x) for x in args.shape.split(","))
    dt = getattr(torch, args.dtype)
    table = load_config_file(Path(__file__).resolve().parents[2] / "configs" / "h100.yaml")
    scale = 1.0 / math.sqrt(d)
    sink, packed = None, DENSE_BATCH
    summary = []
    for causal in (bool(int(x)) for x in args.causal.split(",")):
        shipped = without_clusters(table.lookup(args.dtype, d, causal, "fwd", seqlen=s))
        base = compile_forward(args.dtype, d, AttentionProblem.of(causal), shipped)
        for cap in (float(x) for x in args.caps.split(",")):
            problem = AttentionProblem.of(causal, softcap=cap)
            # The softcap's own key block where the entry has one (config.softcap_fitted).
            capped = softcap_fitted(shipped, problem)
            tiles = {"shipped": capped, **{t: parse_tile(t) for t in filter(None, args.tiles.split(","))}}
            # Sides compiled with module switches set ({(module, name): value}), the shipped tile.
            switches = {f"fma {text}": fma_share_switches(text) for text in filter(None, args.fma_columns.split(","))}
            tiles.update({name: capped for name in switches})
            if args.softmax_sums:
                switches["softmax sums"] = {(probability_sums, "ON_TENSOR_CORES"): False}

            def compiled(name, cfg, problem):
                return with_attributes(switches.get(name, {}), lambda: compile_forward(args.dtype, d, problem, cfg))()
            kernels = {name: compiled(name, cfg, problem) for name, cfg in tiles.items()}
            if args.softmax_sums:
                kernels["softmax sums"] = compiled("softmax sums", capped, problem)
            if not args.no_check and args.dtype == "bfloat16":
                right_problem = AttentionProblem.of(causal, softcap=cap, alignment="bottom_right")
                for name, cfg in tiles.items():
                    right = compiled(name, cfg, right_problem)
                    for case in CHECKS:
                        good, text = check(right if case[4] else kernels[name], d, causal, cap, case)
                        print(f"check {name} causal={causal} cap={cap} {case}: {text}: {'ok' if good else 'FAIL'}",
                              flush=True)
            q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=dt) for _ in range(3))
            qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
            out = torch.empty_like(qv)
            lse = torch.empty(qv.shape[:3], dtype=torch.float32, device="cuda")
            sides = {"no softcap": lambda: base(qv, kv, vv, out, lse, sink, *packed, scale)}
            for name, fn in kernels.items():
                sides[name] = lambda fn=fn: fn(qv, kv, vv, out, lse, sink, *packed, scale)
            for t in filter(None, args.plain_tiles.split(",")):
                fn = compile_forward(args.dtype, d, AttentionProblem.of(causal), parse_tile(t))
                sides[f"plain {t}"] = lambda fn=fn: fn(qv, kv, vv, out, lse, sink, *packed, scale)
            sides["fa4"] = lambda: flash_attn_func(q, k, v, causal=causal, softcap=cap)
            with torch.no_grad(), timing_lock(args.lock):
                rows = rotated_rounds(sides, args.rounds, args.hold)
            print(f"\n{args.shape} {args.dtype} causal={causal} softcap={cap}, {args.rounds} rounds; "
                  f"ratio = this ms / no-softcap ms in the same round", flush=True)
            print("\n".join(round_table(rows, lambda name: (name, "no softcap"), width=13)))
            summary += [(causal, cap, name, round_medians(rows, name)[0], round_ratios(rows, name, "no softcap")[0])
                        for name in sides]
    print(f"\nsummary {args.shape} {args.dtype}: causal cap side ms ratio-to-no-softcap")
    for causal, cap, name, ms, ratio in summary:
        print(f"{int(causal)} {cap:4.0f} {name:13s} {ms:8.4f} {ratio:6.3f}")


if __name__ == "__main__":
    main()
