"""The kept work sets' per-set bound (cute_flash.work_buffers.MAX_SET_BYTES), sixty-third session:
backwards whose set is above the old 16 MiB bound allocated their five work buffers on every
call, and the sixty-second session read (1, 16, 2048, 128)'s backward at ~240 us per call where its
kernels take ~150-190. Per shape (bf16 causal), the backward alone (torch.autograd.grad over a
retained graph) and forward + backward, with the set kept (the shipped bound) and allocated per
call (the old bound), beside SDPA cuDNN's; host us per call in a loop without synchronisation
and us per call between CUDA events, rotated rounds, medians.

    python perf/experiments/work_set_bound.py [--rounds 5] [--iters 200] [--shapes 1,16,2048,128;...]

Prediction: the kept set takes the five allocations (~20-40 us on the lent hosts, more inside
the autograd engine's thread) off every call where the host bounds it (events us ~ host us).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import work_buffers  # noqa: E402
from host_overhead import assert_gradients_agree, host_and_events_us, patched  # noqa: E402

SHAPES = "1,16,2048,128;4,16,1024,128;8,16,512,128;2,16,2048,64;1,16,4096,128"
OLD_BOUND = {(work_buffers, "MAX_SET_BYTES"): 16 * 2**20}  # patched()'s change


def cases(shape):
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    ours = lambda: cute_flash.flash_attention(q, k, v, causal=True)  # noqa: E731
    grad = lambda o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)  # noqa: E731
    out, peer = ours(), cudnn()
    fns = {
        "bwd kept": lambda: grad(out),
        "bwd per call": patched(OLD_BOUND, lambda: grad(out)),
        "bwd cudnn": lambda: grad(peer),
        "fwd+bwd kept": lambda: torch.autograd.grad(ours(), (q, k, v), dout),
        "fwd+bwd per call": patched(OLD_BOUND, lambda: torch.autograd.grad(ours(), (q, k, v), dout)),
        "fwd+bwd cudnn": lambda: torch.autograd.grad(cudnn(), (q, k, v), dout),
    }
    results = {name: fn() for name, fn in fns.items()}
    assert_gradients_agree(results, "bwd kept")
    return fns


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    print(f"{'shape':20s} {'set MiB':>7s} {'path':18s} {'host us':>8s} {'events us':>10s}", flush=True)
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        work_buffers.release()
        b, n, s, d = shape
        mib = work_buffers.set_bytes((b, n, -(-s // 128) * 128), d) / 2**20
        for name, (host, events) in host_and_events_us(cases(shape), args.rounds, args.iters).items():
            print(f"{str(shape):20s} {mib:7.1f} {name:18s} {host:8.1f} {events:10.1f}", flush=True)


if __name__ == "__main__":
    main()
