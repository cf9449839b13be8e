"""Host-side (CPU) cost of one cute_flash call, on the GPU machine.

A loop of calls on a small problem without synchronisation is CPU-bound once the CPU cost per
call exceeds the kernel time; wall time per call is then the host overhead. The kernel's own
time (CUDA events) is printed beside it so the two can be told apart.

    python perf/host_overhead.py
"""

import math
import statistics
import time

import torch

from cute_flash.torch_helpers import DENSE_BATCH

import cute_flash
from cute_flash import api, compile_fwd, launch_bwd, launch_fwd
from cute_flash.config import get_config
from cute_flash.kernels.problem import AttentionProblem

FULL = AttentionProblem.of(False)


def per_call_us(fn, iters=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / iters * 1e6


def rotated_per_call_us(cases: dict, rounds: int, iters: int, measure=None) -> dict:
    """{label: [per_call_us of each round]} of `cases` ({label: fn}), timed in `rounds` rounds,
    every other round in reverse order (so that no case always follows the same one).
    measure(fn, iters): what each round records instead (default per_call_us)."""
    measure = measure or per_call_us
    results = {}
    for r in range(rounds):
        order = list(cases.items())
        if r % 2:
            order.reverse()
        for label, fn in order:
            results.setdefault(label, []).append(measure(fn, iters))
    return results


def with_attributes(change: dict, fn):
    """fn with the change's module attributes ({(module, name): value}) set during each call,
    restored after it."""
    def call():
        saved = {key: getattr(*key) for key in change}
        for (module, name), value in change.items():
            setattr(module, name, value)
        try:
            return fn()
        finally:
            for (module, name), value in saved.items():
                setattr(module, name, value)
    return call


def patched(change: dict, fn):
    """A host-path experiment's variant: fn with the change's module attributes ({(module,
    name): value}) set during each call, and plan caches of its own (forward and backward: a
    forward plan carries the backward plans found through it); .plans is its backward cache."""
    values = {(api, "_plans"): {}, (launch_bwd, "_plans"): {}, **change}
    call = with_attributes(values, fn)
    call.plans = values[(launch_bwd, "_plans")]
    return call


def assert_gradients_agree(results: dict, reference: str):
    """Every path's gradients ({label: (dq, dk, dv)}) within 1e-2 relative (norm) of the
    reference path's, a cuDNN path's within 5e-2: an experiment's variants compute the same
    thing (dQ up to the order of its float32 sums)."""
    for name, grads in results.items():
        for a, b in zip(grads, results[reference]):
            bound = 5e-2 if "cudnn" in name else 1e-2
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < bound, name


def host_and_events_us(cases: dict, rounds: int, iters: int) -> dict:
    """{label: (host us, us between events)} per call of `cases` ({label: fn}): each the
    median over rotated rounds (rotated_per_call_us) of per_call_us and kernel_us, the host's
    rate and the GPU's (or the host's where that is slower)."""
    results = rotated_per_call_us(cases, rounds, iters, lambda fn, n: (per_call_us(fn, n), kernel_us(fn, n)))
    return {label: tuple(statistics.median(column) for column in zip(*values)) for label, values in results.items()}


def kernel_us(fn, iters=200):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main():
    q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    scale = 1 / math.sqrt(128)
    cfg = get_config("float16", 128, False, "fwd", q.device)
    kernel = compile_fwd.get_forward("float16", 128, FULL, cfg, "sm_90a")
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 128, device="cuda")
    rows = [
        ("flash_attention (public API)", lambda: cute_flash.flash_attention(q, k, v)),
        ("torch.ops.cute_flash op", lambda: torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, scale)),
        ("launch_fwd.forward", lambda: launch_fwd.forward(q, k, v, FULL, scale)),
        ("compiled kernel (TVM-FFI)", lambda: kernel(q, k, v, out, lse, None, *DENSE_BATCH, scale)),
    ]
    print(f"{'path':32s} {'host us/call':>12s} {'GPU us/call':>12s}")
    for name, fn in rows:
        print(f"{name:32s} {per_call_us(fn):12.1f} {kernel_us(fn):12.1f}")
    # Pieces of the public API's fast path, host cost only.
    from cute_flash import api

    cute_flash.flash_attention(q, k, v)
    plan = next(iter(api._plans.values()))
    pieces = [
        ("  AttentionProblem.of", lambda: AttentionProblem.of(False)),
        ("  signature key", lambda: api.call_signature(q, k, v, FULL, None)),
        ("  torch.empty(out)", lambda: torch.empty((1, 1, 128, 128), dtype=torch.float16, device=q.device)),
        ("  q.new_empty(out)", lambda: q.new_empty((1, 1, 128, 128))),
        ("  torch.empty_like(q)", lambda: torch.empty_like(q)),
        ("  grad/compile checks", lambda: torch.is_grad_enabled() and q.requires_grad or torch.compiler.is_compiling()),
        ("  plan.run", lambda: plan.run(q, k, v, False)),
    ]
    for name, fn in pieces:
        print(f"{name:32s} {per_call_us(fn):12.1f}")
    backward_rows()


def backward_rows():
    """The same for the backward: through autograd, the op, launch_bwd (configs picked, then
    given); then a cProfile of the backward alone through autograd (where the host time of one
    backward goes) on the seeds' small shape (bf16, causal)."""
    import cProfile
    import pstats

    from cute_flash import launch_bwd

    cases = (((1, 1, 128, 128), torch.float16, FULL), ((1, 64, 1024, 128), torch.float16, FULL),
             ((1, 16, 1024, 16), torch.bfloat16, AttentionProblem.of(True)))
    for shape, dtype, problem in cases:
        q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        scale = 1 / math.sqrt(shape[-1])
        out, lse = cute_flash.flash_attention(q, k, v, causal=problem.causal, return_lse=True)
        dout = torch.randn_like(out)
        qd, kd, vd, od, ld = (t.detach() for t in (q, k, v, out, lse))
        cfg = get_config(launch_bwd.kernel_dtype_name(dtype, shape[-1]), shape[-1], problem.causal, "bwd", q.device)
        retained = cute_flash.flash_attention(q, k, v, causal=problem.causal)

        def fwd_bwd():
            o = cute_flash.flash_attention(q, k, v, causal=problem.causal)
            torch.autograd.grad(o, (q, k, v), dout)

        def bwd_alone():
            torch.autograd.grad(retained, (q, k, v), dout, retain_graph=True)

        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_retained = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=problem.causal)

        def cudnn_bwd_alone():
            torch.autograd.grad(cudnn_retained, (q, k, v), dout, retain_graph=True)

        rows = [
            ("sdpa cudnn bwd alone (peer)", cudnn_bwd_alone),
            ("fwd+bwd through autograd", fwd_bwd),
            ("bwd alone through autograd", bwd_alone),
            ("bwd op", lambda: torch.ops.cute_flash.flash_attention_bwd(dout, None, qd, kd, vd, od, ld,
                                                                      problem.causal, scale)),
            ("launch_bwd.backward", lambda: launch_bwd.backward(qd, kd, vd, od, dout, ld, problem, scale)),
            ("launch_bwd.backward_with_config",
             lambda: launch_bwd.backward_with_config(qd, kd, vd, od, dout, ld, problem, scale, config=cfg)),
        ]
        print(f"== backward {shape} {dtype} causal={problem.causal}")
        for name, fn in rows:
            iters = 300 if shape[1] > 1 else 2000
            print(f"{name:32s} {per_call_us(fn, iters):12.1f} {kernel_us(fn, 50):12.1f}")
        if dtype == torch.bfloat16:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(500):
                bwd_alone()
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
