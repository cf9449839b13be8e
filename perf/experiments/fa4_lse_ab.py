"""flash-attn-4's forward with and without its LSE output, beside ours, in one run (GPU script).

flash-attn-4 compiles its forward without the LSE store when no input requires grad and
return_lse is False (interface.py: `lse = ... if requires_grad or return_lse else None`), so
perf/experiments/fwd_variants.py (no grad) times that kernel, while perf/variants.py (inputs
that require grad) times the one that writes the LSE, which training needs and which ours
always writes. This times both beside cute_flash.flash_attention (no grad, the same kernel as
with grad) on the same tensors.

    python perf/experiments/fa4_lse_ab.py [--shapes 4,32,8192,192,1;4,32,8192,128,1] [--rounds 5]
(shape: B,N,S,D,causal[,Dv])
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from peers import interleaved_medians, runnable_steps  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4,32,8192,192,1;4,32,8192,128,1")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func as fa4

    print(f"{'shape':24s} {'step':16s} {'ms':>8s} {'its ms / ours':>14s}")
    for spec in args.shapes.split(";"):
        b, n, s, d, causal, *rest = (int(x) for x in spec.split(","))
        dv = rest[0] if rest else d
        q, k = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, s, n, dv, device="cuda", dtype=torch.bfloat16)
        steps = {
            "cute_flash": lambda: cute_flash.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             causal=bool(causal)),
            "fa4_no_lse": lambda: fa4(q, k, v, causal=bool(causal)),
            "fa4_lse": lambda: fa4(q, k, v, causal=bool(causal), return_lse=True),
        }
        with torch.no_grad():
            steps = runnable_steps(steps, spec)
            times = interleaved_medians(steps, args.rounds, 5)
        for name, ms in times.items():
            print(f"{spec:24s} {name:16s} {ms:8.3f} {ms / times['cute_flash']:14.3f}")


if __name__ == "__main__":
    main()
