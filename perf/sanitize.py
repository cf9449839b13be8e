"""The workload compute-sanitizer runs (GPU): forward and backward on small shapes that cover
sequence tails, both causal modes and both head dims. Exits non-zero on a wrong result.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python perf/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python perf/sanitize.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python perf/sanitize.py
"""

import math
import sys

import torch

import cute_flash
from cute_flash.benchmarking import reference_fp32


def main():
    failures = 0
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen_q, seqlen_k in ((17, 17), (1000, 1000), (17, 1000), (1000, 17)):
                q = torch.randn(1, 2, seqlen_q, head_dim, device="cuda", dtype=torch.float16, requires_grad=True)
                k, v = (torch.randn(1, 2, seqlen_k, head_dim, device="cuda", dtype=torch.float16,
                                    requires_grad=True) for _ in range(2))
                out = cute_flash.flash_attention(q, k, v, causal=causal)
                out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
                ref, _ = reference_fp32(q.detach(), k.detach(), v.detach(), causal, 1 / math.sqrt(head_dim))
                err = ((out.detach().float() - ref).norm() / ref.norm()).item()
                finite = all(torch.isfinite(t.grad).all() for t in (q, k, v))
                ok = err < 2e-3 and finite
                failures += not ok
                print(f"D={head_dim} causal={causal} Sq={seqlen_q} Sk={seqlen_k}: err={err:.1e} "
                      f"grads finite={finite} {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
