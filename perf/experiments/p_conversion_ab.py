"""A/B of the forward's P conversion (one device call): the DSL's tensor conversion
(`tOrP.store(acc.load().to(dtype))`) against ptx.pack_half2 pairs (layouts.store_rounded),
same tile configs, compiled side by side, each checked against a float32 reference (outputs
poisoned, every element), then timed in interleaved rounds beside flash-attn-4 (L2 flushed).

    python perf/experiments/p_conversion_ab.py [--rounds 5] [--shape 4,32,8192]

SASS before the change (perf/NOTES.md, twenty-ninth session, item 4): for bf16 key blocks other
than 128 the DSL conversion's pairs were moved into the fragment's registers between the P V
WGMMAs and ptxas issued every one of them as its own group. The switch this script flips,
a module constant `P_CONVERSION_PACKED = True` in kernels/fwd_sm90.py choosing in `store_p`
between `store_rounded(tOrP, acc_as_operand_a(acc_s))` and the old
`tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))`, existed for this measurement only
(never committed): add it back to rerun.
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_flash.kernels.fwd_sm90 as fwd_sm90  # noqa: E402
from cute_flash.benchmarking import attention_flops  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import default_config_dir, load_config_file  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402
from fwd_variants import check  # noqa: E402
from peers import interleaved_medians, runnable_steps  # noqa: E402

CASES = [("bfloat16", 96), ("bfloat16", 128), ("bfloat16", 192), ("bfloat16", 256)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="4,32,8192")
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args()
    if not hasattr(fwd_sm90, "P_CONVERSION_PACKED"):
        sys.exit("fwd_sm90.P_CONVERSION_PACKED existed for this measurement only (see the module docstring to "
                 "add it back; perf/NOTES.md, twenty-ninth session, item 4)")
    b, n, s = (int(x) for x in args.shape.split(","))
    table = load_config_file(default_config_dir() / "h100.yaml")
    from flash_attn.cute import flash_attn_func as fa4
    rows = []
    for dtype_name, d in CASES:
        dtype = getattr(torch, dtype_name)
        for causal in [bool(int(c)) for c in args.causal.split(",")]:
            config = table.lookup(dtype_name, d, causal, "fwd")
            q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
            sink, packed, scale = None, DENSE_BATCH, 1 / math.sqrt(d)
            steps = runnable_steps({"fa4": lambda: fa4(qt, kt, vt, causal=causal)}, f"{dtype_name} {d}")
            for name, packed_p in (("dsl", False), ("packed", True)):
                fwd_sm90.P_CONVERSION_PACKED = packed_p
                fn = compile_forward(dtype_name, d, AttentionProblem.of(causal), config)
                ok, worst = check(fn, dtype, causal, print, d, d)
                print(f"{dtype_name} D={d} causal={causal} {name}: {'PASS' if ok else 'FAIL'} (worst {worst:.2e})")
                steps[name] = (lambda f=fn: f(q, k, v, out, lse, sink, *packed, scale))
            fwd_sm90.P_CONVERSION_PACKED = True
            ms = interleaved_medians(steps, args.rounds, 10)
            flops = attention_flops(b, n, s, s, d, causal)
            rows.append((dtype_name, d, causal, config, ms, flops))
            steps = None
            torch.cuda.empty_cache()
    print(f"\n(B, N, S) = ({b}, {n}, {s}); ms (TFLOP/s); ratios: dsl / packed (>1: packed faster), fa4 / packed")
    for dtype_name, d, causal, config, ms, flops in rows:
        print(f"{dtype_name:9s} D={d:3d} causal={causal!s:5s} n{config.block_n:3d} pp={config.pingpong!s:5s} "
              + " ".join(f"{k} {v:.3f} ({flops / v / 1e9:.0f})" for k, v in ms.items())
              + f"  dsl/packed {ms['dsl'] / ms['packed']:.3f}"
              + (f"  fa4/packed {ms['fa4'] / ms['packed']:.3f}" if "fa4" in ms else ""))


if __name__ == "__main__":
    sys.exit(main())
