"""Forward tile configs against each other and flash-attn-4, timed as fwd_pair_clock.py does:
per round every side once, the order rotated round by round (each side takes each place
equally often), each sample flushed and after the same hold, the SM clock read before each
call. Ratios are per round against the shipped entry (side "shipped"), so a variant's ratio
is the same-clock speed-up a YAML change would give. Each variant is checked against the
shipped kernel's output first (max abs difference printed).

    python perf/experiments/fwd_config_pairs.py --shape 4,32,8192,64 [--causal 1] [--dtype bfloat16]
        [--value-head-dim 128] [--variants rbp,stages3,...] [--rounds 11] [--hold 1.0]
        [--kv-heads 8 [--row-heads]] [--window 127] [--sink]

--value-head-dim: v and O of that head dim (the pair's own entry, e.g. (192, 128)).
--kv-heads: grouped key/value heads; with --row-heads the group runs as each tile's rows
(problem.row_heads) and the variant "unpacked" runs the shipped entry on the grouped problem.
--lock: processes started together compile at once and time one after another.
--window: a left window (causal); --sink: a sink logit per query head; --softcap: a cap.
Band problems (causal, windows) run as the API runs them, on tiles aligned to the last query
(Sq = Sk here, 16-bit); --start-aligned: on tiles aligned to the first query, as the runs
before 2026-12-02 did.

Variants (changes to the shipped entry): rbp (rescale_before_pv on), norbp (off), every / vote
(rescale_every_block on / off), pp / nopp
(pingpong on / off), stages3 /
stages2 (num_stages), m128 (block_m 128 on two warpgroups, the entry's block_n), fitted (the
two-warpgroup tile config.grid_fitted runs: on fitted_block_n keys), m192 (block_m 192 on three),
m64 (block_m 64 on one warpgroup), n<N> (block_n N), c2 (two query heads per cluster: the shipped
entry's clusters are off, as on every side without c2), sec<MiB> (the causal
grid's sections of heads: tile_scheduler.L2_SECTION_BYTES), nocap (the problem without its
softcap: the ratio a --softcap run's bar reads; its max |out - shipped| is the cap's effect).
Parts join with "+": m64+n96.
"""

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.benchmarking import round_table, rotated_rounds, timing_lock  # noqa: E402


@contextlib.contextmanager
def compiling(name):
    """Module constants a variant compiles with: sec<MiB> (tile_scheduler.L2_SECTION_BYTES, the
    causal grid's sections of heads; sec0: longest first within each (head, batch) only);
    gen<a>of<b> / gennone (score_transform.SOFTCAP_FMA_EXP2_COLUMNS_GENERAL: the exp2 share on
    the FMA pipe of a softcap softmax with a running maximum)."""
    from cute_flash.kernels import score_transform, tile_scheduler
    saved = (tile_scheduler.L2_SECTION_BYTES, score_transform.SOFTCAP_FMA_EXP2_COLUMNS_GENERAL)
    for part in name.split("+"):
        if part.startswith("sec"):
            tile_scheduler.L2_SECTION_BYTES = int(part[3:]) * 2**20
        if part.startswith("gen"):  # gen1of8, gennone: the running-maximum path's exp2 share
            share = None if part == "gennone" else tuple(int(x) for x in part[3:].split("of"))
            score_transform.SOFTCAP_FMA_EXP2_COLUMNS_GENERAL = {256: share}
    try:
        yield
    finally:
        tile_scheduler.L2_SECTION_BYTES, score_transform.SOFTCAP_FMA_EXP2_COLUMNS_GENERAL = saved


def variant_config(shipped, name):
    for part in name.split("+"):  # "m64+n96": the parts applied in turn
        shipped = _variant_part(shipped, part)
    return shipped


