"""A small one-wave backward's host path, change by change (sixty-second session), beside SDPA
cuDNN's; bf16 causal, batch 1, 16 heads. Paths (each on plan caches of its own):

    bwd                     as shipped: dQ converted in the main kernel by each head's last CTA
                            (launch_bwd.BackwardPlan.converts_dq, no postprocess launch), every
                            key block preparing, the backward plan found through the forward's
    bwd postprocess         IN_KERNEL_DQ_BYTES 0: the postprocess launched
    bwd causal-half prep    the causal half of the key blocks preparing (as multi-wave grids)
    bwd signature plans     the backward plan found by the backward's whole signature
    bwd 3 launches          no counted set (work_buffers.counted_work_set refused): the preprocess,
                            main kernel and postprocess, as (B, S, N, D) rows ran before
    bwd as one wave         (--as-one-wave) planned as if the GPU had twice its SMs: a grid of
                            two waves on the one-launch path (each head prepared by its own CTAs)
    bwd cudnn               SDPA's cuDNN backend
    fwd+bwd ...             forward + backward of the first two and cuDNN's

Per case and path, host us per call in a loop without synchronisation and us per call between
CUDA events over a loop (the GPU's rate, or the host's where that is slower), rotated rounds,
medians: the backward alone (torch.autograd.grad on a retained graph) and forward + backward.

    python perf/experiments/bwd_in_kernel_dq.py [--rounds 3] [--iters 200] [--gpu-time] [--layout bsnd]

--layout bsnd: q, k, v and dO as transposed views of (B, S, N, D) tensors (flash-attn's layout,
Hugging Face's projections), so O and dO rows are strided.

--gpu-time: instead, each backward path's kernels' device time per call (torch.profiler's
CUDA activity over --iters calls per round; the longest kernel, the main one, and all of them),
free of the host's time: what the preparation's share and the in-kernel conversion cost the GPU.

Predictions: the postprocess launch costs the host ~5-8 us; the whole signature ~3-5 us; a
causal head prepared by all its key blocks shortens the longest CTAs' wait for it by half
(GPU time, where the GPU bounds the call: S = 1024, D = 128).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import launch_bwd, work_buffers  # noqa: E402
from host_overhead import assert_gradients_agree, host_and_events_us, patched, rotated_per_call_us  # noqa: E402

SHAPES = [(1, 16, s, d) for d in (16, 64, 128) for s in (128, 256, 512, 1024)]


def causal_half(config, problem, seqlen_k, group, one_launch=False):
    return _PREPARING(config, problem, seqlen_k, group)


def signature_only(*args, plans=None, **kwargs):
    return _WITH_SINK(*args, **kwargs)


_PREPARING, _WITH_SINK = launch_bwd.preparing_ctas, launch_bwd.backward_with_sink
CHANGES = {
    "": {},
    " postprocess": {(launch_bwd, "IN_KERNEL_DQ_BYTES"): 0},
    " causal-half prep": {(launch_bwd, "preparing_ctas"): causal_half},
    " signature plans": {(launch_bwd, "backward_with_sink"): signature_only},
    " 3 launches": {(launch_bwd, "counted_work_set"): lambda *args: None},
}


def cases(shape, layout="bnsd"):
    def tensor():
        if layout == "bsnd":
            b, n, s, d = shape
            return torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    q, k, v = (tensor().requires_grad_() for _ in range(3))
    dout = tensor()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(*t):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)

    ours = lambda *t: cute_flash.flash_attention(*t, causal=True)  # noqa: E731
    grad = lambda o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)  # noqa: E731
    fns = {}
    for suffix, change in CHANGES.items():
        retained = patched(change, lambda: ours(q, k, v))()  # its forward plan's own backward plans
        fns["bwd" + suffix] = patched(change, lambda o=retained: grad(o))
    peer = cudnn(q, k, v)
    fns["bwd cudnn"] = lambda: grad(peer)
    for suffix in ("", " postprocess"):
        fns["fwd+bwd" + suffix] = patched(CHANGES[suffix], lambda: torch.autograd.grad(ours(q, k, v), (q, k, v), dout))
    fns["fwd+bwd cudnn"] = lambda: torch.autograd.grad(cudnn(q, k, v), (q, k, v), dout)
    results = {name: fn() for name, fn in fns.items()}
    shipped = next(iter(fns["bwd"].plans.values()))
    assert not next(iter(fns["bwd postprocess"].plans.values())).converts_dq
    assert_gradients_agree(results, "bwd")
    return (shipped.converts_dq, shipped.prep_ctas), fns


def device_us(fn, iters):
    """(longest kernel, all kernels) device us per call of fn over iters calls (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    longest = max(kernels, key=lambda e: e.device_time_total)
    return longest.device_time_total / iters, sum(e.device_time_total for e in kernels) / iters


def gpu_time(args):
    print(f"{'shape':20s} {'path':22s} {'main us':>8s} {'all us':>8s}", flush=True)
    for shape in SHAPES:
        work_buffers.release()
        _, fns = cases(shape, args.layout)
        fns = {name: fn for name, fn in fns.items() if name.startswith("bwd") and name != "bwd signature plans"}
        rounds = rotated_per_call_us(fns, args.rounds, args.iters, device_us)
        for name, values in rounds.items():
            main_us, all_us = zip(*values)
            print(f"{str(shape):20s} {name:22s} {statistics.median(main_us):8.1f} {statistics.median(all_us):8.1f}",
                  flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--gpu-time", action="store_true")
    parser.add_argument("--layout", choices=("bnsd", "bsnd"), default="bnsd")
    parser.add_argument("--seqlens", default="128,256,512,1024")
    parser.add_argument("--head-dims", default="16,64,128")
    parser.add_argument("--as-one-wave", action="store_true")
    args = parser.parse_args()
    SHAPES[:] = [(1, 16, int(s), int(d)) for d in args.head_dims.split(",") for s in args.seqlens.split(",")]
    if args.as_one_wave:
        traits = launch_bwd.device_traits
        CHANGES[" as one wave"] = {(launch_bwd, "device_traits"): lambda d: (traits(d)[0], 2 * traits(d)[1])}
    if args.gpu_time:
        return gpu_time(args)
    print(f"{'shape':20s} {'path':22s} {'host us':>8s} {'events us':>10s}", flush=True)
    for shape in SHAPES:
        work_buffers.release()
        (converting, prep_ctas), fns = cases(shape, args.layout)
        for name, (host, events) in host_and_events_us(fns, args.rounds, args.iters).items():
            print(f"{str(shape):20s} {name:22s} {host:8.1f} {events:10.1f}", flush=True)
        print(f"{str(shape):20s} (shipped plan: converts_dq {converting}, prep_ctas {prep_ctas})", flush=True)


if __name__ == "__main__":
    main()
