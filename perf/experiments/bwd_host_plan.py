"""Same-run A/B of the backward's host path: launch_bwd before the plan cache (c1489cd's
module, which the run reads from perf/experiments/_launch_bwd_before_plans.py: make it first
with `git show c1489cd:cute_flash/launch_bwd.py > perf/experiments/_launch_bwd_before_plans.py`,
the GPU machine has no git) against the current one,
alone and through autograd (launch_bwd.backward swapped in alternate rounds), plus two ways
to allocate the fp32 work buffers (five torch.empty against one buffer and views).

    python perf/experiments/bwd_host_plan.py [--rounds 7]
"""

import argparse
import importlib.util
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import launch_bwd  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from host_overhead import per_call_us  # noqa: E402

spec = importlib.util.spec_from_file_location("before", Path(__file__).with_name("_launch_bwd_before_plans.py"))
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args()
    results = {}
    for shape in ((1, 16, 1024, 16), (1, 16, 128, 64), (1, 1, 128, 128)):
        problem = AttentionProblem.of(True)
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        scale = 1 / math.sqrt(shape[-1])
        out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
        dout = torch.randn_like(out)
        qd, kd, vd, od, ld = (t.detach() for t in (q, k, v, out, lse))
        retained = cute_flash.flash_attention(q, k, v, causal=True)
        new_backward = launch_bwd.backward

        def through_autograd(impl):
            def call():
                launch_bwd.backward = impl
                torch.autograd.grad(retained, (q, k, v), dout, retain_graph=True)
            return call

        B, N, S, D = shape
        rows = (B, N, -(-S // 128) * 128)

        def five_empties():
            f = dict(dtype=torch.float32, device=q.device)
            return (torch.empty(rows, **f), torch.empty(rows, **f), torch.empty((*rows, D), **f),
                    torch.empty((B, N), dtype=torch.int32, device=q.device),
                    torch.empty((B, N), dtype=torch.int32, device=q.device))

        n = math.prod(rows)

        def one_buffer():
            buf = torch.empty(n * (D + 2) + 2 * B * N, dtype=torch.float32, device=q.device)
            a, b, c, d = buf.split_with_sizes((n * D, n, n, 2 * B * N))
            counts = d.view(torch.int32).view(2, B, N)
            return a.view(*rows, D), b.view(rows), c.view(rows), counts[0], counts[1]

        cases = {
            "launch before": lambda: before.backward(qd, kd, vd, od, dout, ld, problem, scale),
            "launch plans": lambda: new_backward(qd, kd, vd, od, dout, ld, problem, scale),
            "autograd before": through_autograd(before.backward),
            "autograd plans": through_autograd(new_backward),
            "cudnn autograd": None,
            "5 empties": five_empties,
            "1 buffer + views": one_buffer,
        }
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        cases["cudnn autograd"] = lambda: torch.autograd.grad(peer, (q, k, v), dout, retain_graph=True)
        for name, fn in cases.items():
            results[(shape, name)] = []
        for r in range(args.rounds):
            order = list(cases.items())
            if r % 2:
                order.reverse()
            for name, fn in order:
                results[(shape, name)].append(per_call_us(fn, args.iters))
        launch_bwd.backward = new_backward
    print(f"{'shape':22s} {'path':20s} {'median us':>10s} {'min':>8s} {'max':>8s}")
    for (shape, name), values in results.items():
        print(f"{str(shape):22s} {name:20s} {statistics.median(values):10.1f} {min(values):8.1f} {max(values):8.1f}")


if __name__ == "__main__":
    main()
