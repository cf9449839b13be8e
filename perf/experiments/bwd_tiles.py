"""Backward tile candidates for one head dim, checked and timed in paired rounds (GPU script).

    python perf/experiments/bwd_tiles.py --head-dim 96 --shape 4,32,8192 --causal 0,1 \
        --candidates '[{"name": "128 tile", "tile": 128},
                       {"name": "native", "tile": 96, "base": 128, "fields": {"num_stages_pds": 1}}]'

A candidate runs the backward of head dim D (launch_bwd.backward_with_config) on native tile
`tile` with the YAML bwd config of head dim `base` (default: tile) and `fields` replaced: so a
tile the YAML does not list yet can be tried before it is written there. A pair of head dims
(--head-dim 192:128: v, O and dO 128 wide) takes a candidate's `value_tile` (default: the
tile, square), whose YAML entry is the pair's (a square tile's where value_tile is absent):

    python perf/experiments/bwd_tiles.py --head-dim 192:128 --shape 4,32,8192 \
        --candidates '[{"name": "square 192", "tile": 192},
                       {"name": "pair (192, 128)", "tile": 192, "value_tile": 128},
                       {"name": "pair, dO 2 deep", "tile": 192, "value_tile": 128, "fields": {"num_stages_do": 2}}]'
 Each candidate is
first checked against float64 autograd on (1, 4, 1000, 900) in both dtypes (--check-dtypes) (max error over dq,
dk, dv relative to the largest reference element; 1e-2 fp16, 2e-2 bf16), then timed: per round
one backward of each candidate, the order rotating, back to back (CUDA events, L2 flushed);
medians and the per-round ratio to the first candidate. A table closes the log.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from cute_flash import launch_bwd  # noqa: E402
from cute_flash.benchmarking import time_one_call_ms  # noqa: E402
from cute_flash.config import get_config  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.launch_fwd import forward  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import TORCH_DTYPE_NAMES  # noqa: E402

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def candidate_config(cand, dtype, causal, seqlens):
    base = get_config(TORCH_DTYPE_NAMES[dtype], cand.get("base", cand["tile"]), causal, "bwd", torch.device("cuda"),
                      seqlens=seqlens, value_head_dim=cand.get("value_tile"))
    return dataclasses.replace(base, **cand.get("fields", {}))


def run(cand, q, k, v, out, dout, lse, causal, scale):
    # As launch_bwd derives it (no fused preprocess on a wider tile).
    config = launch_bwd.derived_config(candidate_config(cand, q.dtype, causal, (q.shape[2], k.shape[2])),
                                       TORCH_DTYPE_NAMES[q.dtype], AttentionProblem.of(causal), cand["tile"],
                                       q.shape[-1], False, v.shape[-1])
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    return launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                           config=config, grads=grads, tile_head_dim=cand["tile"],
                                           value_tile_head_dim=cand.get("value_tile"))


def inputs(b, n, sq, sk, dims, dtype, causal):
    d, dv = dims
    q = torch.randn(b, n, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, n, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, n, sk, dv, device="cuda", dtype=dtype)
    dout = torch.randn(b, n, sq, dv, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, AttentionProblem.of(causal), scale)
    return q, k, v, out, dout, lse, scale


def check(candidates, head_dim, causal_modes, dtypes):
    failures = 0
    for dtype in dtypes:
        for causal in causal_modes:
            torch.manual_seed(1)
            q, k, v, out, dout, lse, scale = inputs(1, 4, 1000, 900, head_dim, dtype, causal)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            o64, _ = attention_reference(*leaves, causal=causal, softmax_scale=scale)
            (o64 * dout.double()).sum().backward()
            for cand in candidates:
                got = run(cand, q, k, v, out, dout, lse, causal, scale)
                torch.cuda.synchronize()
                err = max(((g.double() - t.grad).abs().max() / t.grad.abs().max()).item() for g, t in zip(got, leaves))
                ok = err <= TOLERANCE[dtype] and all(torch.isfinite(g).all().item() for g in got)
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {cand['name']:24} {str(dtype)[6:]:9} causal={causal} err {err:.2e}",
                      flush=True)
    return failures


def speed(candidates, shape, head_dim, causal_modes, rounds, dtype):
    rows = []
    for causal in causal_modes:
        torch.manual_seed(0)
        q, k, v, out, dout, lse, scale = inputs(*shape[:2], shape[2], shape[2], head_dim, dtype, causal)
        calls = [lambda c=c: run(c, q, k, v, out, dout, lse, causal, scale) for c in candidates]
        for fn in calls:
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        samples = [[] for _ in calls]
        for r in range(rounds):
            for i in range(len(calls)):
                j = (i + r) % len(calls)
                samples[j].append(time_one_call_ms(calls[j]))
        for cand, xs in zip(candidates, samples):
            ratio = statistics.median(a / x for a, x in zip(samples[0], xs))
            rows.append((causal, cand["name"], statistics.median(xs), min(xs), ratio))
    dims = "x".join(str(d) for d in dict.fromkeys(head_dim))
    print(f"\nbackward alone, {shape[0]}x{shape[1]}x{shape[2]}x{dims} {str(dtype)[6:]}, {rounds} rounds")
    print("causal  candidate                 median ms    min ms   first/this")
    for causal, name, med, low, ratio in rows:
        print(f"{causal!s:7} {name:24} {med:10.3f} {low:9.3f} {ratio:10.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", required=True, help="D, or D:Dv (v's head dim of its own)")
    parser.add_argument("--candidates", required=True, help="JSON list (see the module docstring)")
    parser.add_argument("--shape", default="4,32,8192", help="B,N,S timed")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="float16", help="dtype timed")
    parser.add_argument("--check-dtypes", default="float16,bfloat16")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    candidates = json.loads(args.candidates)
    head_dim, _, value = args.head_dim.partition(":")
    dims = (int(head_dim), int(value or head_dim))
    causal_modes = [bool(int(c)) for c in args.causal.split(",")]
    dtypes = [getattr(torch, name) for name in args.check_dtypes.split(",")]
    failures = 0 if args.no_check else check(candidates, dims, causal_modes, dtypes)
    speed(candidates, [int(x) for x in args.shape.split(",")], dims, causal_modes, args.rounds,
          getattr(torch, args.dtype))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
