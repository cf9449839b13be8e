"""A/B of the split merge kernel (kernels/split_merge.py) inside the decode step as a CUDA
graph replays it: the shipped merge against another version of the module, same run, beside
SDPA's cuDNN on the same cache (GPU script).

    git show REV:cute_flash/kernels/split_merge.py > perf/experiments/_split_merge_other.py
    python perf/experiments/merge_ab.py --other perf/experiments/_split_merge_other.py

B = 1, 32 / 8 heads, D = 128, bf16, the whole cache in use (perf/kvcache.py's decode points);
the step is flash_attn_with_kvcache (split automatically: 16 parts), captured once with each
merge (the plan cache cleared between them). The two merged outputs are compared with each
other and with the unsplit step; then the graphs are timed in interleaved rounds, L2 flushed.
"""

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import cute_flash  # noqa: E402
import cute_flash.compile_kvcache as compile_kvcache  # noqa: E402
import cute_flash.kvcache_plan as kvcache_plan  # noqa: E402
from cute_flash.benchmarking import time_ms  # noqa: E402
from peers import captured  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128


def other_merge_getter(path):
    """get_split_merge's stand-in compiling SplitMerge from the module at `path` (through
    compile_split_merge, with the class swapped in for the call)."""
    spec = importlib.util.spec_from_file_location("_split_merge_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compiled = {}

    def get(dtype_name, head_dim, arch="sm_90a", sink=False):
        key = (dtype_name, head_dim, sink)
        if key not in compiled:
            from cute_flash.kernels import split_merge
            shipped = split_merge.SplitMerge
            split_merge.SplitMerge = module.SplitMerge
            try:
                compiled[key] = compile_kvcache.compile_split_merge(dtype_name, head_dim, sink)
            finally:
                split_merge.SplitMerge = shipped
        return compiled[key]
    return get


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", required=True, help="a split_merge.py to compare with the shipped one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--lengths", default="4096,32768,131072")
    args = parser.parse_args()
    shipped = compile_kvcache.get_split_merge
    other = other_merge_getter(args.other)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    lines = []
    for length in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(1, 1, HEADS, D, **bf16)
        k_cache, v_cache = (torch.randn(1, length, KV_HEADS, D, **bf16) for _ in range(2))
        seqlens = torch.full((1,), length, dtype=torch.int32, device="cuda")

        def step(splits=0):
            return cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
        unsplit = step(1).float()
        graphs = {}
        for name, getter in (("shipped", shipped), ("other", other)):
            compile_kvcache.get_split_merge = getter
            kvcache_plan._plans.clear()
            graphs[name], out = captured(step)
            graphs[name]()
            torch.cuda.synchronize()
            err = (out.float() - unsplit).abs().max().item()
            print(f"S={length} {name}: max |out - unsplit| {err:.3e}", flush=True)
            assert err < 2e-2, err
        compile_kvcache.get_split_merge = shipped
        kvcache_plan._plans.clear()
        q_bnsd, k_bnsd, v_bnsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

        def cudnn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q_bnsd, k_bnsd, v_bnsd, enable_gqa=True)
        graphs["sdpa_cudnn"], _ = captured(cudnn)
        samples = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, replay in graphs.items():
                samples[name].append(time_ms(replay, warmup=2, iters=20, flush=True) * 1000)
        med = {name: statistics.median(t) for name, t in samples.items()}
        for name, us in med.items():
            print(f"S={length} {name:10s} {us:8.2f} us  rounds {' '.join(f'{t:.2f}' for t in samples[name])}",
                  flush=True)
        lines.append(f"| {length} | {med['shipped']:.2f} | {med['other']:.2f} | {med['sdpa_cudnn']:.2f} | "
                     f"{med['other'] / med['shipped']:.3f} | {med['sdpa_cudnn'] / med['shipped']:.3f}x |")
    print("\n| cache | shipped us | other us | cuDNN us | other / shipped | cuDNN / shipped |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
