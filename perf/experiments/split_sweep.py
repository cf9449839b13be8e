"""Split-KV decode: which split count serves each (batch, cache length) best, as CUDA graph
replays (kernels only) and eager calls, beside cuDNN (SDPA) in the same run.

    python perf/experiments/split_sweep.py [--graphs] [--batches 1,8] [--splits 1,2,4,...]

One decode step, 32/8 heads, D = 128, bf16, every sequence with the whole cache in use.
Prints GB/s of K and V read per split count, and the best count's ratio to the peer (cuDNN;
with --seqlen-q > 1 a causal step against flash-attn-4).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from peers import as_cuda_graph, interleaved_medians  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--caches", default="4096,32768,131072")
    parser.add_argument("--splits", default="1,4,8,16,24,33,48,66,132")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqlen-q", type=int, default=1,
                        help="query positions per step (> 1: causal, against flash-attn-4 instead of cuDNN)")
    parser.add_argument("--profile", action="store_true", help="also print each kernel's GPU time of the auto step")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for batch in (int(b) for b in args.batches.split(",")):
        for cache_len in (int(c) for c in args.caches.split(",")):
            bf16 = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(batch, args.seqlen_q, HEADS, HEAD_DIM, **bf16)
            causal = args.seqlen_q > 1
            k_cache, v_cache = (torch.randn(batch, cache_len, KV_HEADS, HEAD_DIM, **bf16) for _ in range(2))
            seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
            q_bnsd, k_bnsd, v_bnsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q_bnsd, k_bnsd, v_bnsd, enable_gqa=True)

            def flash_attn_4():
                from flash_attn.cute import flash_attn_func

                return flash_attn_func(q, k_cache, v_cache, causal=True)

            peer = flash_attn_4 if causal else cudnn
            steps = {"peer": peer, "auto": lambda: cute_flash.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal)}
            for splits in (int(s) for s in args.splits.split(",")):
                steps[f"s{splits}"] = (lambda n: lambda: cute_flash.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=n, causal=causal))(splits)
            with torch.no_grad():
                for step in steps.values():
                    step()
                if args.graphs:
                    steps = {name: as_cuda_graph(step) for name, step in steps.items()}
                medians = interleaved_medians(steps, args.rounds, 10)
            kv_bytes = 2 * batch * cache_len * KV_HEADS * HEAD_DIM * 2
            best = min((ms, name) for name, ms in medians.items() if name != "peer")
            cells = " ".join(f"{name}:{kv_bytes / ms / 1e6:.0f}" for name, ms in medians.items())
            print(f"B={batch} Sq={args.seqlen_q} S={cache_len} GB/s {cells} | best {best[1]} "
                  f"{medians['peer'] / best[0]:.2f}x peer, auto {medians['peer'] / medians['auto']:.2f}x", flush=True)
            if args.profile:
                profile(steps["auto"], f"B={batch} S={cache_len} auto")
            del steps
            torch.cuda.empty_cache()


def profile(step, label):
    """Each kernel's mean GPU time over 20 calls of step (torch.profiler), in us."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_time_total > 0:
            print(f"  {label} {event.key[:70]:70s} {event.device_time_total / event.count:8.2f} us x {event.count}")


if __name__ == "__main__":
    main()
