"""The float32 forward at float32 accuracy above D = 128: the scaled halves' (256, 128) pair run
once per 128-column chunk of V and O (cute_flash.float32.value_chunks), against TF32 ("high")
and SDPA's efficient backend, same run.

Each candidate config of the pair is compiled in parallel worker processes and checked against
float64 on (1, 2, 1000, D); then (1, 16, S, D) runs in rotated rounds: the public call at
"highest" (operand pass and both chunks' launches), each candidate's chunk launches alone on the
same operands, the public call at "high" and SDPA efficient.

    python perf/experiments/float32_wide_fwd.py [--dim 256] [--seqlen 8192] [--rounds 5] [--full]
        [--configs m128n64s1w2,m64n64s1w1,m128n32s2w2]
"""

import argparse
import math
import multiprocessing
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash import float32  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.config import TileConfig  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.launch_fwd import ValueChunks  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402

TILE, CHUNK = 256, float32.VALUE_CHUNK


def parse(spec):
    m, n, s, w = (int(x) for x in re.fullmatch(r"m(\d+)n(\d+)s(\d+)w(\d+)", spec).groups())
    return TileConfig(block_m=m, block_n=n, num_stages=s, num_mma_warpgroups=w, pingpong=False,
                      rescale_before_pv=False)


def compile_one(spec, head_dim, causal):
    from cute_flash import compile_fwd

    for _, columns in float32.value_chunks(float32.SCALED_HALVES, head_dim):
        compile_fwd.get_forward(float32.SCALED_HALVES, head_dim, AttentionProblem.of(causal), parse(spec), "sm_90a",
                                TILE, columns, CHUNK)
    return spec


def chunk_launches(spec, head_dim, causal):
    from cute_flash import compile_fwd

    return ValueChunks(tuple(
        (first, columns, compile_fwd.get_forward(float32.SCALED_HALVES, head_dim, AttentionProblem.of(causal),
                                                 parse(spec), "sm_90a", TILE, columns, CHUNK))
        for first, columns in float32.value_chunks(float32.SCALED_HALVES, head_dim)))


def run_chunks(kernel, operands, out, lse, head_dim):
    q, k, v, scales = operands
    kernel(q, k, v, out, lse, None, *DENSE_BATCH[:4], scales,
           1 / math.sqrt(head_dim))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--configs", default="m128n64s1w2,m64n64s1w1,m128n32s2w2")
    args = parser.parse_args()
    causal = not args.full
    specs = args.configs.split(",")
    with ProcessPoolExecutor(len(specs), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_one, specs, [args.dim] * len(specs), [causal] * len(specs)))
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")
    q, k, v = (torch.randn(1, 2, 1000, args.dim, device="cuda") for _ in range(3))
    want = attention_reference(*(t.double() for t in (q, k, v)), causal=causal)[0]
    operands = float32.halves_operands(q, k, v, TILE)
    got = {"public": cute_flash.flash_attention(q, k, v, causal=causal)}
    for spec in specs:
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(q.shape[:3], device="cuda")
        got[spec] = run_chunks(chunk_launches(spec, args.dim, causal), operands, out, lse, args.dim)
    for name, o in got.items():
        print(f"check D={args.dim} causal={int(causal)} {name}: {((o.double() - want).norm() / want.norm()).item():.2e}",
              flush=True)

    q, k, v = (torch.randn(1, 16, args.seqlen, args.dim, device="cuda") for _ in range(3))
    operands = float32.halves_operands(q, k, v, TILE)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")

    def public(precision):
        def call():
            torch.set_float32_matmul_precision(precision)
            return cute_flash.flash_attention(q, k, v, causal=causal)
        return call

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    sides = {"highest": public("highest")}
    for spec in specs:
        kernel = chunk_launches(spec, args.dim, causal)
        sides[spec] = lambda kernel=kernel: run_chunks(kernel, operands, out, lse, args.dim)
    sides.update({"high (TF32)": public("high"), "efficient": efficient})
    rows = rotated_rounds(sides, args.rounds, 1.0)
    print(f"\nforward (1, 16, {args.seqlen}, {args.dim}) causal={int(causal)}, float32; ratio to SDPA efficient")
    for line in round_table(rows, lambda name: (name, "efficient"), width=14):
        print(line, flush=True)


if __name__ == "__main__":
    main()
