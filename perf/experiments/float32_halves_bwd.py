"""The float32 backward at float32 accuracy on scaled fp16 halves ("float32x3h") against the
3xTF32 one it replaces for MHA ("float32x3", as shipped before) and SDPA's efficient backend,
same run (cute_flash.float32.backward_dtype_name picks the halves; this forces 3xTF32 for its
side by patching that choice).

First every case is checked against float64 (relative Frobenius error of dq, dk, dv; odd shapes,
Sq != Sk both ways, inputs of a large and a small scale, head dims padded to the tile), beside
3xTF32 on the same data; then the backward alone (autograd.grad of a saved forward) of the
timed shapes runs in rotated rounds (benchmarking.rotated_rounds).

    python perf/experiments/float32_halves_bwd.py [--dims 64,128] [--seqlens 8192] [--rounds 5] [--skip-check]
"""

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash import float32, launch_bwd  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402


_SPLIT_PLANS = {}


@contextmanager
def split_tf32_backward():
    """The backward as shipped before the halves: 3xTF32 at every head dim (its plans in a
    cache of their own: the plan cache's key does not hold the choice)."""
    choose, plans = float32.backward_dtype_name, launch_bwd._plans
    float32.backward_dtype_name = lambda head_dim: (
        "float32x3" if choose(head_dim) == "float32x3h" else choose(head_dim))
    launch_bwd._plans = _SPLIT_PLANS
    try:
        yield
    finally:
        float32.backward_dtype_name = choose
        launch_bwd._plans = plans


def gradients(q, k, v, dout, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = cute_flash.flash_attention(*leaves, causal=causal)
    return torch.autograd.grad(out, leaves, dout)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(dims):
    torch.manual_seed(0)
    cases = [(1, 4, 1000, 1000, 1.0), (2, 4, 17, 1000, 1.0), (1, 4, 1000, 17, 1.0), (1, 2, 1, 8191, 1.0),
             (1, 2, 8191, 8191, 1.0), (1, 4, 2048, 2048, 30.0), (1, 4, 2048, 2048, 1e-6)]
    runs = [(d, cases) for d in dims] + [(d - 24, cases[:3]) for d in dims]
    worst = 0.0
    for head_dim, dim_cases in runs:
        for causal in (False, True):
            for b, n, sq, sk, scale in dim_cases:
                q = torch.randn(b, n, sq, head_dim, device="cuda") * scale
                k = torch.randn(b, n, sk, head_dim, device="cuda") * scale
                v = torch.randn(b, n, sk, head_dim, device="cuda") * scale
                dout = torch.randn(b, n, sq, head_dim, device="cuda")
                leaves = [t.double().requires_grad_() for t in (q, k, v)]
                want = torch.autograd.grad(attention_reference(*leaves, causal=causal, dtype=torch.float64)[0],
                                           leaves, dout.double())
                got = gradients(q, k, v, dout, causal)
                with split_tf32_backward():
                    x3 = gradients(q, k, v, dout, causal)
                errs = [rel(g, w) for g, w in zip(got, want)]
                x3_errs = [rel(g, w) for g, w in zip(x3, want)]
                worst = max(worst, *errs)
                print(f"check D={head_dim} causal={int(causal)} B={b} N={n} Sq={sq} Sk={sk} x{scale:g}: "
                      f"halves dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} | "
                      f"3xTF32 {x3_errs[0]:.2e} {x3_errs[1]:.2e} {x3_errs[2]:.2e}", flush=True)
    print(f"worst halves gradient error {worst:.2e}")


def timed(dims, seqlens, rounds, causal_modes=(True, False)):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for head_dim in dims:
        for seqlen in seqlens:
            for causal in causal_modes:
                torch.manual_seed(1)
                q, k, v = (torch.randn((1, 16, seqlen, head_dim), device="cuda", requires_grad=True)
                           for _ in range(3))
                dout = torch.randn((1, 16, seqlen, head_dim), device="cuda")
                out = cute_flash.flash_attention(q, k, v, causal=causal)
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    out_eff = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def halves():
                    return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                def split_tf32():
                    with split_tf32_backward():
                        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                def efficient():
                    return torch.autograd.grad(out_eff, (q, k, v), dout, retain_graph=True)

                sides = {"halves": halves, "3xTF32": split_tf32, "efficient": efficient}
                if head_dim > 128:  # (3xTF32 has no tile there: the halves' gradient chunks alone)
                    del sides["3xTF32"]
                rows = rotated_rounds(sides, rounds, 1.0)
                print(f"\nbackward (1, 16, {seqlen}, {head_dim}) causal={int(causal)}")
                for line in round_table(rows, lambda name: (name, "efficient"), width=10):
                    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--seqlens", default="8192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--causal", default="1,0", help="timed masks: 1 causal, 0 full")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    dims = [int(d) for d in args.dims.split(",")]
    if not args.skip_check:
        check(dims)
    timed(dims, [int(s) for s in args.seqlens.split(",")], args.rounds, [c == "1" for c in args.causal.split(",")])


if __name__ == "__main__":
    main()
