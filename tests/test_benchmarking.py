"""The measuring helpers: CPU-side parts, and (GPU) what time_ms counts."""

import time

import pytest
import torch

from cute_flash.benchmarking import (
    hold_stream, relative_error, rotated_order, round_medians, round_ratios, round_table, run_poisoned, time_ms)


def test_run_poisoned_leaves_unwritten_elements_nan():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))

    def writes_first_head_only(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                               operand_scales, scale):
        out[:, 0] = v[:, 0] * scale
        lse[:, 0] = 1.0

    out, lse = run_poisoned(writes_first_head_only, q, k, v, 0.5)
    assert torch.equal(out[:, 0], v[:, 0] * 0.5) and torch.isnan(out[:, 1]).all()
    assert (lse[:, 0] == 1.0).all() and torch.isnan(lse[:, 1]).all() and lse.dtype == torch.float32
    assert relative_error(out, v) == float("inf")  # a NaN where the reference is finite never passes


def test_entry_tiles_on_every_grid_records_and_restores(monkeypatch):
    """The shipped entries' own tiles on any grid (tests' fixture, perf/sanitize.py --only
    tiles): grid_fitted keeps the entry, each compiled forward config is recorded and the call
    goes through, the plan caches are fresh, and everything is back as it was on exit (also
    when the body raises)."""
    from cute_flash import api, compile_fwd, kvcache_plan, launch_bwd, launch_fwd, varlen_plan
    from cute_flash.benchmarking import entry_tiles_on_every_grid
    from cute_flash.config import TileConfig

    monkeypatch.setattr(compile_fwd, "get_forward", lambda dtype_name, head_dim, problem, config, *a, **k: "kernel")
    get_forward, grid_fitted = compile_fwd.get_forward, launch_fwd.grid_fitted
    modules = (api, kvcache_plan, launch_bwd, varlen_plan)
    plans = [module._plans for module in modules]
    entry = TileConfig(192, 80, 2, 3, True, speed_over_fitted=1.06)
    with pytest.raises(RuntimeError, match="inside"):
        with entry_tiles_on_every_grid() as compiled:
            assert launch_fwd.grid_fitted(entry, None, 1, 1, 1, 1, 1, 132) is entry
            assert compile_fwd.get_forward("bfloat16", 128, None, entry) == "kernel" and compiled == [entry]
            assert all(module._plans == {} and module._plans is not old for module, old in zip(modules, plans))
            raise RuntimeError("inside")
    assert compile_fwd.get_forward is get_forward and launch_fwd.grid_fitted is grid_fitted
    assert all(module._plans is old for module, old in zip(modules, plans))


def test_rotated_order_puts_every_name_in_every_place_once_per_cycle():
    names = ["ours", "fa4", "cudnn"]
    orders = [rotated_order(names, r) for r in range(6)]
    for place in range(3):
        assert sorted(order[place] for order in orders[:3]) == sorted(names)
    assert orders[3] == orders[0] and orders[1] == ["fa4", "cudnn", "ours"]
    assert rotated_order([], 4) == []


def test_round_ratios_pair_sides_within_each_round():
    """A side twice as slow as the base in every round reads 2.0 however the clock moved the
    rounds; the medians of ms and MHz are each side's own."""
    rows = [{"base": (1.0 * f, 1800 / f), "slow": (2.0 * f, 1800 / f)} for f in (1.0, 1.2, 0.9, 1.1, 1.05)]
    assert round_ratios(rows, "slow", "base") == (2.0, 2.0, 2.0)
    assert round_ratios(rows, "base", "slow") == (0.5, 0.5, 0.5)
    assert round_medians(rows, "slow") == (2.0 * 1.05, 1800 / 1.05)
    rows[0]["slow"] = (4.0, 1800.0)  # one outlier round moves the third quartile, not the median
    median, q1, q3 = round_ratios(rows, "slow", "base")
    assert median == 2.0 and q1 == 2.0 and q3 == 2.0
    rows[1]["slow"] = (1.2 * 3.0, 1500.0)
    assert round_ratios(rows, "slow", "base") == (2.0, 2.0, 3.0)
    header, base, slow = round_table(rows, lambda name: (name, "base"))
    assert header.split() == ["side", "ms", "MHz", "ratio", "q1-q3"]
    assert base.split()[0] == "base" and base.split()[3:] == ["1.000", "1.000-1.000"]
    assert slow.split()[0] == "slow" and slow.split()[3:] == ["2.000", "2.000-3.000"]


@pytest.mark.gpu
def test_time_ms_does_not_count_host_latency_as_gpu_time():
    """A call whose host path takes 3 ms before it queues 4 ms of GPU work reads ~4 ms, as
    the GPU runs it (before the hold, one call per sample read ~7 ms); a call that is
    host-bound still reads at the host's rate."""
    spin = 4.0

    def slow_host_then_gpu():
        time.sleep(0.003)
        hold_stream(spin)

    def gpu_only():
        hold_stream(spin)

    def host_bound():
        time.sleep(0.002)
        torch.cuda._sleep(1000)

    gpu = time_ms(gpu_only, warmup=2, iters=5)
    assert time_ms(slow_host_then_gpu, warmup=2, iters=5) < gpu + 0.5
    assert time_ms(host_bound, warmup=2, iters=5) > 1.7


@pytest.mark.gpu
def test_time_flushed_call_reads_the_call_and_the_sm_clock():
    """A 2 ms spin reads ~2 ms (hold_stream's calibration drifts with the clock, hence the
    margins), and the clock read before it is a plausible SM clock."""
    from cute_flash.benchmarking import time_flushed_call

    ms, mhz = time_flushed_call(lambda: hold_stream(2.0), hold_ms=0.5)
    assert 300 < mhz < 3000
    assert 1.0 < ms < 4.0
