"""float32 forward tiles: which (block_m, block_n, stages, pingpong) serves the TF32 ("float32")
and 3xTF32 ("float32x3") kernels best, the kernel alone (operands prepared once), beside SDPA's
efficient backend on the same float32 inputs (GPU script; the tuner handles 16-bit dtypes
only), and the operand pass that prepares them (kernels/tf32_operands.py) in GB/s.

    python perf/experiments/float32_tiles.py [--seqlen 8192] [--heads 16] [--operands-only]

Batch 1, causal and not; every candidate checked against the float64 reference first (a wrong
one is reported, not timed). Prints ms and TFLOP/s per candidate.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash import compile_fwd  # noqa: E402
from cute_flash.benchmarking import attention_flops, time_ms  # noqa: E402
from cute_flash.config import TileConfig  # noqa: E402
from cute_flash.float32 import kernel_operands  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402

# (dtype name, head dim) -> candidate (block_m, block_n, num_stages, pingpong); the shipped entry first.
CANDIDATES = {
    ("float32x3", 128): [(128, 32, 1, True), (128, 48, 1, True), (128, 32, 1, False), (128, 16, 2, True),
                         (128, 16, 3, True)],
    ("float32x3", 64): [(128, 64, 2, True), (128, 32, 3, True), (128, 64, 2, False)],
    ("float32", 128): [(128, 64, 2, True), (128, 32, 3, True), (128, 64, 2, False), (128, 128, 1, True)],
    ("float32", 64): [(128, 128, 2, True), (128, 64, 3, True), (192, 64, 2, True)],
    ("float32", 16): [(128, 128, 2, True)],
    ("float32", 32): [(128, 128, 2, True)],
    ("float32", 192): [(128, 32, 2, True), (128, 64, 1, True)],
    ("float32", 256): [(128, 32, 1, True)],
    ("float32x3", 16): [(128, 128, 2, True), (128, 64, 2, True)],
    ("float32x3", 32): [(128, 64, 2, True), (128, 64, 3, True)],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--only", default=None, help="a dtype name to restrict to")
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims to restrict to")
    parser.add_argument("--operands-only", action="store_true", help="time the operand pass only")
    parser.add_argument("--candidates", type=int, default=None, help="time the first N candidates only")
    args = parser.parse_args()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}a"
    for (name, head_dim), candidates in CANDIDATES.items():
        if (args.only and name != args.only) or (args.head_dims and str(head_dim) not in args.head_dims.split(",")):
            continue
        shape = (1, args.heads, args.seqlen, head_dim)
        q, k, v = (torch.randn(shape, device="cuda") for _ in range(3))
        scale = head_dim ** -0.5
        operands = kernel_operands(name, q, k, v, head_dim)
        # The operand pass alone (kernels/tf32_operands.py), as bytes moved per second.
        pass_ms = time_ms(lambda: kernel_operands(name, q, k, v, head_dim), flush=True)
        moved = 3 * q.nbytes + sum(t.nbytes for t in operands)
        copy_ms = time_ms(lambda: q.clone(), flush=True)  # the copy bandwidth of the same run
        print(f"{name} D={head_dim}: operand pass {pass_ms:.3f} ms, {moved / pass_ms / 1e6:.0f} GB/s "
              f"(q.clone(): {2 * q.nbytes / copy_ms / 1e6:.0f} GB/s)", flush=True)
        if args.operands_only:
            continue
        small = [t[:, :2, :1000] for t in (q, k, v)]
        small_operands = kernel_operands(name, *small, head_dim)
        for causal in (True, False):
            problem = AttentionProblem.of(causal)
            flops = attention_flops(*shape[:3], args.seqlen, head_dim, causal)
            with torch.no_grad():
                peer = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flush=True)
            print(f"{name} D={head_dim} causal={causal}: SDPA (math precision {torch.get_float32_matmul_precision()}) "
                  f"{peer:.3f} ms", flush=True)
            ref = attention_reference(*small, causal=causal, dtype=torch.float64)[0]
            for bm, bn, stages, pingpong in candidates[:args.candidates]:
                config = TileConfig(bm, bn, stages, bm // 64, pingpong)
                label = f"  {bm}x{bn} stages={stages} pingpong={int(pingpong)}"
                try:
                    kernel = compile_fwd.get_forward(name, head_dim, problem, config, arch, head_dim)
                except Exception as exc:  # a candidate that does not build (shared memory, rules)
                    print(f"{label}: not built ({str(exc).splitlines()[0][:80]})")
                    continue
                out = torch.full_like(small[0], float("nan"))
                lse = torch.empty(out.shape[:3], device="cuda")
                kernel(*small_operands, out, lse, None, *DENSE_BATCH, scale)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                out = torch.empty_like(q)
                lse = torch.empty(shape[:3], device="cuda")
                ms = time_ms(lambda: kernel(*operands, out, lse, None, *DENSE_BATCH, scale),
                             flush=True)
                print(f"{label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {peer / ms:.2f}x SDPA, "
                      f"rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
