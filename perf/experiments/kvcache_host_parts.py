"""One-off: the host time of an eager decode step over a KV cache, part by part (B = 1,
4k cache, 32/8 heads, D = 128, bf16, no append): per-call wall time of each part called alone
in a loop of 300 (GPU script; parts that launch a kernel include its launch)."""

import time

import torch

import cute_flash
from cute_flash import kvcache, launch_fwd
from cute_flash.kernels.problem import AttentionProblem

q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k_cache, v_cache = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k, v = (torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
seqlens = torch.full((1,), 4000, dtype=torch.int32, device="cuda")
rows = q.reshape(1, 8, 4, 128).transpose(1, 2).reshape(4, 8, 128)
keys, values = (c.reshape(4096, 8, 128) for c in (k_cache, v_cache))
cu_q = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 4096], dtype=torch.int32, device="cuda")
problem = AttentionProblem.of(False, alignment="bottom_right", packed=True, keys_used=True)
kernel = launch_fwd.kernel_for(q.dtype, 128, problem, q.device, (4, 4096))
out4 = torch.empty(4, 8, 128, device="cuda", dtype=torch.bfloat16)
lse4 = torch.empty(8, 4, device="cuda", dtype=torch.float32)
q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (rows, keys, values))
o4 = out4.unsqueeze(0).transpose(1, 2)
sink = None
q_bnsd, k_bnsd, v_bnsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

parts = {
    "flash_attn_with_kvcache (decode step)": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                                         cache_seqlens=seqlens),
    "  with an append": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens),
    "flash_attention on (B, N, S, D) views": lambda: cute_flash.flash_attention(q_bnsd, k_bnsd, v_bnsd),
    "check_kvcache_call": lambda: kvcache.check_kvcache_call(q, k_cache, v_cache, None, None, seqlens, None, None, 0),
    "launch_fwd.kernel_for": lambda: launch_fwd.kernel_for(q.dtype, 128, problem, q.device, (4, 4096)),
    "launch_fwd.forward_packed": lambda: launch_fwd.forward_packed(rows, keys, values, cu_q, cu_k, seqlens, 4, 4096,
                                                                   problem, 0.088, None),
    "compiled kernel call alone": lambda: kernel(q4, k4, v4, o4, lse4.unsqueeze(0), sink, cu_q, cu_k, seqlens,
                                                 None, None, 0.088),
    "q rows copy (reshape of a transpose)": lambda: q.reshape(1, 8, 4, 128).transpose(1, 2).reshape(4, 8, 128),
    "one small torch op (seqlens + 1)": lambda: seqlens + 1,
    "empty (4, 8, 128)": lambda: torch.empty((4, 8, 128), dtype=q.dtype, device=q.device),
}
with torch.no_grad():
    for _ in range(2):
        for name, fn in parts.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(300):
                fn()
            torch.cuda.synchronize()
            print(f"{name:45s} {(time.perf_counter() - start) / 300 * 1e6:8.1f} us per call", flush=True)
        print()
