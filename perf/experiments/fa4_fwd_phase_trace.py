"""flash-attn-4's sm90 forward per tile, beside ours, stamped alike: the SM clock (fwd_phase_trace.py's
stamps) at each main-loop step's entry and at the tile's entry and exit, in both kernels; both
also timed with and without the stamps (rotated rounds), so the stamps' cost shows. One device
call; the device stack's flash_attn is patched in this process only (its sm90 class's mma and
per-block step are wrapped before its kernel compiles).

    python perf/experiments/fa4_fwd_phase_trace.py [--shape 4,32,8192,192] [--value-head-dim 128]
        [--dtype bfloat16] [--causal 1] [--rounds 5] [--tile-only]

Per tile and warpgroup (medians, cycles): prologue (tile entry -> first step: Q's and K's
first loads, the first block's QK^T, mask and softmax), steady period (between step entries,
a tile's first and last two left out), tail (last step's entry -> the tile's exit: that step,
the last P V and O's store), total.

--tile-only: no step stamps, only each tile's entry and exit (%globaltimer, %clock, %smid, by
the first consumer thread), so neither kernel's main loop is perturbed: per tile its cycles and
ns, and per SM the ns from one tile's exit to the next tile's entry there (the CTA's end, the
next one's launch and setup; for flash-attn-4 also whatever it runs outside its mma()).
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

import fwd_phase_trace  # noqa: E402
from cute_flash.benchmarking import round_medians, round_ratios, rotated_rounds  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import load_config_file, without_clusters  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402
from fwd_phase_trace import SLOTS, WARPGROUPS, _stamp_register, record_address  # noqa: E402

STEPS = 256  # records per (CTA, warpgroup): one per key block index, the tile's own in the last
TILE = STEPS - 1


def _linear_block():
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    return Int64(bx) + Int64(gx) * (Int64(by) + Int64(gy) * Int64(bz))


def _stamp(address: int, ctas: int, record, event: int):
    tid, _, _ = cute.arch.thread_idx()
    consumer = tid - 128
    wg = consumer // 128
    block = _linear_block()
    leader = Int32((consumer % 128 == 0) & (block < ctas))
    _stamp_register(record_address(address, block, wg, record, event, STEPS), leader)


def patch_fa4(address: int, ctas: int):
    """Wrap flash-attn-4's sm90 forward class (in this process) with the stamps."""
    from flash_attn.cute import flash_fwd_sm90 as fa
    cls = fa.FlashAttentionForwardSm90
    mma, step = cls.mma, cls.mma_one_n_block_intrawg_overlap

    def traced_mma(self, *args, **kwargs):
        _stamp(address, ctas, TILE, 0)
        out = mma(self, *args, **kwargs)
        _stamp(address, ctas, TILE, 6)
        return out

    def traced_step(self, smem_pipe_read, n_block, *args, **kwargs):
        # One record per key block index (blocks past TILE - 1 share the last).
        _stamp(address, ctas, cutlass.min(n_block, TILE - 1), 0)
        return step(self, smem_pipe_read, n_block, *args, **kwargs)

    cls.mma, cls.mma_one_n_block_intrawg_overlap = traced_mma, traced_step


TILE_SLOTS = 5  # --tile-only, per CTA: entry and exit (%globaltimer_lo), entry and exit (%clock), %smid
TILE_REGISTERS = ("%globaltimer_lo", "%globaltimer_lo", "%clock", "%clock", "%smid")


def _stamp_tile(address: int, ctas: int, exit_: bool):
    """--tile-only: the tile's entry (or exit) stamps of this CTA."""
    tid, _, _ = cute.arch.thread_idx()
    block = _linear_block()
    leader = Int32((tid == 128) & (block < ctas))
    for slot in ((1, 3) if exit_ else (0, 2, 4)):
        _stamp_register(Int64(address) + (block * TILE_SLOTS + slot) * 4, leader, TILE_REGISTERS[slot])


def patch_fa4_tiles(address: int, ctas: int):
    """--tile-only: flash-attn-4's mma() (a consumer warpgroup's tile) between tile stamps."""
    from flash_attn.cute import flash_fwd_sm90 as fa
    cls = fa.FlashAttentionForwardSm90
    mma = cls.mma

    def traced_mma(self, *args, **kwargs):
        _stamp_tile(address, ctas, False)
        out = mma(self, *args, **kwargs)
        _stamp_tile(address, ctas, True)
        return out

    cls.mma = traced_mma


