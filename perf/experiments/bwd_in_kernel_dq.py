"""A one-wave backward whose main kernel converts dQ (launch_bwd.BackwardPlan.converts_dq: each
head's last CTA, no postprocess launch) against the same kernels with the postprocess launched
(IN_KERNEL_DQ_BYTES 0), beside SDPA cuDNN's; bf16 causal, batch 1, 16 heads. Per case and path,
host us per call in a loop without synchronisation and us per call between CUDA events over a
loop (the GPU's rate, or the host's where that is slower), rotated rounds, medians: the
backward alone (torch.autograd.grad on a retained graph) and forward + backward.

    python perf/experiments/bwd_in_kernel_dq.py [--rounds 3] [--iters 200]

Prediction: the postprocess launch costs the host ~5-8 us, so the backward is that much faster
per call where the host bounds it; the head's last CTA converts alone, so where the GPU
bounds it (S = 1024, D = 128) its time grows by ~0.3 us per 32 KiB block of dq_accum.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import launch_bwd, work_buffers  # noqa: E402
from host_overhead import kernel_us, per_call_us, rotated_per_call_us  # noqa: E402

SHAPES = [(1, 16, s, d) for d in (16, 64, 128) for s in (128, 256, 512, 1024)]


def planned_with(limit, fn):
    """fn with launch_bwd.IN_KERNEL_DQ_BYTES = limit, on plans of its own."""
    plans = {}

    def call():
        saved = launch_bwd._plans, launch_bwd.IN_KERNEL_DQ_BYTES
        launch_bwd._plans, launch_bwd.IN_KERNEL_DQ_BYTES = plans, limit
        try:
            return fn()
        finally:
            launch_bwd._plans, launch_bwd.IN_KERNEL_DQ_BYTES = saved
    call.plans = plans
    return call


def cases(shape):
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(*t):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)

    ours = lambda *t: cute_flash.flash_attention(*t, causal=True)  # noqa: E731
    out, peer = ours(q, k, v), cudnn(q, k, v)
    bwd = lambda o: (lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))  # noqa: E731
    both = lambda f: (lambda: torch.autograd.grad(f(q, k, v), (q, k, v), dout))  # noqa: E731
    fns = {
        "bwd in-kernel dQ": planned_with(2**40, bwd(out)), "bwd postprocess": planned_with(0, bwd(out)),
        "bwd cudnn": bwd(peer),
        "fwd+bwd in-kernel dQ": planned_with(2**40, both(ours)), "fwd+bwd postprocess": planned_with(0, both(ours)),
        "fwd+bwd cudnn": both(cudnn),
    }
    results = [fn() for fn in fns.values()]
    converting = next(iter(fns["bwd in-kernel dQ"].plans.values())).converts_dq
    assert not next(iter(fns["bwd postprocess"].plans.values())).converts_dq
    # The two paths' gradients agree (dQ up to the order of its fp32 sums).
    for a, b in zip(results[0], results[1]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    return converting, fns


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    print(f"{'shape':20s} {'path':22s} {'host us':>8s} {'events us':>10s}", flush=True)
    for shape in SHAPES:
        work_buffers.release()
        converting, fns = cases(shape)
        rounds = rotated_per_call_us(fns, args.rounds, args.iters,
                                     lambda fn, iters: (per_call_us(fn, iters), kernel_us(fn, iters)))
        for name, values in rounds.items():
            host, events = zip(*values)
            print(f"{str(shape):20s} {name:22s} {statistics.median(host):8.1f} {statistics.median(events):10.1f}",
                  flush=True)
        print(f"{str(shape):20s} (plan.converts_dq: {converting})", flush=True)


if __name__ == "__main__":
    main()
