"""Why our backward's body takes 2-2.5x longer inside the autograd engine than called from the
main thread (perf/experiments/bwd_host_parts.py, sixtieth session: 102 vs 41 us at
(1, 16, 1024, 16) bf16 causal). The engine runs a CUDA node on its device thread; the body is
timed there phase by phase (perf_counter_ns around the saved tensors' unpacking,
backward_with_sink, BackwardPlan.run, _launch, each of the three kernel launches) and the same
phases from the main thread, beside autograd's per-call host time for ours and SDPA cuDNN's.
Run it under `taskset -c N` (every thread on one core) to test whether a cold core explains it.

    python perf/experiments/bwd_engine_thread.py [--calls 400] [--shape 1,16,1024,16]

Sixty-third session: after the one-launch backward (a one-wave grid launches only its main
kernel), finer phases: new_gradients, counted_work_set, CountTotals.advance and the launches
that ran; the main-thread stand-in carries the forward's backward plans as autograd's ctx does.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import api, launch_bwd, work_buffers  # noqa: E402

PHASES = {}


def timed(name, fn):
    def call(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES.setdefault(name, []).append(time.perf_counter_ns() - start)
    return call


def per_call_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--shape", default="1,16,1024,16")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = cute_flash.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
    cudnn = lambda: torch.autograd.grad(peer, (q, k, v), dout, retain_graph=True)  # noqa: E731
    rows = {"autograd ours": [], "autograd cudnn": []}
    for _ in range(5):
        rows["autograd ours"].append(per_call_us(ours, args.calls))
        rows["autograd cudnn"].append(per_call_us(cudnn, args.calls))
    for name, values in rows.items():
        print(f"{name:34s} {statistics.median(values):8.1f} us per call (host)")

    # Phases inside the engine.
    real_backward = api._AttentionFunction.backward
    plan_class = launch_bwd.BackwardPlan
    real_run, real_launch = plan_class.run, plan_class._launch
    real_bws = launch_bwd.backward_with_sink
    real_gradients, real_counted = launch_bwd.new_gradients, launch_bwd.counted_work_set
    real_advance = work_buffers.CountTotals.advance

    def backward(ctx, dout_, dlse):
        start = time.perf_counter_ns()
        ctx.saved_tensors
        PHASES.setdefault("unpack saved", []).append(time.perf_counter_ns() - start)
        return real_backward(ctx, dout_, dlse)

    def wrap_kernels(plan):
        if not getattr(plan, "_timed", False):
            pre, main_, last = plan.kernels
            object.__setattr__(plan, "kernels", (timed("  pre launch", pre), timed("  main launch", main_),
                                                 timed("  post launch", last)))
            object.__setattr__(plan, "_timed", True)

    def run(self, *a, **kw):
        wrap_kernels(self)
        return timed("plan.run", real_run)(self, *a, **kw)

    def phase_table(label, fn):
        PHASES.clear()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        for name, values in PHASES.items():
            print(f"{label:7s} {name:26s} {statistics.median(values) / 1e3:8.1f} us median, "
                  f"{statistics.mean(values) / 1e3:8.1f} mean")

    api._AttentionFunction.backward = staticmethod(timed("Function.backward", backward))
    launch_bwd.backward_with_sink = timed("backward_with_sink", real_bws)
    plan_class.run = run
    plan_class._launch = timed("_launch", real_launch)
    launch_bwd.new_gradients = timed("  new_gradients", real_gradients)
    launch_bwd.counted_work_set = timed("  counted_work_set", real_counted)
    work_buffers.CountTotals.advance = timed("  advance", real_advance)
    try:
        phase_table("engine", ours)
        # The same body from the main thread: a ctx stand-in with the saved tensors.
        node = out.grad_fn
        saved = node.saved_tensors

        class Ctx:
            saved_tensors = saved

        ctx = Ctx()
        ctx.problem, ctx.scale, ctx.deterministic = node.problem, node.scale, node.deterministic
        ctx.backward_plans = node.backward_plans
        phase_table("main", lambda: api._AttentionFunction.backward(ctx, dout, None))
    finally:
        api._AttentionFunction.backward = staticmethod(real_backward)
        launch_bwd.backward_with_sink = real_bws
        plan_class.run, plan_class._launch = real_run, real_launch
        launch_bwd.new_gradients, launch_bwd.counted_work_set = real_gradients, real_counted
        work_buffers.CountTotals.advance = real_advance


if __name__ == "__main__":
    main()
