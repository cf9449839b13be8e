"""Tiles of the scaled-halves backward ("float32x3h") at one head dim and mask: each candidate
(dK / dV tile, dQ tile) compiled in parallel worker processes, checked against float64 on a
small problem, then the backward alone (launch_bwd.backward_with_config after one forward)
timed in rotated rounds against the first candidate.

    python perf/experiments/halves_bwd_tiles.py 128 "m16n64s1w1/dq:m128n32s2" "m32n64s1w1/dq:m128n64s1" \
        [--seqlen 8192] [--rounds 5] [--full]

Specs as perf/experiments/halves_bwd_compile.py's (without the head dim).
"""

import argparse
import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.launch_bwd import backward_with_config  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from halves_bwd_compile import parse  # noqa: E402

def compile_one(spec, causal):
    from cute_flash import compile_bwd

    head_dim, config, dq_config = parse(spec)
    compile_bwd.get_backward("float32x3h", head_dim, AttentionProblem(causal=causal), config, "sm_90a", dq_config,
                             True, head_dim)
    return spec


def gradients(spec, q, k, v, dout, causal):
    head_dim, config, dq_config = parse(spec)
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    return backward_with_config(q, k, v, out, dout, lse, AttentionProblem(causal=causal), 1 / math.sqrt(head_dim),
                                config, dq_config=dq_config, tile_head_dim=head_dim)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("head_dim", type=int)
    parser.add_argument("tiles", nargs="+")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    args = parser.parse_args()
    causal = not args.full
    torch.set_float32_matmul_precision("highest")
    specs = [f"{args.head_dim}:{t}" for t in args.tiles]
    with ProcessPoolExecutor(len(specs), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_one, specs, [causal] * len(specs)))
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 1000, args.head_dim, device="cuda") for _ in range(4))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*leaves, causal=causal)[0], leaves, dout.double())
    for spec in specs:
        got = gradients(spec, q, k, v, dout, causal)
        errs = [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want)]
        print(f"check {spec}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}", flush=True)
        assert max(errs) < 1e-5, spec
    q, k, v, dout = (torch.randn(1, 16, args.seqlen, args.head_dim, device="cuda") for _ in range(4))
    out, lse = cute_flash.flash_attention(q, k, v, causal=causal, return_lse=True)
    problem = AttentionProblem(causal=causal)

    def side(spec):
        head_dim, config, dq_config = parse(spec)
        return lambda: backward_with_config(q, k, v, out, dout, lse, problem, 1 / math.sqrt(head_dim), config,
                                            dq_config=dq_config, tile_head_dim=head_dim)

    rows = rotated_rounds({spec.split(":", 1)[1]: side(spec) for spec in specs}, args.rounds, 1.0)
    print(f"\nbackward (1, 16, {args.seqlen}, {args.head_dim}) causal={int(causal)}, float32x3h tiles")
    first = args.tiles[0]
    for line in round_table(rows, lambda name: (name, first), width=26):
        print(line, flush=True)


if __name__ == "__main__":
    main()
