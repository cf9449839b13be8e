"""float32 backward tiles (TF32, or 3xTF32 with --precision highest): which dK / dV step
(block_m, stages) and dQ-kernel key block (block_n, stages) serve the float32 backward best,
through launch_bwd.backward_with_config (the operand pass included), beside SDPA's efficient
backend's backward on the same inputs, in interleaved rounds; plus where the time goes (torch
profiler: operand pass, preprocess, dK / dV kernel, dQ kernel). GPU script; the tuner takes
16-bit dtypes only.

    python perf/experiments/float32_bwd_tiles.py [--seqlen 8192] [--heads 16] [--rounds 5]
                                                 [--precision high|highest] [--head-dims 64,128]

Batch 1, causal; every candidate's gradients checked against the shipped one's first (a
candidate more than 2e-3 off is reported, not timed).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash import launch_bwd, launch_fwd  # noqa: E402
from cute_flash.benchmarking import attention_flops, time_ms  # noqa: E402
from cute_flash.config import default_config_dir, load_config_file  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402

# precision -> head dim -> [(main kernel's (block_m, num_stages), dQ kernel's (block_n, num_stages))];
# shipped first.
CANDIDATES = {
    "high": {
        64: [((64, 2), (64, 2)), ((64, 2), (64, 3)), ((32, 2), (64, 2)), ((64, 1), (64, 2))],
        128: [((32, 1), (32, 2)), ((32, 1), (64, 1)), ((32, 1), (16, 3))],
    },
    "highest": {
        16: [((32, 2), (64, 2)), ((64, 2), (64, 2)), ((64, 1), (64, 2))],
        32: [((32, 2), (64, 2)), ((64, 1), (64, 2)), ((32, 2), (32, 3))],
        64: [((32, 1), (32, 2)), ((32, 1), (64, 1)), ((32, 1), (16, 3))],
        128: [((16, 1), (16, 2)), ((16, 1), (32, 1))],
    },
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", default="high", choices=tuple(CANDIDATES))
    parser.add_argument("--head-dims", default=None, help="a comma-separated subset of the candidates' head dims")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.precision)
    dtype_name = "float32x3" if args.precision == "highest" else "float32"
    table = load_config_file(default_config_dir() / "h100.yaml")
    problem = AttentionProblem.of(True)
    head_dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else CANDIDATES[args.precision]
    for head_dim in head_dims:
        candidates = CANDIDATES[args.precision][head_dim]
        shape = (1, args.heads, args.seqlen, head_dim)
        q, k, v, dout = (torch.randn(shape, device="cuda") for _ in range(4))
        scale = head_dim ** -0.5
        out, lse = launch_fwd.forward(q, k, v, problem, scale)
        main_entry, dq_entry = (table.lookup(dtype_name, head_dim, True, d) for d in ("bwd", "bwd_dq"))
        calls, reference = {}, None
        for (block_m, stages), (dq_block_n, dq_stages) in candidates:
            config = dataclasses.replace(main_entry, block_m=block_m, num_stages=stages)
            dq_config = dataclasses.replace(dq_entry, block_n=dq_block_n, num_stages=dq_stages)
            name = f"m{block_m}s{stages}/dq-n{dq_block_n}s{dq_stages}"

            def call(config=config, dq_config=dq_config):
                return launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config,
                                                       dq_config=dq_config, tile_head_dim=head_dim)
            try:
                grads = call()
            except Exception as exc:  # a candidate over the shared-memory limit
                print(f"D={head_dim} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                continue
            if reference is None:
                reference = grads
            err = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference))
            if err > 2e-3:
                print(f"D={head_dim} {name}: gradients {err:.2e} off the shipped candidate's: not timed")
                continue
            calls[name] = call
        qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            oe = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True)
        calls["sdpa_efficient"] = lambda: torch.autograd.grad(oe, (qe, ke, ve), dout, retain_graph=True)
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(time_ms(fn, warmup=2, iters=5, flush=True))
        flops = 2.5 * attention_flops(*shape[:3], args.seqlen, head_dim, True)
        for name, samples in times.items():
            ms = sorted(samples)[len(samples) // 2]
            print(f"D={head_dim} {name:24s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s "
                  f"(x{sorted(times['sdpa_efficient'])[args.rounds // 2] / ms:.2f} efficient)")
        first = next(iter(calls))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            calls[first]()
            torch.cuda.synchronize()
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                print(f"    {event.key[:70]:70s} {event.device_time_total / 1000:8.3f} ms x{event.count}")


if __name__ == "__main__":
    main()
