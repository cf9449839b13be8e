"""A backward grid of one wave without the preprocess launch (launch_bwd.BackwardPlan.one_wave:
the main kernel prepares every head on a counted set) against the same kernels with the
preprocess launched (work_buffers.counted_work_set stubbed to None: the plan's fallback, three
launches), beside SDPA cuDNN's, bf16 causal, batch 1, 16 heads. Per case and path, host us
per call in a loop without synchronisation (perf/host_overhead.py's per_call_us) and us per
call between CUDA events over a loop (kernel_us: the GPU's rate, or the host's where that is
slower), rotated rounds, medians: the backward alone (torch.autograd.grad on a retained graph)
and forward + backward.

    python perf/experiments/bwd_one_wave.py [--rounds 5] [--iters 300]

Prediction (sixtieth session: the preprocess launch costs the host 7.4 us from the main thread,
9.6 inside the autograd engine): the backward 7-10 us faster per call, the GPU's time level.
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

SHAPES = [(1, 16, 1024, 16), (1, 16, 128, 64), (1, 16, 1024, 128), (1, 16, 512, 32), (1, 16, 1024, 64)]


def three_launches(fn):
    """fn with the one-wave path's counted sets refused: the plan falls back to the preprocess."""
    def call():
        real = launch_bwd.counted_work_set
        launch_bwd.counted_work_set = lambda *a, **kw: None
        try:
            return fn()
        finally:
            launch_bwd.counted_work_set = real
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
    bwd(out)()
    plan = next(p for p in launch_bwd._plans.values() if p.kernels is not None and p.tile == shape[-1])
    return plan.one_wave, {
        "bwd one wave": bwd(out), "bwd 3 launches": three_launches(bwd(out)), "bwd cudnn": bwd(peer),
        "fwd+bwd one wave": both(ours), "fwd+bwd 3 launches": three_launches(both(ours)), "fwd+bwd cudnn": both(cudnn),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    print(f"{'shape':20s} {'path':20s} {'host us':>8s} {'events us':>10s}", flush=True)
    for shape in SHAPES:
        launch_bwd._plans.clear()
        work_buffers.release()
        one_wave, fns = cases(shape)
        rounds = rotated_per_call_us(fns, args.rounds, args.iters,
                                     lambda fn, iters: (per_call_us(fn, iters), kernel_us(fn, iters)))
        for name, values in rounds.items():
            host, events = zip(*values)
            print(f"{str(shape):20s} {name:20s} {statistics.median(host):8.1f} {statistics.median(events):10.1f}",
                  flush=True)
        print(f"{str(shape):20s} (plan.one_wave: {one_wave})", flush=True)


if __name__ == "__main__":
    main()
