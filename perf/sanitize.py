"""The workload compute-sanitizer runs (GPU): forward and backward on small shapes that cover
sequence tails, both causal modes and both head dims; the backward both through the fused dQ
accumulation and through the separate dQ kernel (the long-sequence path, forced on here);
packed batches (cute_flash.varlen) with empty and short sequences, and with offsets that
break the contract (decreasing, negative, past the totals: wrong rows allowed, accesses
outside the tensors not); KV-cache appends and attention (cute_flash.kvcache) with slots and
entries inside and outside the cache. Exits non-zero on a wrong result. `--only varlen` /
`--only kvcache` runs those cases alone; `--only wide` the head dims above 128 (192: the
backward's transposed grads on 96-key blocks; 256: its split head dim), dense and packed;
`--only tiles` the entries' tiles for large grids (three consumer warpgroups on 128, 112, 96 or
80 keys, clusters of query heads, a narrow band's one warpgroup) on small shapes, which the
host would otherwise give the two-warpgroup tile (config.grid_fitted), with every variant;
`--only float32` dense float32 calls at both matmul precisions (the operand passes).

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
    return failures + packed_group_rows_cases(head_dims)


def packed_group_rows_cases(head_dims):
    """A decode-like packed batch (at most 16 queries per sequence) with groups of 4 query heads
    as each tile's rows (launch_fwd.packed_kernel_problem): the forward against the reference, then
    offsets that break the contract."""
    from cute_flash.reference import packed_attention_reference

    failures = 0
    lens_q, lens_k = [1, 4, 0, 16, 1], [300, 17, 5, 1000, 0]
    cu_q, cu_k = (torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
                  for lens in (lens_q, lens_k))
    for head_dim in head_dims:
        q = torch.randn(sum(lens_q), 8, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lens_k), 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
        torch.cuda.synchronize()
        ref, _ = packed_attention_reference(q, k, v, cu_q, cu_k, dtype=torch.float32)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ok = err < 1e-2
        failures += not ok
        print(f"packed group rows D={head_dim}: err={err:.1e} {'ok' if ok else 'FAIL'}", flush=True)
        for bad in ([0, 3, 1, 400, 2, 22], [-50, 0, 30, 20, 9000, 22]):
            bad_t = torch.tensor(bad, dtype=torch.int32, device="cuda")
            cute_flash.flash_attention_varlen(q, k, v, bad_t, bad_t.flip(0).contiguous(), 16, 1000)
            torch.cuda.synchronize()
            print(f"packed group rows D={head_dim} offsets {bad}: no fault ok", flush=True)
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


# (name, dtype, head dim, entry's seqlen, (B, N, Nkv, Sq, Sk), flash_attention kwargs, the forward
# tile it must run: (consumer warpgroups, key block, query heads per cluster)): each runs the entry
# tuned at that seqlen (tile_cases). More than 128 query rows, so that rows_fitted keeps three
# warpgroups; tails in both lengths.
TILE_CASES = [
    ("192x128 D=64 full, O rescaled before P V", torch.float16, 64, 8192, (1, 2, 2, 300, 333), dict(), (3, 128, 1)),
    ("192x128 D=64 causal, O rescaled every block", torch.bfloat16, 64, 8192, (1, 2, 2, 333, 300),
     dict(causal=True), (3, 128, 1)),
    ("192x96 D=64 causal (S <= 2896)", torch.float16, 64, 1024, (2, 2, 1, 300, 300), dict(causal=True), (3, 96, 1)),
    ("192x112 D=96 full", torch.bfloat16, 96, 8192, (1, 2, 2, 200, 517), dict(), (3, 112, 1)),
    ("192x80 D=128 causal", torch.bfloat16, 128, 8192, (1, 2, 2, 300, 300), dict(causal=True), (3, 80, 1)),
    ("192x80 D=128 full", torch.float16, 128, 8192, (1, 2, 2, 129, 1000), dict(), (3, 80, 1)),
    ("192x80 D=128 GQA window softcap sink bottom-right", torch.bfloat16, 128, 8192, (1, 4, 2, 300, 401),
     dict(causal=True, window_size=(100, 0), alignment="bottom_right", softcap=10.0, sink=True), (3, 80, 1)),
    # (Not causal: a causal group runs as one tile's rows, problem.row_heads, which takes no clusters.)
    ("128x128 D=128 clusters of two query heads", torch.bfloat16, 128, 4096, (1, 4, 2, 300, 300), dict(),
     (2, 128, 2)),
    ("one warpgroup, D=64 narrow band", torch.bfloat16, 64, 8192, (1, 2, 2, 300, 300),
     dict(causal=True, window_size=(63, 0)), (1, 128, 1)),
]


def tile_cases():
    """Failures among TILE_CASES: forward against float64 and finite gradients, every call on
    its entry's tile (benchmarking.entry_tiles_on_every_grid, the entry's seqlen forced,
    clusters of query heads on any grid)."""
    from cute_flash import config, launch_fwd
    from cute_flash.benchmarking import entry_tiles_on_every_grid
    from cute_flash.reference import attention_reference

    failures = 0
    get_config, cluster_min_waves = launch_fwd.get_config, config.CLUSTER_MIN_WAVES
    config.CLUSTER_MIN_WAVES = 0
    try:
        for name, dtype, head_dim, seqlen, (b, n, n_kv, sq, sk), kwargs, want_tile in TILE_CASES:
            kwargs = dict(kwargs)
            launch_fwd.get_config = lambda *a, seqlens=None, **kw: get_config(*a, seqlens=(seqlen, seqlen), **kw)
            sink = torch.randn(n, device="cuda", dtype=torch.float32) if kwargs.pop("sink", False) else None
            q = torch.randn(b, n, sq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, n_kv, sk, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                    for _ in range(2))
            with entry_tiles_on_every_grid() as compiled:  # (plans afresh for each case)
                out = cute_flash.flash_attention(q, k, v, sink=sink, **kwargs)
                out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), sink=sink, **kwargs)
            err = ((out.detach().double() - ref).norm() / ref.norm()).item()
            finite = all(torch.isfinite(t.grad).all() for t in (q, k, v))
            tile = (compiled[-1].num_mma_warpgroups, compiled[-1].block_n, compiled[-1].cluster_heads)
            ok = err < (2e-3 if dtype == torch.float16 else 1e-2) and finite and tile == want_tile
            failures += not ok
            print(f"{name}: tile {tile} (want {want_tile}) err={err:.1e} grads finite={finite} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    finally:
        launch_fwd.get_config, config.CLUSTER_MIN_WAVES = get_config, cluster_min_waves
    return failures


def float32_cases():
    """Failures among dense float32 cases at both matmul precisions: the operand passes (one
    launch each: the scaled halves' reduction and split, TF32 / 3xTF32 rounding and transposes;
    kernels/flat_grid.py) before every forward and backward, head dims narrower than their tile
    (8, 24) and value chunks (256) among them."""
    failures = 0
    previous = torch.get_float32_matmul_precision()
    try:
        for precision, head_dims in (("highest", (8, 24, 128, 256)), ("high", (64,))):
            torch.set_float32_matmul_precision(precision)
            failures += dense_cases(head_dims, (torch.float32,))
    finally:
        torch.set_float32_matmul_precision(previous)
    return failures


def main():
    if "--only" in sys.argv and "float32" in sys.argv:
        return 1 if float32_cases() else 0
    if "--only" in sys.argv and "tiles" in sys.argv:
        return 1 if tile_cases() else 0
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
