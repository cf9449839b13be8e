"""One-off (GPU machine): after `python -m cute_flash precompile`, a fresh process's first KV-cache
decode step and first prefill over a cache (contiguous, GQA 32/8, D = 128, bf16) load their
kernels from the disk cache: prints the compile count (0 expected) and the call times."""

import time

import torch

import cute_flash
from cute_flash import compile_cache

q1 = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
q16 = torch.randn(2, 16, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k1, v1 = (torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k16, v16 = (torch.randn(2, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
seqlens = torch.tensor([100, 3000], dtype=torch.int32, device="cuda")
with torch.no_grad():
    for label, args in (("prefill, 16 rows", (q16, k16, v16)), ("decode step", (q1, k1, v1))):
        start = time.perf_counter()
        cute_flash.flash_attn_with_kvcache(args[0], k_cache, v_cache, args[1], args[2], cache_seqlens=seqlens,
                                           causal=True)
        torch.cuda.synchronize()
        print(f"first {label}: {time.perf_counter() - start:.2f} s, kernels compiled so far: "
              f"{compile_cache.compile_count}")
