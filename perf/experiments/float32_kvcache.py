"""float32 KV caches (cute_flash.kvcache._float32_step: the slots in use gathered, then the packed
float32 forward on the scaled halves) against SDPA's efficient backend (its only float32 GPU
kernel) on the same cache as (B, Nkv, S, D) views, a group's query heads as its rows (its
fused kernels take no GQA), with a boolean mask of the slots in use; and, on bf16, what zeroing a key block's stale V rows costs (kernels/fwd_sm90.py,
_zero_stale_values): the same decode step with every slot in use (no partial block) and with
one slot fewer (a partial last block: the zeroing runs), in the same rounds.

    python perf/experiments/float32_kvcache.py [--rounds 5]

Decode (Sq = 1) and a 16-token chunk, 32 query / 8 key-value heads, D = 128, B 1 and 8, caches
of 4k and 32k slots with 90 % in use, contiguous and as pages of 64 slots (in order). One
float64 check of each float32 side first.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from peers import interleaved_medians  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def float32_case(batch, cache_len, seqlen_q):
    f32 = dict(device="cuda", dtype=torch.float32)
    q = torch.randn(batch, seqlen_q, HEADS, HEAD_DIM, **f32)
    k_cache, v_cache = (torch.randn(batch, cache_len, KV_HEADS, HEAD_DIM, **f32) for _ in range(2))
    used = cache_len * 9 // 10
    seqlens = torch.full((batch,), used, dtype=torch.int32, device="cuda")
    slots = torch.arange(cache_len, device="cuda")
    # Bottom-right causal over the slots in use: query i sees slots < used - Sq + 1 + i.
    visible = slots.view(1, cache_len) <= (used - seqlen_q + torch.arange(seqlen_q, device="cuda")).view(-1, 1)
    group = HEADS // KV_HEADS
    # SDPA's fused kernels take no GQA: a group's query heads become its rows (the peer's best
    # layout, q copied inside the step), the mask repeated per head of the group.
    mask = visible.repeat(group, 1).view(1, 1, group * seqlen_q, cache_len)
    k_b, v_b = (t.transpose(1, 2) for t in (k_cache, v_cache))

    def grouped_q():
        return q.view(batch, seqlen_q, KV_HEADS, group, HEAD_DIM).permute(0, 2, 3, 1, 4).reshape(
            batch, KV_HEADS, group * seqlen_q, HEAD_DIM)

    def ungrouped(o):
        return o.view(batch, KV_HEADS, group, seqlen_q, HEAD_DIM).permute(0, 3, 1, 2, 4).reshape(
            batch, seqlen_q, HEADS, HEAD_DIM)

    # The same bytes as pages of 64 slots, listed in order (what reading through a table costs).
    k_pages, v_pages = (c.view(batch * cache_len // 64, 64, KV_HEADS, HEAD_DIM) for c in (k_cache, v_cache))
    table = torch.arange(batch * cache_len // 64, dtype=torch.int32, device="cuda").view(batch, -1)

    def ours():
        return cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)

    def ours_paged():
        return cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                                  causal=True)

    def sdpa():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return ungrouped(F.scaled_dot_product_attention(grouped_q(), k_b, v_b, attn_mask=mask))

    want = ungrouped(F.scaled_dot_product_attention(*(t.double() for t in (grouped_q(), k_b, v_b)), attn_mask=mask))
    errors = {name: ((fn().double() - want).norm() / want.norm()).item() for name, fn in
              (("ours", ours), ("ours_paged", ours_paged), ("sdpa_efficient", sdpa))}
    return {"ours": ours, "ours_paged": ours_paged, "sdpa_efficient": sdpa}, errors


def tail_case(batch, cache_len):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, **bf16)
    k_cache, v_cache = (torch.randn(batch, cache_len, KV_HEADS, HEAD_DIM, **bf16) for _ in range(2))
    full = torch.full((batch,), cache_len, dtype=torch.int32, device="cuda")
    tail = full - 1
    return {
        "bf16_whole_blocks": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full),
        "bf16_partial_block": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=tail),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.get_float32_matmul_precision())
    rows = []
    for batch in (1, 8):
        for cache_len in (4096, 32768):
            for seqlen_q in (1, 16):
                steps, errors = float32_case(batch, cache_len, seqlen_q)
                ms = interleaved_medians(steps, args.rounds, 10)
                rows.append(f"| float32 B={batch} cache={cache_len} Sq={seqlen_q} | {ms['ours']:.3f} | "
                            f"{ms['sdpa_efficient']:.3f} | {ms['sdpa_efficient'] / ms['ours']:.2f}x | "
                            f"{errors['ours']:.1e} / {errors['sdpa_efficient']:.1e} |")
                rows.append(f"| float32 paged (64) B={batch} cache={cache_len} Sq={seqlen_q} | {ms['ours_paged']:.3f} | "
                            f"{ms['sdpa_efficient']:.3f} | {ms['sdpa_efficient'] / ms['ours_paged']:.2f}x | "
                            f"{errors['ours_paged']:.1e} / {errors['sdpa_efficient']:.1e} |")
                print(rows[-1], flush=True)
            ms = interleaved_medians(tail_case(batch, cache_len), args.rounds, 20)
            rows.append(f"| bf16 tail B={batch} cache={cache_len} Sq=1 | {ms['bf16_partial_block']:.4f} | "
                        f"{ms['bf16_whole_blocks']:.4f} | {ms['bf16_whole_blocks'] / ms['bf16_partial_block']:.3f}x | |")
            print(rows[-1], flush=True)
    print("\n| case | ours ms (bf16: partial block) | peer ms (bf16: whole blocks) | peer / ours | rel. err ours / peer |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
