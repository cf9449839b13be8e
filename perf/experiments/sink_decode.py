"""One-off: a decode step with learnable sinks (gpt-oss: 64 query heads, 8 key/value heads,
D = 64, bf16) over a contiguous KV cache, now on grouped rows with split-KV (the sink per row,
the merge adding it), against the route it took before (one query head per CTA, no split:
kvcache.step_route patched) and flash-attn-4's flash_attn_func with learnable_sink on the same
keys, in the same run (CUDA events, L2 flushed, interleaved rounds, medians).

    python perf/experiments/sink_decode.py [--rounds 5] [--no-sink]

--no-sink: the same steps without sinks, "before" being the packed route without split
(num_splits=1), which auto routing took at every batch before kvcache.PACKED_STEP_MIN_UNITS.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from cute_flash import kvcache  # noqa: E402
from peers import interleaved_medians, runnable_steps  # noqa: E402


def old_route(q_shape, kv_heads, cache_len, window_size, sink, num_splits, device, captured):
    """The route before sinks took grouped rows: neither decode nor grouped with a sink."""
    return kvcache.StepRoute(False, False, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-sink", action="store_true")
    args = parser.parse_args()
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception:
        fa4 = None
    heads, kv_heads, head_dim = 64, 8, 64
    print("| B | cache | cute_flash (grouped rows, split) ms | before (per head) ms | flash-attn-4 ms | K/V GB/s |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8, 64):
        for cache in (4096, 32768):
            q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            k_cache, v_cache = (torch.randn(batch, cache, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
                                for _ in range(2))
            sink = None if args.no_sink else torch.randn(heads, device="cuda")
            lengths = torch.full((batch,), cache, dtype=torch.int32, device="cuda")

            def ours():
                return cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                          learnable_sink=sink)

            def before():  # num_splits=1: a plan signature of its own, made under the old route
                return cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                                          learnable_sink=sink, num_splits=1)

            if sink is not None:
                route, kvcache.step_route = kvcache.step_route, old_route
                try:
                    before()  # records the eager plan with the old route
                finally:
                    kvcache.step_route = route

            steps = {"ours": ours, "before": before}
            if fa4 is not None:
                steps["fa4"] = lambda: fa4(q, k_cache, v_cache, causal=True, learnable_sink=sink)
            want = before()
            got = ours()
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            with torch.no_grad():
                medians = interleaved_medians(runnable_steps(steps, f"B={batch} cache={cache}"), args.rounds, 10)
            gbs = 2 * batch * kv_heads * cache * head_dim * 2 / medians["ours"] / 1e6
            print(f"| {batch} | {cache} | {medians['ours']:.4f} | {medians['before']:.4f} | "
                  f"{medians.get('fa4', float('nan')):.4f} | {gbs:.0f} (ours vs before rel. diff {err:.1e}) |",
                  flush=True)


if __name__ == "__main__":
    main()
