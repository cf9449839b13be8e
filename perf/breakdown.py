"""Where the time of one forward+backward goes, kernel by kernel (GPU script).

    python perf/breakdown.py [--shape B,N,S,D] [--iters 10]

Runs fwd+bwd through each implementation's public autograd path (cute_flash.flash_attention,
flash-attn-4's flash_attn_func in its native (B, S, N, D) layout, SDPA cuDNN) under
torch.profiler and prints, per implementation and causal mode, every GPU kernel's mean time
per iteration, their sum and the wall time per iteration (CUDA events around the profiled
loop). The sum of kernel times against the wall time shows gaps between kernels (host cost);
the kernel list shows what besides the main backward kernel costs time (work-buffer fills,
pre/postprocess, layout copies).
"""

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cute_flash  # noqa: E402


def implementations(causal):
    impls = {"cute_flash": ("bnsd", lambda q, k, v: cute_flash.flash_attention(q, k, v, causal=causal))}

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    impls["sdpa_cudnn"] = ("bnsd", cudnn)
    try:
        from flash_attn.cute import flash_attn_func  # comparison only

        def fa4(q, k, v):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        impls["flash_attn_4"] = ("bsnd", fa4)
    except Exception as exc:  # noqa: BLE001
        print(f"flash-attn-4 not importable: {type(exc).__name__}")
    return impls


def profile(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
    wall = start.elapsed_time(end) / iters
    per_kernel = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1000 / iters
    return wall, per_kernel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,64,8192,128")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    b, n, s, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    summary = []
    for causal in (False, True):
        for name, (layout, impl) in implementations(causal).items():
            shape = (b, s, n, d) if layout == "bsnd" else (b, n, s, d)
            q, k, v = (torch.randn(shape, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
            dout = torch.randn_like(q)

            def call():
                q.grad = k.grad = v.grad = None
                impl(q, k, v).backward(dout)
            wall, per_kernel = profile(call, args.iters)
            total = sum(per_kernel.values())
            print(f"== {name} {'causal' if causal else 'full'} ({args.shape} {args.dtype}): "
                  f"wall {wall:.3f} ms/iter, kernels {total:.3f} ms")
            for kname, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
                print(f"   {ms:8.3f} ms  {kname[:110]}")
            summary.append((name, causal, wall, total))
            del q, k, v, dout
            torch.cuda.empty_cache()
    print("\nimpl          causal   wall ms  kernels ms")
    for name, causal, wall, total in summary:
        print(f"{name:13s} {str(causal):6s} {wall:8.3f} {total:10.3f}")


if __name__ == "__main__":
    main()
