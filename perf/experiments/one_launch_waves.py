"""How many waves of short heads a one-launch backward may span (config.ONE_LAUNCH_WAVES), sixty-
third session. Per shape (bf16 causal), the backward alone (torch.autograd.grad over a retained
graph) as shipped (one launch up to two waves of heads of at most 16 key blocks, else three
launches) and with ONE_LAUNCH_WAVES raised to --waves, beside SDPA cuDNN's; host us per call in a
loop without synchronisation and us per call between CUDA events, rotated rounds, medians. Each
path plans on caches of its own.

    python perf/experiments/one_launch_waves.py [--waves 8] [--rounds 5] [--iters 200] [--shapes B,N,S,D;...]

Prediction: where the call is host-bound, one launch saves the preprocess's launch (~10-25 us);
every wave boundary adds one straddling head's wait for its last CTA (a few us of GPU time where
heads are short), so beyond two waves it gains only while the host, not the GPU, bounds the call.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import config, launch_bwd, work_buffers  # noqa: E402
from host_overhead import assert_gradients_agree, host_and_events_us, patched  # noqa: E402

SHAPES = "8,16,512,64;8,16,512,128;16,16,256,64;4,32,1024,64;8,16,1024,128"


def cases(shape, waves):
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = lambda o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)  # noqa: E731
    shipped_out = cute_flash.flash_attention(q, k, v, causal=True)
    change = {(config, "ONE_LAUNCH_WAVES"): waves}
    more_out = patched(change, lambda: cute_flash.flash_attention(q, k, v, causal=True))()
    fns = {
        "bwd shipped": lambda: grad(shipped_out),
        f"bwd <= {waves} waves": patched(change, lambda: grad(more_out)),
        "bwd cudnn": lambda: grad(peer),
    }
    results = {name: fn() for name, fn in fns.items()}
    assert_gradients_agree(results, "bwd shipped")
    plans = {name: next(iter(p.values())) for name, p in
             (("shipped", launch_bwd._plans), ("more", fns[f"bwd <= {waves} waves"].plans))}
    return fns, {name: (p.one_launch, p.converts_dq) for name, p in plans.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--waves", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    print(f"{'shape':20s} {'path':18s} {'host us':>8s} {'events us':>10s}", flush=True)
    for spec in args.shapes.split(";"):
        shape = tuple(int(x) for x in spec.split(","))
        work_buffers.release()
        launch_bwd._plans.clear()
        fns, plans = cases(shape, args.waves)
        for name, (host, events) in host_and_events_us(fns, args.rounds, args.iters).items():
            print(f"{str(shape):20s} {name:18s} {host:8.1f} {events:10.1f}", flush=True)
        print(f"{str(shape):20s} (one launch, converts dQ: {plans})", flush=True)


if __name__ == "__main__":
    main()
