"""What the perf scripts share to time cute_flash beside its peers in one run: keep the steps
that run the case (a peer that does not take it is named on stderr, with why), then time them
in interleaved rounds (CUDA events, L2 flushed before each sample) and take medians."""

import statistics
import sys

import torch

from cute_flash.benchmarking import common_hold_ms, rotated_order, time_ms


def in_grad_mode(step, enabled: bool):
    """step, run with autograd on or off (a forward-only step must not record a graph)."""
    def run():
        with torch.set_grad_enabled(enabled):
            return step()
    return run


def runnable_steps(steps: dict, label: str, refusals: dict | None = None) -> dict:
    """The steps (name -> callable) that run: each is called once and synchronised. With
    `refusals`, each refusing step's exception goes there (name -> exception) as well."""
    runnable = {}
    for name, step in steps.items():
        try:
            step()
            torch.cuda.synchronize()
            runnable[name] = step
        except Exception as exc:  # a peer that does not take this case
            print(f"{label} {name}: skipped ({type(exc).__name__}: {str(exc)[:100]})", file=sys.stderr)
            if refusals is not None:
                refusals[name] = exc
    return runnable


def as_cuda_graph(step):
    """step captured into a CUDA graph (after warm-up calls on a side stream, as torch's
    graph docs ask) and replayed: what a serving loop that replays graphs pays, without the
    host time of building the calls (the graph's inputs are fixed tensors)."""
    return captured(step)[0]


def captured(step):
    """(replay, output): as_cuda_graph's replay and what the captured call returned (the
    tensors each replay writes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def interleaved_medians(steps: dict, rounds: int, iters: int, refusals: dict | None = None) -> dict:
    """name -> the median over `rounds` interleaved rounds of each step's median ms. Every
    step gets the same hold before its samples, and the order rotates round by round: the
    SM clock follows the recent duty cycle, so a fixed order (or a longer hold for a peer
    with a slower host path) biased ratios by a few % (perf/NOTES.md, thirty-sixth session).
    With `refusals`, a step that raises while timed goes there (name -> exception) and out of
    the later rounds and the result; without, the exception propagates."""
    for step in steps.values():
        step()
    hold = common_hold_ms(list(steps.values()))
    samples = {name: [] for name in steps}
    for index in range(rounds):
        for name in rotated_order(list(steps), index):
            if refusals is not None and name in refusals:
                continue
            try:
                samples[name].append(time_ms(steps[name], warmup=2, iters=iters, flush=True, hold_ms=hold))
            except Exception as exc:
                if refusals is None:
                    raise
                refusals[name] = exc
    return {name: statistics.median(times) for name, times in samples.items()
            if refusals is None or name not in refusals}