def compile_ours_tiles(dtype, d, problem, config, buffer, dv):
    """--tile-only: our forward with consume() between tile stamps."""
    from cute_flash.kernels import fwd_sm90
    base = fwd_sm90.FlashForwardSm90
    ctas = buffer.shape[0]

    class TileStamped(base):
        @cute.jit
        def consume(self, *args):
            _stamp_tile(buffer.data_ptr(), ctas, False)
            base.consume(self, *args)
            _stamp_tile(buffer.data_ptr(), ctas, True)

    return fwd_phase_trace.compile_with(TileStamped, dtype, d, problem, config, dv)


def tile_times(trace: torch.Tensor) -> str:
    """--tile-only: medians of every CTA's tile (cycles, ns) and of the gaps between tiles on an SM."""
    t = trace.to(torch.int64) % (1 << 32)
    t = t[t[:, 1] != 0]
    wrap = 1 << 32
    ns, cycles = (t[:, 1] - t[:, 0]) % wrap, (t[:, 3] - t[:, 2]) % wrap
    gaps = []
    for sm in t[:, 4].unique().tolist():
        rows = t[t[:, 4] == sm]
        rows = rows[torch.argsort(rows[:, 0])]
        gaps += ((rows[1:, 0] - rows[:-1, 1]) % wrap).tolist()
    span = ((t[:, 1].max() - t[:, 0].min()) % wrap).item() / 1e6
    # Cycles at quantiles of the tiles: a causal grid's tiles of 1 .. B key blocks in equal
    # numbers put quantile k / B at about k blocks (slope: cycles per block; intercept: per tile).
    ordered = cycles.sort().values
    quantiles = " ".join(f"{ordered[min(int(q * len(ordered)), len(ordered) - 1)].item():.0f}"
                         for q in (1 / 64, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 63 / 64))
    return (f"{len(t)} tiles: {median(cycles.tolist()):8.0f} cycles, {median(ns.tolist()):7.0f} ns per tile "
            f"(mean {ns.double().mean().item():7.0f}); gap between tiles on an SM {median(gaps):5.0f} ns "
            f"(mean {sum(gaps) / max(len(gaps), 1):5.0f}); span {span:.3f} ms\n"
            f"      cycles at quantiles 1/64 1/8 1/4 1/2 3/4 63/64: {quantiles}")


