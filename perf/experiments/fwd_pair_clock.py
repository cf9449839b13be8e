"""Ours against flash-attn-4 on forward shapes, timed in adjacent pairs so that both sides of a
pair see the same SM clock. hold_regime.py found the clock (1560-1860 MHz on an H200) to follow
the duty cycle of the last few hundred ms, so a step's place in a fixed round order biases its
time by several percent. Here each round runs, per case, ours and flash-attn-4 (and with
--nopack flash-attn-4 without GQA packing) next to each other, the order rotated round by
round (benchmarking.rotated_order), each sample flushed and after the same hold, the SM clock
before each call read by benchmarking.time_flushed_call. Reports per case the median of the per-round ratios (peer
ms / ours ms: above 1 means ours is faster) and each side's median ms and MHz.

    python perf/experiments/fwd_pair_clock.py [--rounds 15] [--hold 1.0]
        [--cases gqa_causal,gqa_full,mha_causal,mha_full,mha16_causal]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.benchmarking import round_table, rotated_order, time_flushed_call  # noqa: E402


CASES = {  # name -> (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, causal)
    "gqa_causal": (4, 32, 8, 8192, 8192, 128, torch.bfloat16, True),
    "gqa_full": (4, 32, 8, 8192, 8192, 128, torch.bfloat16, False),
    "mha_causal": (4, 32, 32, 8192, 8192, 128, torch.bfloat16, True),
    "mha_full": (4, 32, 32, 8192, 8192, 128, torch.bfloat16, False),
    "mha16_causal": (4, 32, 32, 8192, 8192, 128, torch.float16, True),
    "gqa16_causal": (4, 32, 8, 8192, 8192, 128, torch.float16, True),
    "gqa_causal_d64": (4, 32, 8, 8192, 8192, 64, torch.bfloat16, True),
    "mha_causal_d64": (4, 32, 32, 8192, 8192, 64, torch.bfloat16, True),
    "gqa_full_d64": (4, 32, 8, 8192, 8192, 64, torch.bfloat16, False),
}
# Non-causal MHA over 512 ... 8192 keys: time = tiles x (per-tile cost + key blocks x per-block
# cost), so a line through these separates a tile's fixed cost from its loop's.
for _d in (64, 128):
    for _sk in (512, 1024, 2048, 4096, 8192):
        CASES[f"keys{_sk}_d{_d}"] = (4, 32, 32, 8192, _sk, _d, torch.bfloat16, False)


def sides(case, nopack):
    """{ours, fa4 (flash-attn-4, its default packing), fa4_nopack (pack_gqa=False) if nopack}."""
    import cute_flash
    from flash_attn.cute import flash_attn_func
    b, n, nkv, sq, sk, d, dtype, causal = CASES[case]
    q = torch.randn(b, sq, n, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, sk, nkv, d, device="cuda", dtype=dtype) for _ in range(2))
    bnsd = lambda t: t.transpose(1, 2)  # noqa: E731
    fns = {"ours": lambda: cute_flash.flash_attention(bnsd(q), bnsd(k), bnsd(v), causal=causal),
           "fa4": lambda: flash_attn_func(q, k, v, causal=causal)}
    if nopack and n > nkv:
        fns["fa4_nopack"] = lambda: flash_attn_func(q, k, v, causal=causal, pack_gqa=False)
    return fns


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--cases", default="gqa_causal,gqa_full,mha_causal,mha_full,mha16_causal")
    parser.add_argument("--nopack", action="store_true", help="add flash-attn-4 with pack_gqa=False")
    args = parser.parse_args()
    cases = args.cases.split(",")
    with torch.no_grad():
        fns = {c: sides(c, args.nopack) for c in cases}
        for side in fns.values():
            for fn in list(side.values()) * 3:
                fn()
        rows = {c: [] for c in cases}  # per round: {side: (ms, MHz)}
        for r in range(args.rounds):
            for c in cases:  # the cases' rounds interleaved, each side order rotated
                rows[c].append({name: time_flushed_call(fns[c][name], args.hold)
                                for name in rotated_order(list(fns[c]), r)})
    print(f"{args.rounds} rounds, hold {args.hold} ms; ratio = peer ms / ours ms in the same round")
    for c in cases:
        print(f"\n{c}")
        print("\n".join(round_table(rows[c], lambda name: (name, "ours"))))


if __name__ == "__main__":
    main()
