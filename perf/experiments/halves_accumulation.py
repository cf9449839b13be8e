"""Does the tensor cores' float32 accumulation lose bits over many key blocks on fp16 parts, as
it did on TF32 parts? (perf/NOTES.md, forty-fourth session, item 9.)

Every split kernel keeps each block's product in an accumulator of its own and adds it to O (or
dK, dV, dQ) in float32 on the CUDA cores, because accumulated by the tensor cores across 1000
keys 3xTF32's O lost bits (6e-6 relative). Those accumulators cost 64 registers at D = 128: they
are what spills the halves' dK / dV kernel there. This runs the forward with and without them
(FlashForwardSm90.pv_accumulator), on the scaled halves and on 3xTF32, against float64, at
growing key counts and with values of a large mean (O large beside each block's increment, where
a truncating accumulator shows most); then times the halves' kernels with and without.

    python perf/experiments/halves_accumulation.py [--keys 1000,8191,32768] [--rounds 5]
"""

import argparse
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash import compile_fwd  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.float32 import halves_operands, kernel_operands  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import no_sink, not_packed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from float32_halves_fwd import SPLIT_TF32_TILES, parse_config, reference  # noqa: E402

HEAD_DIM = 128


@contextmanager
def accumulator(kept: bool):
    """FlashForwardSm90 built with (the shipped way) or without its per-block P V accumulator."""
    from cute_flash.kernels import fwd_sm90

    init = fwd_sm90.FlashForwardSm90.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pv_accumulator = self.pv_accumulator and kept

    fwd_sm90.FlashForwardSm90.__init__ = patched
    try:
        yield
    finally:
        fwd_sm90.FlashForwardSm90.__init__ = init


def kernels(causal):
    """name -> call(q, k, v) -> (out, lse), and name -> kernel-only call on prepared operands."""
    problem = AttentionProblem(causal=causal)
    calls, kernel_only = {}, {}
    scale = 1 / math.sqrt(HEAD_DIM)
    for kept in (True, False):
        with accumulator(kept):
            halves = compile_fwd.compile_forward("float32x3h", HEAD_DIM, problem, parse_config("m128n64s2np"),
                                                 "sm_90a", HEAD_DIM)
            x3 = compile_fwd.compile_forward("float32x3", HEAD_DIM, problem,
                                             parse_config(SPLIT_TF32_TILES[HEAD_DIM]), "sm_90a", HEAD_DIM)
        tag = "acc" if kept else "noacc"

        def run_halves(ops, q, fn=halves):
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            fn(*ops[:3], out, lse, no_sink(q.device), *not_packed(q.device)[:4], ops[3], scale)
            return out, lse

        def run_x3(q, k, v, fn=x3):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            *ops, _ = kernel_operands("float32x3", q, k, v, HEAD_DIM)
            fn(*ops, out, lse, no_sink(q.device), *not_packed(q.device), scale)
            return out, lse

        calls[f"x3h-{tag}"] = (lambda f: lambda q, k, v: f(halves_operands(q, k, v, HEAD_DIM), q))(run_halves)
        calls[f"x3-{tag}"] = run_x3
        kernel_only[f"x3h-{tag}"] = run_halves
    return calls, kernel_only


def check(key_counts):
    """Full attention of 128 queries over Sk keys (the accumulation does not depend on masks)."""
    torch.manual_seed(0)
    names = ("x3h-acc", "x3h-noacc", "x3-acc", "x3-noacc")
    print("| Sk | V mean | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    calls, _ = kernels(False)
    for sk in key_counts:
        for v_mean in (0.0, 8.0):
            q = torch.randn(1, 4, 128, HEAD_DIM, device="cuda")
            k = torch.randn(1, 4, sk, HEAD_DIM, device="cuda")
            v = torch.randn(1, 4, sk, HEAD_DIM, device="cuda") + v_mean
            ref_o, _ = reference(q, k, v, False)
            errs = [((calls[name](q, k, v)[0].double() - ref_o).norm() / ref_o.norm()).item() for name in names]
            print(f"| {sk} | {v_mean:g} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)


def timed(rounds):
    for causal in (False, True):
        _, kernel_only = kernels(causal)
        torch.manual_seed(1)
        q, k, v = (torch.randn((1, 16, 8192, HEAD_DIM), device="cuda") for _ in range(3))
        ops = halves_operands(q, k, v, HEAD_DIM)
        sides = {name: (lambda f: lambda: f(ops, q))(f) for name, f in kernel_only.items()}
        rows = rotated_rounds(sides, rounds, 1.0)
        print(f"\n(1, 16, 8192, 128) causal={int(causal)}, kernels alone")
        for line in round_table(rows, lambda name: (name, "x3h-acc"), width=12):
            print(line)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", default="1000,8191,32768")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    check([int(s) for s in args.keys.split(",")])
    timed(args.rounds)


if __name__ == "__main__":
    main()
