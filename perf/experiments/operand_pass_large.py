"""The float32 operand passes on large inputs (GPU machine): kernel_operands (the whole pass,
its maxima reduced in-kernel since the fifty-seventh session) beside three torch max-norms
(what the scaled halves took before, on top of their split) and the forward it feeds, ms per
call (benchmarking.time_ms, L2 flushed).

    python perf/experiments/operand_pass_large.py
"""

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

import cute_flash  # noqa: E402
from cute_flash import api, float32  # noqa: E402
from cute_flash.benchmarking import time_ms  # noqa: E402


def main():
    for shape in ((1, 16, 65536, 128), (1, 16, 16384, 256), (4, 32, 4096, 64), (1, 16, 65536, 16)):
        q, k, v = (torch.randn(*shape, device="cuda") for _ in range(3))
        cute_flash.flash_attention(q, k, v, causal=True)
        plan = next(p for p in api._plans.values() if p.dtype == torch.float32 and p.lse_shape == shape[:3]
                    and p.value_head_dim == shape[3])
        name, tile = plan.float32_kernel
        passes = time_ms(lambda: float32.kernel_operands(name, q, k, v, tile), flush=True)
        norms = time_ms(lambda: [torch.linalg.vector_norm(t, ord=float("inf"), dim=(2, 3)) for t in (q, k, v)],
                        flush=True)
        forward = time_ms(lambda: cute_flash.flash_attention(q, k, v, causal=True), flush=True, iters=5)
        gbytes = 3 * q.numel() * 4 * 2 / 1e9  # read q, k, v; write halves (or rounded copies) of their size
        print(f"{str(shape):20s} {name:11s} operand pass {passes:7.3f} ms ({gbytes / passes:5.2f} TB/s of "
              f"read + write), torch max-norms x3 {norms:7.3f} ms, causal forward {forward:8.3f} ms", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
