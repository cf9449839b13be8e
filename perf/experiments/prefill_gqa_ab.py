"""Is packing a GQA group's query heads into one tile what flash-attn-4's prefill over a cache
has over ours? Issue 23's prefill shape (2048 new tokens after 30720 cached, 32/8 heads,
D = 128, bf16, causal bottom-right), timed in one run, interleaved rounds:

    ours over the cache (flash_attn_with_kvcache's eager plan), ours GQA (flash_attention on
    (B, N, S, D) views of the cache), ours on K/V expanded to 32 heads (MHA: no sharing between
    a group's tiles), the same shapes non-causal; flash-attn-4 with its default pack_gqa (True
    here), pack_gqa=False, with its LSE store (return_lse), and on the expanded K/V.

    python perf/experiments/prefill_gqa_ab.py [--rounds 5] [--batches 1,4] [--check]
        [--variants causal,l2_0,l2_32] [--only fa4_gqa,...] [--new 2048 --cached 30720]

Commit d17895a (reverted) ran our grouped rows position-major over the cache for any Sq
(variants kv_grouped_rows / kv_unpacked of that version): no faster than one query head per
tile (perf/NOTES.md, thirty-fourth session).

    ncu --profile-from-start off ... python perf/experiments/prefill_gqa_ab.py --profile NAME,NAME
        (those steps once each inside a profiler range, at the first batch)
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import run_in_profiler_range, run_poisoned  # noqa: E402
from peers import interleaved_medians, runnable_steps  # noqa: E402

NEW, CACHED, HEADS, KV_HEADS, D = 2048, 30720, 32, 8, 128
SCALE = D ** -0.5


def steps(batch):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, NEW, HEADS, D, **bf16)
    k, v = (torch.randn(batch, NEW + CACHED, KV_HEADS, D, **bf16) for _ in range(2))
    k_mha, v_mha = (t.repeat_interleave(HEADS // KV_HEADS, dim=2) for t in (k, v))
    bnsd = lambda t: t.transpose(1, 2)  # noqa: E731
    ours = lambda kk, vv, causal: (lambda: cute_flash.flash_attention(  # noqa: E731
        bnsd(q), bnsd(kk), bnsd(vv), causal=causal, alignment="bottom_right"))
    full = torch.full((batch,), NEW + CACHED, dtype=torch.int32, device="cuda")
    impls = {
        "kv_plan": lambda: cute_flash.flash_attn_with_kvcache(q, k, v, cache_seqlens=full, causal=True),
        "ours_gqa": ours(k, v, True),
        "ours_mha": ours(k_mha, v_mha, True),
        "ours_gqa_full": ours(k, v, False),
    }
    from flash_attn.cute import flash_attn_func
    impls.update({
        "fa4_gqa": lambda: flash_attn_func(q, k, v, causal=True),
        "fa4_gqa_nopack": lambda: flash_attn_func(q, k, v, causal=True, pack_gqa=False),
        "fa4_gqa_lse": lambda: flash_attn_func(q, k, v, causal=True, return_lse=True),
        "fa4_mha": lambda: flash_attn_func(q, k_mha, v_mha, causal=True),
        "fa4_gqa_full": lambda: flash_attn_func(q, k, v, causal=False),
        "fa4_gqa_full_nopack": lambda: flash_attn_func(q, k, v, causal=False, pack_gqa=False),
    })
    if DIRECT_VARIANTS:
        impls.update(direct_variants(q, k, v))
    return impls


DIRECT_VARIANTS = []  # --variants: our kernel compiled directly (direct_variants)
_compiled = {}  # variant name -> kernel (compiled once, whatever the batch)


def direct_variants(q, k, v):
    """Our GQA kernel compiled directly (launched on the (B, N, S, D) views) for each of
    DIRECT_VARIANTS: "causal" or "full" as shipped, "cluster" / "cluster_full" with
    TileConfig.cluster_heads 2, "l2_<MiB>" causal with
    tile_scheduler.L2_SECTION_BYTES at that many MiB (0: causal tiles longest first within each
    head only; large: across every head); a suffix after a name ("causal_b") compiles a second
    copy, timed at another place in each round. (The thirty-fourth session's softmax A/B
    compiled "causal_softmax0/1" through a scratch switch, removed with it.)"""
    from cute_flash.compile_fwd import compile_forward
    from cute_flash.config import TileConfig
    from cute_flash.kernels import tile_scheduler
    from cute_flash.kernels.problem import AttentionProblem
    from cute_flash.torch_helpers import DENSE_BATCH

    shipped = tile_scheduler.L2_SECTION_BYTES
    config = TileConfig(block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2, pingpong=True)
    qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
    lse = torch.empty(qv.shape[:3], dtype=torch.float32, device="cuda")
    sink, packed = None, DENSE_BATCH
    variants = {}
    for name in DIRECT_VARIANTS:
        problem = AttentionProblem.of("full" not in name, alignment="bottom_right", grouped=True)
        # "cluster...": two query heads of a group per cluster, K / V multicast (TileConfig.cluster_heads)
        variant = dataclasses.replace(config, cluster_heads=2) if name.startswith("cluster") else config
        if name.startswith("l2_"):
            tile_scheduler.L2_SECTION_BYTES = int(name[3:].split("_")[0]) * 2**20
        try:
            if name not in _compiled:
                _compiled[name] = compile_forward("bfloat16", D, problem, variant)
            kernel = _compiled[name]
        finally:
            tile_scheduler.L2_SECTION_BYTES = shipped
        out = torch.empty_like(qv)
        step = (lambda f=kernel, out=out: f(qv, kv, vv, out, lse, sink, *packed, SCALE))
        # --check runs the kernel on its operands with poisoned outputs (benchmarking.run_poisoned).
        step.kernel, step.operands = kernel, (qv, kv, vv)
        variants[f"ours_{name}"] = step
    return variants


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--check", action="store_true", help="compare ours with flash-attn-4 first")
    parser.add_argument("--profile", default=None, help="comma-separated step names to run in a profiler range")
    parser.add_argument("--variants", default="",
                        help="our kernel compiled directly: causal, full, l2_<MiB> (direct_variants)")
    parser.add_argument("--only", default="", help="time only these steps (comma-separated) besides the variants")
    parser.add_argument("--new", type=int, default=NEW, help="query tokens per sequence")
    parser.add_argument("--cached", type=int, default=CACHED, help="keys before them (0: GQA self-attention)")
    args = parser.parse_args()
    globals().update(NEW=args.new, CACHED=args.cached)
    DIRECT_VARIANTS.extend(x for x in args.variants.split(",") if x)
    if args.profile:
        impls = steps(int(args.batches.split(",")[0]))
        return run_in_profiler_range([impls[name] for name in args.profile.split(",")])
    for batch in map(int, args.batches.split(",")):
        with torch.no_grad():
            impls = steps(batch)
            if args.check:
                first = lambda r: (r[0] if isinstance(r, tuple) else r).float()  # noqa: E731
                ref = first(impls["fa4_gqa"]())
                direct = [n for n in impls if hasattr(impls[n], "kernel")]
                for name in ["kv_plan", "ours_gqa"] + direct:
                    if "full" in name:
                        continue
                    step = impls[name]
                    out = first(run_poisoned(step.kernel, *step.operands, SCALE) if name in direct else step())
                    out = out if out.shape == ref.shape else out.transpose(1, 2)
                    print(f"B = {batch} {name}: max |out - fa4| = {(out - ref).abs().max().item():.3e}")
            if args.only:
                keep = set(args.only.split(",")) | {"fa4_gqa"}
                impls = {n: f for n, f in impls.items() if n in keep or hasattr(f, "kernel")}
            medians = interleaved_medians(runnable_steps(impls, f"B={batch}"), args.rounds, 10)
        base = medians["fa4_gqa"]
        print(f"B = {batch}: ms (fa4_gqa / this)")
        for name, ms in medians.items():
            print(f"  {name:22s} {ms:8.4f}  {base / ms:.3f}x")


if __name__ == "__main__":
    main()
