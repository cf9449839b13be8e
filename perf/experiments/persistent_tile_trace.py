"""Where a persistent forward grid's time goes between tiles: %globaltimer stamps (ns, every
SM on one clock) at each tile's entry, at its first main-loop step and at its exit, written by
the first consumer thread to a per-tile record, for the one-CTA-per-tile grid and the
persistent one (TileConfig.persistent) of the same tiles (one device call).

Per tile: prologue (entry -> first step), body (first step -> exit); per SM, the gap from one
tile's exit to the next tile's entry there (a CTA's launch and setup, or the queue's hand-off
and the next Q's wait). Medians over every tile; the kernels' plain times beside.

    python perf/experiments/persistent_tile_trace.py [--shape 4,32,8192,128] [--dtype bfloat16]
        [--causal 0,1]
"""

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

import cute_flash.kernels.fwd_sm90 as fwd_sm90  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import load_config_file, without_clusters  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import no_sink, not_packed  # noqa: E402
from fwd_phase_trace import _stamp_register  # noqa: E402

SLOTS = 6  # u32 per tile: entry, first step, exit (globaltimer low bits), SM id, first step, exit (SM clock)


def traced_class(buffer_address: int):
    base = fwd_sm90.FlashForwardSm90

    class TileTraced(base):
        @cute.jit
        def _stamp(self, slot: cutlass.Constexpr[int], extra=True, register="%globaltimer_lo"):
            tid, _, _ = cute.arch.thread_idx()
            leader = Int32((tid == fwd_sm90.THREADS_PER_WARPGROUP) & extra)
            address = Int64(buffer_address) + (Int64(self._trace_tile) * SLOTS + slot) * 4
            _stamp_register(address, leader, register)

        @cute.jit
        def _consume_tile(self, tile, num_tiles, **kwargs):
            self._trace_tile = tile
            # The tile's first main-loop step finds one more key block consumed than its entry.
            self._first_step = kwargs["k_state"].count + 1
            self._stamp(0)
            self._stamp(3, register="%smid")
            states = base._consume_tile(self, tile, num_tiles, **kwargs)
            self._trace_tile = tile
            self._stamp(2)
            self._stamp(5, register="%clock")
            return states

        @cute.jit
        def _mainloop_step(self, k_state, v_state, *args, **kwargs):
            # The first step after the tile's first (masked) block: k_state has consumed one.
            first = k_state.count == self._first_step
            self._stamp(1, first)
            self._stamp(4, first, register="%clock")
            return base._mainloop_step(self, k_state, v_state, *args, **kwargs)

    return TileTraced


def compile_traced(dtype, d, problem, config, buffer):
    real = fwd_sm90.FlashForwardSm90
    fwd_sm90.FlashForwardSm90 = traced_class(buffer.data_ptr())
    try:
        return compile_forward(dtype, d, problem, config)
    finally:
        fwd_sm90.FlashForwardSm90 = real


def summary(trace: torch.Tensor) -> str:
    t = trace.to(torch.int64).cpu()
    entry, first, exit_, sm = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    wrap = 2**32
    prologue = (first - entry) % wrap
    body = (exit_ - first) % wrap
    body_cycles = (t[:, 5] - t[:, 4]) % wrap
    gaps = []
    for s in sm.unique().tolist():
        rows = (sm == s).nonzero().flatten()
        order = rows[torch.argsort(entry[rows])]
        gaps += ((entry[order[1:]] - exit_[order[:-1]]) % wrap).tolist()
    gaps = torch.tensor(gaps, dtype=torch.float64)
    med = lambda x: x.double().median().item()  # noqa: E731
    return (f"tiles {len(t)}: prologue {med(prologue):7.0f} ns  body {med(body):8.0f} ns {med(body_cycles):8.0f} cycles  "
            f"gap between tiles on an SM {med(gaps):6.0f} ns (mean {gaps.mean().item():6.0f})  "
            f"span {((exit_.max() - entry.min()) % wrap).item() / 1e6:.3f} ms")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192,128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args()
    b, n, s, d = (int(x) for x in args.shape.split(","))
    table = load_config_file(Path(__file__).resolve().parents[2] / "configs" / "h100.yaml")
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty((b, n, s), dtype=torch.float32, device="cuda")
    counter = torch.zeros((1, 1), dtype=torch.int32, device="cuda")
    packed = not_packed("cuda")
    tiles = b * n * math.ceil(s / 128)
    for causal in (bool(int(x)) for x in args.causal.split(",")):
        config = without_clusters(table.lookup(args.dtype, d, causal, "fwd", seqlen=s))
        for persistent in (False, True):
            buffer = torch.zeros((tiles, SLOTS), dtype=torch.int32, device="cuda")
            cfg = dataclasses.replace(config, persistent=persistent)
            kernel = compile_traced(args.dtype, d, AttentionProblem.of(causal), cfg, buffer)
            for _ in range(3):
                counter.zero_()
                kernel(q, k, v, out, lse, no_sink("cuda"), *packed[:3], counter if persistent else packed[3],
                       1 / math.sqrt(d))
            torch.cuda.synchronize()
            print(f"causal={int(causal)} persistent={int(persistent)}: {summary(buffer)}")
        plain = {p: compile_forward(args.dtype, d, AttentionProblem.of(causal), dataclasses.replace(config, persistent=p))
                 for p in (False, True)}

        def run(p):
            counter.zero_()
            plain[p](q, k, v, out, lse, no_sink("cuda"), *packed[:3], counter if p else packed[3], 1 / math.sqrt(d))
        times = {False: [], True: []}
        for r in range(6):
            for p in ((False, True) if r % 2 == 0 else (True, False)):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    run(p)
                stop.record()
                stop.synchronize()
                times[p].append(start.elapsed_time(stop) / 5)
        print(f"causal={int(causal)} untraced back to back, ms per call (6 alternating rounds of 5): "
              + "  ".join(f"persistent={int(p)} {sorted(t)[len(t) // 2]:.4f}" for p, t in times.items()))


if __name__ == "__main__":
    main()