def tile_summary(step_entries, entry, exit_):
    """(prologue, steady period, tail, total) of one tile: tile entry -> first step entry, the
    median gap between step entries without the first and last two, last step entry -> tile
    exit, entry -> exit. step_entries: clock values (0 = none), any order."""
    wrap = 1 << 32
    entries = sorted((x - entry) % wrap for x in step_entries if x != 0)
    if not entries:
        return None
    periods = sorted(b - a for a, b in zip(entries, entries[1:]))[2:-2] if len(entries) > 5 else []
    return (entries[0], periods[len(periods) // 2] if periods else float("nan"),
            (exit_ - entry) % wrap - entries[-1], (exit_ - entry) % wrap)


def tiles(trace: torch.Tensor, tile_record: int, steps: slice):
    """tile_summary of every (CTA, warpgroup) with a tile record: flash-attn-4's trace keeps
    it in record TILE and the steps below, ours (fwd_phase_trace's light stamps) in record 0
    and the steps above."""
    t = trace.to(torch.int64)
    rows = []
    for cta, wg in torch.nonzero(t[:, :, tile_record, 6] != 0).tolist():
        row = tile_summary(t[cta, wg, steps, 0].tolist(), t[cta, wg, tile_record, 0].item(),
                           t[cta, wg, tile_record, 6].item())
        if row:
            rows.append(row)
    return rows


def median(values):
    """The (upper) median of the values that are not NaN, or NaN."""
    values = [v for v in values if v == v]
    return statistics.median_high(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192,192")
    parser.add_argument("--value-head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--tile-only", action="store_true")
    args = parser.parse_args()
    b, n, s, d = (int(x) for x in args.shape.split(","))
    dv = args.value_head_dim or d
    causal = bool(args.causal)
    dtype = getattr(torch, args.dtype)
    from flash_attn.cute import flash_attn_func, interface
    cache = interface._flash_attn_fwd.compile_cache.cache

    q, k = (torch.randn(b, s, n, d, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(b, s, n, dv, device="cuda", dtype=dtype)
    flash_attn_func(q, k, v, causal=causal)
    untraced = dict(cache)
    ctas = b * n * math.ceil(s / 128) * 2  # room for grids of up to twice our tile count
    if args.tile_only:
        buffer = torch.zeros(ctas, TILE_SLOTS, dtype=torch.int32, device="cuda")
        patch_fa4_tiles(buffer.data_ptr(), ctas)
    else:
        buffer = torch.zeros(ctas, WARPGROUPS, STEPS, SLOTS, dtype=torch.int32, device="cuda")
        patch_fa4(buffer.data_ptr(), ctas)
    cache.clear()
    out = flash_attn_func(q, k, v, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    traced = dict(cache)
    if causal:
        # The first 1024 query rows of a causal problem see only the first 1024 keys.
        head = (slice(0, 1), slice(0, 1024))
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[head].transpose(1, 2).float() for t in (q, k, v)), is_causal=True).transpose(1, 2)
        print(f"patched flash-attn-4: max error {(out[head].float() - ref).abs().max().item():.2e} "
              "on its first 1024 rows")
    buffer.zero_()
    flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    if args.tile_only:
        fa4_tiles = tile_times(buffer.cpu())
    else:
        fa4_rows = tiles(buffer.cpu().to(torch.int64) % (1 << 32), TILE, slice(0, TILE))

    # Ours, stamped the same way (light or tile-only).
    config = without_clusters(load_config_file(Path(__file__).resolve().parents[2] / "configs" / "h100.yaml").lookup(
        args.dtype, d, causal, "fwd", seqlen=s, value_head_dim=dv))
    problem = AttentionProblem.of(causal)
    our_ctas = b * n * math.ceil(s / config.block_m)
    shipped = compile_forward(args.dtype, d, problem, config, value_head_dim=dv, value_tile_head_dim=dv)
    if args.tile_only:
        ours_buffer = torch.zeros(our_ctas, TILE_SLOTS, dtype=torch.int32, device="cuda")
        stamped = compile_ours_tiles(args.dtype, d, problem, config, ours_buffer, dv)
    else:
        ours_buffer = torch.zeros(our_ctas, WARPGROUPS, fwd_phase_trace.MAX_STEPS, SLOTS, dtype=torch.int32, device="cuda")
        stamped = fwd_phase_trace.compile_traced(args.dtype, d, problem, config, ours_buffer, value_head_dim=dv,
                                                 light=True)
    qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
    o = torch.empty(b, n, s, dv, device="cuda", dtype=dtype)
    lse = torch.empty(b, n, s, device="cuda", dtype=torch.float32)
    extra = (None, *DENSE_BATCH, 1.0 / math.sqrt(d))
    stamped(qv, kv, vv, o, lse, *extra)
    torch.cuda.synchronize()
    if args.tile_only:
        our_tiles = tile_times(ours_buffer.cpu())
    else:
        our_rows = tiles(ours_buffer.cpu().to(torch.int64) % (1 << 32), 0, slice(1, None))

    def fa4_with(compiled):
        cache.clear()
        cache.update(compiled)
        return flash_attn_func(q, k, v, causal=causal)

    sides = {"ours": lambda: shipped(qv, kv, vv, o, lse, *extra),
             "ours+stamps": lambda: stamped(qv, kv, vv, o, lse, *extra),
             "fa4": lambda: fa4_with(untraced), "fa4+stamps": lambda: fa4_with(traced)}
    with torch.no_grad():
        timing = rotated_rounds(sides, args.rounds, args.hold)
    print(f"\n{args.shape} dv={dv} {args.dtype} causal={causal}, {args.rounds} rounds (ratio: ours ms / this ms)")
    for name in sides:
        print(f"  {name:12s} {round_medians(timing, name)[0]:8.4f} ms  {round_ratios(timing, 'ours', name)[0]:6.3f}")
    if args.tile_only:
        print(f"\nours: {our_tiles}\nfa4:  {fa4_tiles}")
        return
    print(f"\nper tile and warpgroup, median cycles ({len(our_rows)} / {len(fa4_rows)} traced tiles):")
    print(f"  {'':14s} {'ours':>9s} {'fa4':>9s}")
    for i, name in enumerate(("prologue", "steady period", "tail", "total")):
        print(f"  {name:14s} {median([r[i] for r in our_rows]):9.0f} {median([r[i] for r in fa4_rows]):9.0f}")


if __name__ == "__main__":
    main()
