"""One-off: what the packed forward costs beside the dense one on the same equal-length batch,
and where flash-attn-4 stands on both (same run, interleaved rounds, median).

    python perf/experiments/varlen_overhead.py
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import time_ms  # noqa: E402

HEADS, D = 32, 128


def cases(batch, seqlen):
    total = batch * seqlen
    q, k, v = (torch.randn(total, HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device="cuda")
    dense = [t.view(batch, seqlen, HEADS, D).transpose(1, 2) for t in (q, k, v)]
    impls = {
        "ours_packed": lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, seqlen, seqlen, causal=True),
        "ours_dense": lambda: cute_flash.flash_attention(*dense, causal=True),
    }
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        impls["fa4_packed"] = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                             max_seqlen_q=seqlen, max_seqlen_k=seqlen, causal=True)
        bsnd = [t.view(batch, seqlen, HEADS, D) for t in (q, k, v)]
        impls["fa4_dense"] = lambda: flash_attn_func(*bsnd, causal=True)
    except Exception as exc:
        print("no flash-attn-4:", exc)
    return impls


def main():
    rows = []
    for batch, seqlen in ((8, 8192), (64, 1024), (256, 256)):
        impls = cases(batch, seqlen)
        samples = {name: [] for name in impls}
        with torch.no_grad():
            for fn in impls.values():
                fn()
            for _ in range(7):
                for name, fn in impls.items():
                    samples[name].append(time_ms(fn, warmup=2, iters=5, flush=True))
        med = {name: statistics.median(s) for name, s in samples.items()}
        for name, ms in med.items():
            rows.append(f"{batch}x{seqlen} {name:12s} {ms:8.4f} ms  {ms / med['ours_dense']:.3f}x ours_dense")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