def _variant_part(shipped, name):
    if name.startswith(("sec", "gen")) or name in ("unpacked", "nocap"):
        return shipped
    if name == "rbp":
        return dataclasses.replace(shipped, rescale_before_pv=True)
    if name == "norbp":
        return dataclasses.replace(shipped, rescale_before_pv=False)
    if name in ("every", "vote"):
        return dataclasses.replace(shipped, rescale_every_block=name == "every")
    if name in ("pp", "nopp"):
        return dataclasses.replace(shipped, pingpong=name == "pp")
    if name.startswith("stages"):
        return dataclasses.replace(shipped, num_stages=int(name[6:]))
    if name == "m128":
        return dataclasses.replace(shipped, block_m=128, num_mma_warpgroups=2)
    if name == "fitted":  # the two-warpgroup tile grid_fitted runs (on fitted_block_n keys)
        from cute_flash.config import rows_fitted
        return rows_fitted(shipped, 128)
    if name == "m64":
        return dataclasses.replace(shipped, block_m=64, num_mma_warpgroups=1, pingpong=False)
    if name == "m192":
        return dataclasses.replace(shipped, block_m=192, num_mma_warpgroups=3)
    if name == "c2":
        return dataclasses.replace(shipped, cluster_heads=2)
    if name.startswith("n"):
        return dataclasses.replace(shipped, block_n=int(name[1:]))
    raise ValueError(f"unknown variant {name}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192,64")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", default="rbp,stages3")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--value-head-dim", type=int, default=0)
    parser.add_argument("--kv-heads", type=int, default=0)
    parser.add_argument("--row-heads", action="store_true")
    parser.add_argument("--window", type=int, default=-1)
    parser.add_argument("--sink", action="store_true")
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--lock", default="", help="a file locked around the timing (benchmarking.timing_lock)")
    parser.add_argument("--start-aligned", action="store_true", help="band tiles aligned to the first query, as "
                        "this tool ran them until 2026-12-02 (default: as the API runs the call: a 16-bit causal or "
                        "windowed call with Sq = Sk on tiles aligned to the last query, launch_fwd.end_aligned_problem)")
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func
    from cute_flash import config as config_mod
    from cute_flash.compile_fwd import compile_forward
    from cute_flash.kernels.problem import AttentionProblem
    from cute_flash.launch_fwd import end_aligned_problem
    from cute_flash.torch_helpers import DENSE_BATCH

    b, n, s, d = (int(x) for x in args.shape.split(","))
    dv = args.value_head_dim or d
    dtype = getattr(torch, args.dtype)
    causal = bool(args.causal)
    nkv = args.kv_heads or n
    q = torch.randn(b, s, n, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, s, nkv, width, device="cuda", dtype=dtype) for width in (d, dv))
    qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
    lse = torch.empty(qv.shape[:3], dtype=torch.float32, device="cuda")
    sinks = torch.randn(n, device="cuda", dtype=torch.float32) if args.sink else None
    sink, packed = sinks, DENSE_BATCH
    window = (args.window, 0) if args.window >= 0 else (-1, -1)
    variant = dict(window_size=window, sink=args.sink, softcap=args.softcap)
    grouped = AttentionProblem.of(causal, grouped=nkv < n, **variant)
    problem = AttentionProblem.of(causal, row_heads=n // nkv, **variant) if args.row_heads else grouped
    if not args.start_aligned:
        grouped, problem = (end_aligned_problem(p, True, dtype) for p in (grouped, problem))
    shipped = config_mod.get_config(args.dtype, d, causal, "fwd", q.device, seqlens=(s, s), value_head_dim=dv)
    shipped = config_mod.without_clusters(shipped)  # clusters: not measured here
    if args.row_heads:
        shipped = config_mod.rows_fitted(shipped, s * n // nkv)
    print(f"shipped entry: {shipped}")
    sides, outs = {}, {}
    for name in ["shipped"] + [x for x in args.variants.split(",") if x]:
        cfg = shipped if name == "shipped" else variant_config(shipped, name)
        side_problem = grouped if "unpacked" in name.split("+") else problem
        if "nocap" in name.split("+"):
            side_problem = dataclasses.replace(side_problem, softcap=0.0)
        try:
            with compiling(name):
                kernel = compile_forward(args.dtype, d, side_problem, cfg,
                                         value_head_dim=dv, value_tile_head_dim=dv)
        except Exception as exc:  # a config the rules or the shared memory refuse
            print(f"{name}: not compiled ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        out = torch.full((b, n, s, dv), float("nan"), device="cuda", dtype=dtype)
        sides[name] = (lambda f=kernel, out=out: f(qv, kv, vv, out, lse, sink, *packed, d ** -0.5))
        outs[name] = out
    fa_variant = dict(window_size=window) if args.window >= 0 else {}
    if sinks is not None:
        fa_variant["learnable_sink"] = sinks
    if args.softcap:
        fa_variant["softcap"] = args.softcap
    sides["fa4"] = lambda: flash_attn_func(q, k, v, causal=causal, **fa_variant)
    # Under no_grad flash-attn-4 compiles its forward without the LSE store, which every side
    # of ours makes (perf/NOTES.md, thirty-first session, item 4): fa4_lse is its kernel with it.
    sides["fa4_lse"] = lambda: flash_attn_func(q, k, v, causal=causal, return_lse=True, **fa_variant)
    with torch.no_grad(), timing_lock(args.lock):
        rows = rotated_rounds(sides, args.rounds, args.hold)
        for name, out in outs.items():
            print(f"{name}: max |out - shipped| = {(out.float() - outs['shipped'].float()).abs().max().item():.3g}")
    print(f"{args.shape} (Dv {dv}, {nkv} kv heads) {args.dtype} causal={causal} {problem}, {args.rounds} rounds; "
          "ratio = shipped ms / this ms in the same round (above 1: faster than shipped)")
    print("\n".join(round_table(rows, lambda name: ("shipped", name))))


if __name__ == "__main__":
    main()
