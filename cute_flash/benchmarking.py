"""Measuring helpers shared by the bench command and the perf scripts (GPU only).

Times are CUDA-event medians after a warm-up; the reference runs in float32 a few heads at
a time so that the large cases fit in memory.
"""

import contextlib
import fcntl
import statistics
import time

import torch

from cute_flash.torch_helpers import DENSE_BATCH


_l2_scrub = None


def flush_l2() -> None:
    """Overwrite the L2 cache (50 MiB on H100) with unrelated data."""
    global _l2_scrub
    if _l2_scrub is None:
        _l2_scrub = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    _l2_scrub.zero_()


_cycles_per_ms = None


def hold_stream(ms: float) -> None:
    """Keep the current stream busy for about `ms` (a kernel spinning on the SM clock), so that
    what the host queues meanwhile runs back to back after it. A timed call's start event goes
    after the hold: the host time before the call's first kernel then does not count as its
    GPU time (without the hold the GPU idles from the start event until that launch, and a
    call with a slow host path reads slower than its kernels run)."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms = 2_000_000 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(min(ms, 100.0) * _cycles_per_ms))


def host_ms(fn, calls: int = 5) -> float:
    """Host milliseconds one call of fn takes to return (its kernels queued, not waited for),
    from an idle GPU: what a hold must cover to hide its launch latency. The median of `calls`
    calls: one call that met a pause of the host (a collection, another process) read ten times
    too long, and the hold made of it hid a host-bound batch's whole host time (time_ms then
    read the GPU's time alone: 0.017 ms for a backward of ~0.1 ms, perf/NOTES.md, sixty-first
    session)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def latency_hold_ms(host: float) -> float:
    """The hold that hides a launch latency of `host` ms: twice it plus a margin (the spin's
    calibration drifts with the SM clock under the power limit)."""
    return 2.0 * host + 0.05


