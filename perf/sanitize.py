"""The workload compute-sanitizer runs (GPU): forward and backward on small shapes that cover
sequence tails, both causal modes and both head dims; the backward both through the fused dQ
accumulation and through the separate dQ kernel (the long-sequence path, forced on here);
packed batches (cute_flash.varlen) with empty and short sequences, and with offsets that
break the contract (decreasing, negative, past the totals: wrong rows allowed, accesses
outside the tensors not); KV-cache appends and attention (cute_flash.kvcache) with slots and
entries inside and outside the cache. Exits non-zero on a wrong result. `--only varlen` /
`--only kvcache` runs those cases alone; `--only wide` the head dims above 128 (192: the
backward's transposed grads on 96-key blocks; 256: its split head dim), dense and packed.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python perf/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python perf/sanitize.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python perf/sanitize.py
"""

import math
import sys

import torch

import cute_flash
from cute_flash.benchmarking import reference_fp32


def _separate_dq_grads(q, k, v, out, dout, causal):
    """dq, dk, dv for the upstream gradient dout through the separate dQ kernel (dK/dV-only
    main kernel + dQ kernel)."""
    import dataclasses

    from cute_flash import launch_bwd
    from cute_flash.config import get_config
    from cute_flash.kernels.problem import AttentionProblem

    head_dim = q.shape[-1]
    scale = 1 / math.sqrt(head_dim)
    q, k, v, out = (t.detach() for t in (q, k, v, out))
    _, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    config = get_config("float16", head_dim, causal, "bwd", q.device)
    dq_config = dataclasses.replace(get_config("float16", head_dim, causal, "bwd_dq", q.device), min_seqlen_q=1)
    grads = launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale, config=config,
                                            dq_config=dq_config)
    torch.cuda.synchronize()
    return grads


def packed_cases(head_dims=(64, 128)):
    """Failures among the packed-batch cases."""
    from cute_flash.reference import packed_attention_reference

    failures = 0
    lens_q, lens_k = [17, 0, 300, 1, 129], [40, 5, 300, 0, 129]
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
                  for lens in (lens_q, lens_k))
    for head_dim in head_dims:
        q = torch.randn(sum(lens_q), 4, head_dim, device="cuda", dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(sum(lens_k), 2, head_dim, device="cuda", dtype=torch.float16, requires_grad=True)
                for _ in range(2))
        out = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                alignment="bottom_right")
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        ref, _ = packed_attention_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, dtype=torch.float32,
                                            causal=True, alignment="bottom_right")
        err = ((out.detach().float() - ref).norm() / ref.norm()).item()
        finite = all(torch.isfinite(t.grad).all() for t in (q, k, v))
        ok = err < 2e-3 and finite
        failures += not ok
        print(f"packed D={head_dim}: err={err:.1e} grads finite={finite} {'ok' if ok else 'FAIL'}", flush=True)
        for bad in ([0, 30, 10, 400, 2000, 447], [-50, 0, 300, 200, 9000, 447]):
            bad_t = torch.tensor(bad, dtype=torch.int32, device="cuda")
            out = cute_flash.flash_attention_varlen(q, k, v, bad_t, bad_t.flip(0).contiguous(), 300, 300)
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            print(f"packed D={head_dim} offsets {bad}: no fault ok", flush=True)
    return failures


def kvcache_cases():
    """Failures among the KV-cache cases, fp16 and float32 (kvcache._float32_step)."""
    return sum(kvcache_dtype_cases(dtype) for dtype in (torch.float16, torch.float32))


