"""Where a small backward's host time goes, piece by piece, beside SDPA cuDNN's backward (GPU
machine). Each piece is timed as host us per call in a loop of calls without synchronisation
(perf/host_overhead.py's per_call_us), in rotated rounds, medians:

    autograd (ours / cudnn)   torch.autograd.grad over a retained graph: the backward alone
    ..., no reuse             with cute_flash.work_buffers' kept sets off (MAX_SET_BYTES 0)
    Function.backward body    launch_bwd.backward_with_sink, as _AttentionFunction calls it
    plan.run                  the cached BackwardPlan's run (gradients allocated inside)
    kernels, buffers given    the three launches with every buffer made beforehand
    pre, pre + main           the first launches alone, buffers given
    new_gradients, 5 buffers  the allocations a run makes
    py Function round trip    autograd.grad through a Python Function whose backward returns
                              three precomputed tensors (the engine's cost of a Python node)
    C++ node round trip       the same through a C++ node (q * 1 + k * 1 + v * 1 summed)
    C++ 1-node round trip     autograd.grad through one C++ node (q * 2)
    signature + lookup        launch_bwd._signature and the plan cache's dict lookup
    _launch, buffers kept     BackwardPlan._launch with its work buffers from the kept set
    ours, backward precomputed  autograd ours with _AttentionFunction.backward replaced by one
                              that unpacks the saved tensors and returns precomputed gradients
    ours, body in engine      the real backward's body timed inside the engine's thread
                              (perf_counter around it; mean per call, printed apart)
    sdpa route (activated)    SDPA's flash backend with cute_flash activated: aten's C++
                              autograd node calling our backward through the dispatcher

    python perf/experiments/bwd_host_parts.py [--rounds 5] [--iters 300]
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import launch_bwd  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from host_overhead import rotated_per_call_us  # noqa: E402


class _Precomputed(torch.autograd.Function):
    """A Python node whose backward does no work: the engine's round trip alone."""

    @staticmethod
    def forward(ctx, q, k, v, grads):
        ctx.grads = grads
        return q.clone()

    @staticmethod
    def backward(ctx, dout):
        return (*ctx.grads, None)