def time_one_call_ms(fn, hold_ms: float = 0.0) -> float:
    """One call of fn between CUDA events (for paired rounds, where each sample is its own),
    after hold_stream(hold_ms) when hold_ms > 0 (see time_ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hold_ms > 0:
        hold_stream(hold_ms)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fn, warmup: int = 5, iters: int = 20, min_sample_ms: float = 1.0, flush: bool = False,
            hold_ms: float | None = None) -> float:
    """Median milliseconds per call of fn() on the current stream.

    Each sample times a batch of back-to-back calls between two CUDA events, the batch long
    enough (>= min_sample_ms) that event and launch gaps do not count: calls whose host cost
    is below their GPU time are measured as the GPU runs them in a loop, calls whose host cost
    is above it at the host's rate. Before each sample the stream is held (hold_stream) for
    about twice one call's host time, so that the batch's first launch latency does not count
    either: without the hold the start event fired on an idle GPU, and a call of a few ms,
    timed one per sample, read its host path's latency as GPU time (a peer with a slow host
    path looked slower than its kernels). For host-bound calls the hold hides that one latency
    of the batch: an optimism of at most 1 / batch of the host time. With `flush`, L2 is
    overwritten before each sample, so the first call of a batch finds its inputs in HBM.
    hold_ms: the hold before each sample (default: this fn's own). Steps compared with each
    other should share one (common_hold_ms): the SM clock rises while the GPU idles in a hold,
    so a longer hold makes the call after it faster (perf/NOTES.md, thirty-sixth session).
    """
    for _ in range(warmup):
        fn()
    hold = latency_hold_ms(host_ms(fn)) if hold_ms is None else hold_ms
    first = time_one_call_ms(fn, hold)
    batch = max(1, min(1000, int(min_sample_ms / max(first, 1e-3)) + 1))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        if flush:
            flush_l2()
        hold_stream(hold)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def common_hold_ms(steps) -> float:
    """One hold (time_ms's hold_ms) for steps timed against each other: the longest any of
    them needs to hide its host latency."""
    return max(latency_hold_ms(host_ms(step)) for step in steps)


PROBE_CYCLES = 100_000  # ~55 us at 1.8 GHz: the event timer's ~0.5 us is ~1 % of it


def time_flushed_call(fn, hold_ms: float) -> tuple:
    """(ms, MHz): one call of fn between CUDA events after an L2 flush and a hold, and the SM
    clock just before it (a spin of PROBE_CYCLES clock cycles between two events). The clock
    follows the duty cycle of the last few hundred ms (1560-1860 MHz on an H200 under this
    benchmark's load), so calls compared with each other should be timed next to each other,
    in an order that rotates (rotated_order)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    flush_l2()
    hold_stream(hold_ms)
    events[0].record()
    torch.cuda._sleep(PROBE_CYCLES)
    events[1].record()
    events[2].record()
    fn()
    events[3].record()
    events[3].synchronize()
    return events[2].elapsed_time(events[3]), PROBE_CYCLES / max(events[0].elapsed_time(events[1]), 1e-6) / 1e3


@contextlib.contextmanager
def timing_lock(path: str):
    """Hold an exclusive lock on the file `path` (nothing when empty): benchmark processes
    started together compile at once and time one after another, never on a shared GPU."""
    if not path:
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def rotated_order(names: list, round_index: int) -> list:
    """names in the order of round `round_index`: rotated by one place per round, so over
    len(names) rounds every name takes every place once (no name always follows the same
    neighbour into the same clock state)."""
    shift = round_index % max(len(names), 1)
    return names[shift:] + names[:shift]


def rotated_rounds(sides: dict, rounds: int, hold_ms: float, warmup: int = 3) -> list:
    """Per round {name: (ms, MHz)}: every side of `sides` (name -> callable) timed once by
    time_flushed_call after the same hold, in rotated_order, after `warmup` untimed calls of
    each (compiles, caches, first-call allocations)."""
    names = list(sides)
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    torch.cuda.synchronize()
    return [{name: time_flushed_call(sides[name], hold_ms) for name in rotated_order(names, r)}
            for r in range(rounds)]


def round_medians(rows: list, name) -> tuple:
    """(ms, MHz): the medians of side `name` over rotated_rounds' rows."""
    return statistics.median(r[name][0] for r in rows), statistics.median(r[name][1] for r in rows)


def round_ratios(rows: list, numerator, denominator) -> tuple:
    """(median, first quartile, third quartile) of numerator's ms / denominator's ms taken
    within each round of rotated_rounds' rows: both sides of every ratio ran at one clock."""
    ratios = sorted(r[numerator][0] / r[denominator][0] for r in rows)
    return statistics.median(ratios), ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]


def round_table(rows: list, ratio_sides, width: int = 10) -> list:
    """Lines of a table over rotated_rounds' rows: per side its median ms and MHz, and the
    median and quartiles of the per-round ratio of the two sides ratio_sides(name) names
    (numerator, denominator)."""
    lines = [f"{'side':{width}s} {'ms':>8s} {'MHz':>5s} {'ratio':>6s} {'q1-q3':>12s}"]
    for name in rows[0]:
        ms, mhz = round_medians(rows, name)
        ratio, q1, q3 = round_ratios(rows, *ratio_sides(name))
        lines.append(f"{name:{width}s} {ms:8.4f} {mhz:5.0f} {ratio:6.3f} {q1:5.3f}-{q3:5.3f}")
    return lines


def run_in_profiler_range(runs, grad: bool = False) -> None:
    """Each of `runs` (callables) once as a warm-up (compiles, caches), then once more inside
    a CUDA profiler range (what `ncu --profile-from-start off` or nsys's capture range sees),
    with autograd only if `grad` (runs that compute gradients themselves)."""
    with torch.set_grad_enabled(grad):
        for run in runs:
            run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for run in runs:
            run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def run_poisoned(kernel, q, k, v, scale):
    """Run a compiled forward kernel on NaN-filled outputs; returns (out, lse). An element the
    kernel fails to write stays NaN, so a comparison of every element catches it."""
    out = torch.full((*q.shape[:3], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    kernel(q, k, v, out, lse, None, *DENSE_BATCH, scale)
    return out, lse


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> float:
    """Forward FLOPs of the two matmuls; causal counts the half that is computed."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def matmul_tflops(n: int = 8192, dtype=torch.float16) -> tuple:
    """(ms, TFLOP/s) of an n^3 matmul: the ceiling attention is compared with."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return ms, 2.0 * n**3 / ms / 1e9


def reference_fp32(q, k, v, causal, scale, max_bytes: int = 2**31):
    """float32 attention (out, lse) on the GPU, a chunk of heads at a time."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    qf, kf, vf = (t.reshape(batch * heads, t.shape[2], t.shape[3]) for t in (q, k, v))
    of, lf = out.view(batch * heads, seqlen_q, -1), lse.view(batch * heads, seqlen_q)
    chunk = max(1, max_bytes // max(1, 4 * seqlen_q * seqlen_k))
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril() if causal else None
    for start in range(0, batch * heads, chunk):
        sl = slice(start, start + chunk)
        scores = torch.bmm(qf[sl].float(), kf[sl].float().transpose(1, 2)) * scale
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        lf[sl] = row_lse
        probs = torch.exp(scores - row_lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
        of[sl] = torch.bmm(probs, vf[sl].float())
        del scores, probs
    return out, lse


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius) over every element; inf when actual is
    NaN or inf anywhere expected is finite (an unwritten, poisoned element counts)."""
    actual, expected = actual.float(), expected.float()
    finite = torch.isfinite(expected)
    if not torch.isfinite(actual[finite]).all():
        return float("inf")
    diff = (actual - expected)[finite]
    return (diff.norm() / expected[finite].norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def entry_tiles_on_every_grid():
    """The shipped entries' own tiles on every grid (config.grid_fitted off, which gives small
    grids, such as the tests' and the sanitizer's, the two-warpgroup tile) with the host's plans
    built afresh; yields the forward configs the calls compile (compile_fwd.get_forward), in
    order, so a caller can check which tile ran. Everything is restored on exit."""
    from cute_flash import api, compile_fwd, kvcache_plan, launch_bwd, launch_fwd, varlen_plan

    plan_modules = (api, kvcache_plan, launch_bwd, varlen_plan)
    saved_plans = [module._plans for module in plan_modules]
    grid_fitted, get_forward = launch_fwd.grid_fitted, compile_fwd.get_forward
    compiled = []

    def recording(dtype_name, head_dim, problem, config, *args, **kwargs):
        compiled.append(config)
        return get_forward(dtype_name, head_dim, problem, config, *args, **kwargs)

    launch_fwd.grid_fitted = lambda config, *grid: config
    compile_fwd.get_forward = recording
    for module in plan_modules:
        module._plans = {}
    try:
        yield compiled
    finally:
        launch_fwd.grid_fitted, compile_fwd.get_forward = grid_fitted, get_forward
        for module, plans in zip(plan_modules, saved_plans):
            module._plans = plans