def kvcache_dtype_cases(dtype):
    """Failures among the KV-cache cases of one dtype: appends and attention with in-range
    slots, then with slots, lengths and cache entries outside the cache (nothing may be
    written or read outside it); the free slots hold NaN (never read into a result)."""
    failures = 0
    q = torch.randn(4, 2, 8, 64, device="cuda", dtype=dtype)
    k_cache, v_cache = (torch.randn(3, 100, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(4, 2, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    cases = (([5, 0, 47, 40], [0, 1, 2, 1]),  # in range (the last two share an entry, apart)
             ([99, -7, 5000, 50], [0, 2, 1, -3]),  # overflowing, negative, far past the cache
             ([10, 20, 30, 40], [3, 900, -1, 2]))  # entries outside the cache
    for number, (lengths, entries) in enumerate(cases):
        # The in-range case's free slots hold NaN (never read into its results); the others
        # read past 70 by their (broken) lengths.
        for cache in (k_cache, v_cache):
            cache[:, 70:] = float("nan") if number == 0 else torch.randn_like(cache[:, 70:])
        seqlens, index = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (lengths, entries))
        out = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                 cache_batch_idx=index, causal=True)
        # A decode step in more parts than some sequences have key blocks (parts without keys).
        split = cute_flash.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=seqlens,
                                                   cache_batch_idx=index, num_splits=7)
        # Two positions of a group of 4 as one tile's rows (grouped rows), causal, in 3 parts.
        grouped = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=index,
                                                     causal=True, num_splits=3)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(out).all() and torch.isfinite(split).all() and torch.isfinite(grouped).all())
        failures += not finite
        print(f"kvcache {dtype} lengths {lengths} entries {entries}: finite={finite} {'ok' if finite else 'FAIL'}",
              flush=True)
    # Paged: pages of 16 rows (several per key block), tables with page numbers outside the
    # cache and lengths past a sequence's pages; a split decode step over them.
    k_pages, v_pages = (torch.randn(12, 16, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    tables = ([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], [[0, 99, -4], [3, 4, 5], [1 << 30, 7, 8], [9, 10, 11]])
    for table, lengths in zip(tables, ([5, 0, 40, 46], [20, -3, 47, 1000])):
        seqlens, pages = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (lengths, table))
        out = cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens, block_table=pages,
                                                 causal=True)
        split = cute_flash.flash_attn_with_kvcache(q[:, :1], k_pages, v_pages, cache_seqlens=seqlens.clamp(0, 48),
                                                   block_table=pages, num_splits=2)
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(out).all() and torch.isfinite(split).all())
        failures += not finite
        print(f"paged kvcache {dtype} lengths {lengths} table {table}: finite={finite} {'ok' if finite else 'FAIL'}",
              flush=True)
    return failures


def dense_cases(head_dims, dtypes=(torch.float16,)):
    """Failures among the dense forward + backward cases (tails, Sq != Sk both ways)."""
    failures = 0
    for dtype in dtypes:
        for head_dim in head_dims:
            for causal in (False, True):
                for seqlen_q, seqlen_k in ((17, 17), (1000, 1000), (17, 1000), (1000, 17)):
                    q = torch.randn(1, 2, seqlen_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                    k, v = (torch.randn(1, 2, seqlen_k, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                            for _ in range(2))
                    out = cute_flash.flash_attention(q, k, v, causal=causal)
                    out.backward(torch.randn_like(out))
                    torch.cuda.synchronize()
                    ref, _ = reference_fp32(q.detach(), k.detach(), v.detach(), causal, 1 / math.sqrt(head_dim))
                    err = ((out.detach().float() - ref).norm() / ref.norm()).item()
                    finite = all(torch.isfinite(t.grad).all() for t in (q, k, v))
                    ok = err < (2e-3 if dtype == torch.float16 else 1e-2) and finite
                    failures += not ok
                    print(f"{dtype} D={head_dim} causal={causal} Sq={seqlen_q} Sk={seqlen_k}: err={err:.1e} "
                          f"grads finite={finite} {'ok' if ok else 'FAIL'}", flush=True)
    return failures


def main():
    if "--only" in sys.argv and "varlen" in sys.argv:
        return 1 if packed_cases() else 0
    if "--only" in sys.argv and "wide" in sys.argv:
        failures = dense_cases((192, 256), (torch.float16, torch.bfloat16)) + packed_cases((192,))
        return 1 if failures else 0
    if "--only" in sys.argv and "kvcache" in sys.argv:
        return 1 if kvcache_cases() else 0
    failures = packed_cases() + kvcache_cases()
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen_q, seqlen_k in ((17, 17), (1000, 1000), (17, 1000), (1000, 17)):
                q = torch.randn(1, 2, seqlen_q, head_dim, device="cuda", dtype=torch.float16, requires_grad=True)
                k, v = (torch.randn(1, 2, seqlen_k, head_dim, device="cuda", dtype=torch.float16,
                                    requires_grad=True) for _ in range(2))
                out = cute_flash.flash_attention(q, k, v, causal=causal)
                dout = torch.randn_like(out)
                out.backward(dout)
                torch.cuda.synchronize()
                ref, _ = reference_fp32(q.detach(), k.detach(), v.detach(), causal, 1 / math.sqrt(head_dim))
                err = ((out.detach().float() - ref).norm() / ref.norm()).item()
                finite = all(torch.isfinite(t.grad).all() for t in (q, k, v))
                separate = _separate_dq_grads(q, k, v, out, dout, causal)
                gap = max(((a.float() - t.grad.float()).norm() / t.grad.float().norm().clamp_min(1e-30)).item()
                          for a, t in zip(separate, (q, k, v)))
                ok = err < 2e-3 and finite and gap < 2e-2
                failures += not ok
                print(f"D={head_dim} causal={causal} Sq={seqlen_q} Sk={seqlen_k}: err={err:.1e} "
                      f"grads finite={finite} separate-dQ path vs fused {gap:.1e} {'ok' if ok else 'FAIL'}",
                      flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
