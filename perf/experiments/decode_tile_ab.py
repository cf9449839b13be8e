"""A/B of the decode step's forward tile (GPU script): the split decode step as a CUDA graph
replays it, with the shipped forward config against other TileConfigs and split counts, same
run, beside SDPA's cuDNN on the same cache.

    python perf/experiments/decode_tile_ab.py --variants shipped,w1_n64:32 --lengths 4096,32768

A variant is NAME[:SPLITS] (SPLITS 0: automatic) with NAME one of VARIANTS (fields replaced in
the shipped config of the cached forward as config.rows_fitted fits it to the step's rows). B (--batch), 32 / 8 heads, D = 128, bf16, the whole
cache in use (perf/kvcache.py's decode points). Every variant's output is checked against the
unsplit shipped step and a float32 reference before it is timed; the graphs are timed in
interleaved rounds, L2 flushed before each sample.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import cute_flash  # noqa: E402
import cute_flash.api as api  # noqa: E402
import cute_flash.kvcache_plan as kvcache_plan  # noqa: E402
import cute_flash.launch_fwd as launch_fwd  # noqa: E402
from cute_flash import compile_fwd  # noqa: E402
from peers import captured, interleaved_medians  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128
VARIANTS = {
    "shipped": {},
    # The shipped D = 128 entry as it ran before config.rows_fitted (two consumer warpgroups).
    "two_warpgroups": dict(block_m=128, num_mma_warpgroups=2, pingpong=True),
    "three_warpgroups": dict(block_m=192, num_mma_warpgroups=3, pingpong=True),  # D = 64's entry
    "no_pingpong": dict(pingpong=False),
    "w1_n128": dict(block_m=64, num_mma_warpgroups=1, pingpong=False),
    "w1_n128_s1": dict(block_m=64, num_mma_warpgroups=1, pingpong=False, num_stages=1),
    "w1_n64": dict(block_m=64, num_mma_warpgroups=1, pingpong=False, block_n=64),
    "w1_n64_s4": dict(block_m=64, num_mma_warpgroups=1, pingpong=False, block_n=64, num_stages=4),
    "w2_n64_s4": dict(block_n=64, num_stages=4),
}

shipped_kernel_for = launch_fwd.kernel_for
override = {}


def kernel_for(dtype, head_dim, problem, device, seqlens=None, value_head_dim=None):
    """launch_fwd.kernel_for with the current variant's fields in the forward's config (fitted to the rows)."""
    if not override:
        return shipped_kernel_for(dtype, head_dim, problem, device, seqlens, value_head_dim)
    dtype_name, tile = launch_fwd.kernel_tile(dtype, head_dim, device)
    config = launch_fwd.get_config(dtype_name, tile, problem.causal, "fwd", device, seqlens=seqlens)
    # Decode steps run one query head per cluster (config.heads_clustered: grouped rows).
    config = dataclasses.replace(launch_fwd.rows_fitted(config, seqlens[0]), **{"cluster_heads": 1, **override})
    return compile_fwd.get_forward(dtype_name, head_dim, problem, config, "sm_90a", tile, head_dim, tile)


def medians_beside_cudnn(graphs, rounds, *sdpa_args, **sdpa_kwargs):
    """name -> median us per replay of each graph and of SDPA's cuDNN on sdpa_args (captured
    here), in interleaved rounds, L2 flushed before each sample."""
    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*sdpa_args, **sdpa_kwargs)
    graphs["sdpa_cudnn"], _ = captured(cudnn)
    return {name: ms * 1000 for name, ms in interleaved_medians(graphs, rounds, 20).items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="shipped,w1_n64:32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", default="4096,32768,131072")
    parser.add_argument("--page-size", type=int, default=0, help="a paged cache (pages in shuffled order)")
    parser.add_argument("--dense", default="", help="instead: flash_attention (4, 32, SQ, 8192) forwards, "
                        "comma-separated SQ[:D] (D default 128)")
    args = parser.parse_args()
    launch_fwd.kernel_for = kernel_for
    variants = []
    for item in args.variants.split(","):
        name, _, splits = item.partition(":")
        variants.append((item, VARIANTS[name], int(splits or 0)))
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if args.dense:
        return dense(args, variants, bf16)
    lines = []
    for length in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(length)
        q = torch.randn(args.batch, 1, HEADS, D, **bf16)
        k_cache, v_cache = (torch.randn(args.batch, length, KV_HEADS, D, **bf16) for _ in range(2))
        seqlens = torch.full((args.batch,), length, dtype=torch.int32, device="cuda")
        q_bnsd, k_bnsd, v_bnsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
        ref = F.scaled_dot_product_attention(q_bnsd.float(), k_bnsd.float(), v_bnsd.float(),
                                             enable_gqa=True).transpose(1, 2)

        cache, table = (k_cache, v_cache), None
        if args.page_size:
            pages = args.batch * length // args.page_size
            order = torch.randperm(pages, device="cuda")
            table = order.view(args.batch, -1).to(torch.int32)
            cache = tuple(torch.empty(pages, args.page_size, KV_HEADS, D, **bf16).index_copy_(
                0, order, t.reshape(pages, args.page_size, KV_HEADS, D)) for t in cache)

        def step(splits=0):
            return cute_flash.flash_attn_with_kvcache(q, *cache, cache_seqlens=seqlens, block_table=table,
                                                     num_splits=splits)
        override.clear()
        unsplit = step(1).float()
        graphs = {}
        for label, fields, splits in variants:
            override.clear()
            override.update(fields)
            kvcache_plan._plans.clear()
            try:
                graphs[label], out = captured(lambda: step(splits))
            except Exception as exc:  # a variant that does not compile or launch
                print(f"S={length} {label}: failed ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
                continue
            out.fill_(float("nan"))
            graphs[label]()
            torch.cuda.synchronize()
            err = (out.float() - unsplit).abs().max().item()
            ref_err = (out.float() - ref).abs().max().item()
            print(f"S={length} {label}: max |out - unsplit| {err:.3e}, |out - ref| {ref_err:.3e}", flush=True)
            assert err < 2e-2 and ref_err < 2e-2, (err, ref_err)
        override.clear()
        kvcache_plan._plans.clear()
        med = medians_beside_cudnn(graphs, args.rounds, q_bnsd, k_bnsd, v_bnsd, enable_gqa=True)
        for name, us in med.items():
            print(f"S={length} {name:14s} {us:8.2f} us", flush=True)
        base = med.get(variants[0][0])
        for name, us in med.items():
            lines.append(f"| {args.batch} | {length} | {name} | {us:.2f} | "
                         f"{(base / us if base else float('nan')):.3f} | {med['sdpa_cudnn'] / us:.3f}x |")
    print(f"\npage size {args.page_size or 'none'}")
    print("| B | cache | variant | us | speed-up over first | cuDNN / this |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


def dense(args, variants, bf16):
    """flash_attention forwards of short queries, (4, 32, Sq, 8192) non-causal, each variant's
    config fitted to Sq first (config.rows_fitted), beside SDPA's cuDNN."""
    lines = []
    for item in args.dense.split(","):
        seqlen_q, _, head_dim = item.partition(":")
        seqlen_q, head_dim = int(seqlen_q), int(head_dim or D)
        torch.manual_seed(seqlen_q)
        q = torch.randn(4, 32, seqlen_q, head_dim, **bf16)
        k, v = (torch.randn(4, 32, 8192, head_dim, **bf16) for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        steps = {}
        for label, fields, _ in variants:
            override.clear()
            override.update(fields)
            api._plans.clear()  # its plans hold the kernel
            out = cute_flash.flash_attention(q, k, v)
            err = (out.float() - ref).abs().max().item()
            print(f"Sq={seqlen_q} D={head_dim} {label}: |out - ref| {err:.3e}", flush=True)
            assert err < 2e-2, err
            steps[label] = dict(override)
        override.clear()

        def run(fields):
            def call():
                override.clear()
                override.update(fields)
                api._plans.clear()
                return cute_flash.flash_attention(q, k, v)
            return call
        graphs = {label: captured(run(fields))[0] for label, fields in steps.items()}
        override.clear()
        med = medians_beside_cudnn(graphs, args.rounds, q, k, v)
        base = med[variants[0][0]]
        for name, us in med.items():
            lines.append(f"| {seqlen_q} | {head_dim} | {name} | {us:.2f} | {base / us:.3f} | "
                         f"{med['sdpa_cudnn'] / us:.3f}x |")
    print("\n| Sq (Sk 8192) | D | variant | us | speed-up over first | cuDNN / this |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
