"""One-off: where a flash_attn_with_kvcache decode step's time goes (B = 1, 4k cache, 32/8
heads, D = 128, bf16): per-call wall time with and without an append, then the CUDA kernels
of ten calls under torch.profiler (GPU script)."""

import time

import torch

import cute_flash

q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k, v = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
seqlens = torch.full((1,), 4000, dtype=torch.int32, device="cuda")
with torch.no_grad():
    for label, new in (("append", (k, v)), ("no append", (None, None))):
        for _ in range(20):
            cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=seqlens)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=seqlens)
        torch.cuda.synchronize()
        print(f"{label}: {(time.perf_counter() - start) / 200 * 1e6:.1f} us per call")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