def cases_for(shape, dtype=torch.bfloat16):
    problem = AttentionProblem.of(True)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    scale = 1 / math.sqrt(shape[-1])
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    qd, kd, vd, od, ld = (t.detach() for t in (q, k, v, out, lse))
    retained = cute_flash.flash_attention(q, k, v, causal=True)
    launch_bwd._plans.clear()
    launch_bwd.backward(qd, kd, vd, od, dout, ld, problem, scale)
    plan = next(iter(launch_bwd._plans.values()))
    pre, main, last = plan.kernels
    B, N, S, D = shape
    rows = plan.rows
    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2, delta, dq_accum = torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty((*rows, plan.tile), **f32)
    dq_done, prepared = (torch.empty((B, N), dtype=torch.int32, device=q.device) for _ in range(2))
    dq, dk, dv = launch_bwd.new_gradients(qd, kd, vd)
    dense, scales, semaphore = None, None, None  # (16-bit, dense, not deterministic: absent)
    assert not plan.separate_dq and not plan.semaphore_blocks

    def run_pre():
        pre(od, dout, ld, lse_log2, delta, dq_accum, dq_done, prepared, plan.prep_ahead * plan.group, dense)

    def run_main():
        main(qd, kd, vd, od, dout, ld, lse_log2, delta, dq_accum, (semaphore, dq_done, prepared), dk, dv, scale,
             plan.prep_ahead, plan.prep_ctas, plan.prep_ctas, dense, None, scales, dq, 0)

    def run_last():
        last(dq_accum, dq, dq_done, plan.key_blocks, scale, dense)

    def kernels_given():
        run_pre()
        run_main()
        run_last()

    def five_buffers():
        return (torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty((*rows, plan.tile), **f32),
                torch.empty((B, N), dtype=torch.int32, device=q.device),
                torch.empty((B, N), dtype=torch.int32, device=q.device))

    grads = launch_bwd.new_gradients(qd, kd, vd)
    node = _Precomputed.apply(q, k, v, grads)
    cpp = q * 1 + k * 1 + v * 1
    one_node = q * 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    from cute_flash import api

    real_backward = api._AttentionFunction.backward
    body_ns = []

    def timed_backward(ctx, dout, dlse):
        import time
        start = time.perf_counter_ns()
        result = real_backward(ctx, dout, dlse)
        body_ns.append(time.perf_counter_ns() - start)
        return result

    def precomputed_backward(ctx, dout, dlse):
        ctx.saved_tensors
        return (*grads, None, None, None)

    def patched(backward):
        def call():
            api._AttentionFunction.backward = staticmethod(backward)
            try:
                torch.autograd.grad(retained, (q, k, v), dout, retain_graph=True)
            finally:
                api._AttentionFunction.backward = staticmethod(real_backward)
        return call

    from cute_flash import sdpa as sdpa_registration

    # Activated for the rest of the run: only SDPA's flash backend changes (cuDNN and our
    # own path do not go through its ops).
    sdpa_registration.activate()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        routed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sdpa_registration.last_decision == "ours", sdpa_registration.last_decision

    def routed_backward():
        torch.autograd.grad(routed, (q, k, v), dout, retain_graph=True)

    from cute_flash import work_buffers

    def without_reuse(fn):
        def call():
            saved = work_buffers.MAX_SET_BYTES
            work_buffers.MAX_SET_BYTES = 0
            try:
                fn()
            finally:
                work_buffers.MAX_SET_BYTES = saved
        return call

    ours = lambda: torch.autograd.grad(retained, (q, k, v), dout, retain_graph=True)  # noqa: E731
    run = lambda: plan.run(qd, kd, vd, od, dout, ld, scale)  # noqa: E731
    return body_ns, {
        "autograd ours, no reuse": without_reuse(ours),
        "plan.run, no reuse": without_reuse(run),
        "ours, backward precomputed": patched(precomputed_backward),
        "ours, body in engine": patched(timed_backward),
        "sdpa route (activated)": routed_backward,
        "autograd cudnn": lambda: torch.autograd.grad(peer, (q, k, v), dout, retain_graph=True),
        "autograd ours": ours,
        "Function.backward body": lambda: launch_bwd.backward_with_sink(qd, kd, vd, od, dout, ld, problem, scale, None),
        "plan.run": run,
        "kernels, buffers given": kernels_given,
        # (Never main or last alone: they wait on counters the preprocess zeroes.)
        "  pre": run_pre,
        "  pre + main": lambda: (run_pre(), run_main()),
        "new_gradients": lambda: launch_bwd.new_gradients(qd, kd, vd),
        "5 work buffers": five_buffers,
        "py Function round trip": lambda: torch.autograd.grad(node, (q, k, v), dout, retain_graph=True),
        "C++ node round trip": lambda: torch.autograd.grad(cpp, (q, k, v), dout, retain_graph=True),
        "C++ 1-node round trip": lambda: torch.autograd.grad(one_node, (q,), dout, retain_graph=True),
        "signature + lookup": lambda: launch_bwd._plans.get(launch_bwd._signature(
            qd, kd, vd, od, dout, ld, problem, None, True, False)),
        "_launch, buffers kept": lambda: plan._launch(qd, kd, vd, od, dout, ld, scale, None, grads, False),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    print(f"{'shape':20s} {'path':24s} {'median us':>10s} {'min':>8s} {'max':>8s}", flush=True)
    for shape in ((1, 16, 1024, 16), (1, 16, 128, 64), (1, 16, 2048, 64)):
        body_ns, cases = cases_for(shape)
        results = rotated_per_call_us(cases, args.rounds, args.iters)
        for name, values in results.items():
            print(f"{str(shape):20s} {name:24s} {statistics.median(values):10.1f} {min(values):8.1f} {max(values):8.1f}",
                  flush=True)
        print(f"{str(shape):20s} {'(body inside the engine)':24s} {statistics.median(body_ns) / 1e3:10.1f}", flush=True)


if __name__ == "__main__":
    main()
