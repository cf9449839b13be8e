"""perf/seed_grid.py's tables and its --redraw path, on the CPU (no timing)."""

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

import seed_grid  # noqa: E402

FIELDS = ["date", "gpu", "dtype", "direction", "head_dim", "seqlen", "batch", "heads", "causal", "impl", "ms",
          "tflops", "note"]


def _row(impl, ms, seqlen=1024, head_dim=64, direction="fwd", dtype="bfloat16"):
    return dict(date="2026-11-30", gpu="GPU X", dtype=dtype, direction=direction, head_dim=head_dim, seqlen=seqlen,
                batch=1, heads=16, causal=True, impl=impl, ms=ms, tflops=round(1 / ms, 3) if ms else "",
                note="" if ms else "RuntimeError: refused")


def test_speedups_divide_the_fastest_peer_by_cute_flash_and_dash_what_did_not_run():
    rows = [_row("cute_flash", 2.0), _row("sdpa_cudnn", 3.0), _row("flash_attn_4", 2.5),
            _row("cute_flash", "", head_dim=128), _row("sdpa_cudnn", 1.0, head_dim=128),
            _row("cute_flash", 4.0, seqlen=2048), _row("sdpa_cudnn", "", seqlen=2048),
            _row("cute_flash", 1.0, seqlen=2048, head_dim=128), _row("sdpa_flash", 0.5, seqlen=2048, head_dim=128)]
    lines = seed_grid.speedups(rows)
    assert lines[0] == "### bfloat16 fwd: fastest peer's ms / cute_flash's (peer)"
    assert lines[2] == "| S | D = 64 | D = 128 |"
    # 2.5 / 2.0 against flash-attn-4, not cuDNN; cute_flash not run at D = 128: a dash.
    assert "| 1024 | 1.25 (flash_attn_4) | - |" in lines
    # No peer ran at D = 64; a slower cute_flash reads below 1.
    assert "| 2048 | - | 0.50 (sdpa_flash) |" in lines


def test_redraw_rewrites_the_markdown_from_the_csv(tmp_path, monkeypatch):
    rows = [_row("cute_flash", 2.0, direction=d) for d in ("fwd", "bwd")] + [
        _row("sdpa_cudnn", 4.0, direction=d) for d in ("fwd", "bwd")]
    with open(tmp_path / "grid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    read = seed_grid.read_rows(tmp_path / "grid.csv")
    assert read[0]["seqlen"] == 1024 and read[0]["head_dim"] == 64 and read[0]["ms"] == 2.0
    monkeypatch.setattr(sys, "argv", ["seed_grid.py", "--redraw", str(tmp_path)])
    assert seed_grid.main() == 0
    text = (tmp_path / "grid.md").read_text()
    assert "### bfloat16 bwd: fastest peer's ms / cute_flash's (peer)" in text
    assert "| 1024 | 2.00 (sdpa_cudnn) |" in text
    assert "| 1024 | 64 | 2.0 | 4.0 |" in text  # the times follow the speed-ups



def test_a_point_times_its_implementations_in_rotated_interleaved_rounds(monkeypatch):
    """measure_point, through peers.runnable_steps and interleaved_medians: every call built
    and tried first, then rounds in rotated order after one common hold, each one's ms the
    median of its rounds; a refusal (building the call, its trial call, or timing it in any
    round) is its note and it is not timed again; sdpa_math is skipped where its scores do not
    fit; the result keeps the implementations' order."""
    import peers
    import torch

    built, timed = [], []

    class Step:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            if self.name == "refuses its trial call":
                raise RuntimeError("no kernel for this head dim\nmore")

    def fake_timed_call(impl, layout, shape, dtype, direction):
        built.append((impl, layout))
        if impl == "refuses to build":
            raise RuntimeError("head dim not supported\nmore")
        return Step(impl)

    ms = {"ours": iter([3.0, 1.0, 2.0]), "peer": iter([5.0, 4.0, 6.0]), "second round fails": iter([7.0])}

    def fake_time_ms(step, warmup, iters, flush, hold_ms):
        timed.append((step.name, warmup, iters, hold_ms))
        if step.name == "second round fails" and len([t for t in timed if t[0] == step.name]) == 2:
            raise ValueError("out of memory")
        return next(ms[step.name])

    monkeypatch.setattr(seed_grid, "timed_call", fake_timed_call)
    monkeypatch.setattr(peers, "time_ms", fake_time_ms)
    monkeypatch.setattr(peers, "common_hold_ms", lambda steps: 0.25)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    impls = {"cute_flash": "ours", "sdpa_flash": ("bsnd", "peer"), "flash_attn_4": "refuses to build",
             "sdpa_cudnn": "refuses its trial call", "sdpa_efficient": "second round fails",
             "sdpa_math": "never built"}
    shape = (1, 16, 65536, 64)  # S x S scores far over MATH_MAX_BYTES
    results = seed_grid.measure_point(impls, shape, None, "fwd", rounds=3)
    assert list(results) == list(impls)
    assert results["cute_flash"] == (2.0, "") and results["sdpa_flash"] == (5.0, "")
    assert results["flash_attn_4"] == (None, "RuntimeError: head dim not supported")
    assert results["sdpa_cudnn"] == (None, "RuntimeError: no kernel for this head dim")
    assert results["sdpa_efficient"] == (None, "ValueError: out of memory")
    assert results["sdpa_math"] == (None, "S x S scores do not fit")
    assert ("peer", "bsnd") in built and all(impl != "never built" for impl, _ in built)
    # Rounds rotate the order of the three runnable ones; the failed one is not timed again.
    order = [name for name, _, _, _ in timed]
    assert order == ["ours", "peer", "second round fails", "peer", "second round fails", "ours", "ours", "peer"]
    # One hold for every sample, two warm-up calls before each round's samples; 5 samples from
    # S = 16384 spread over 3 rounds.
    assert {hold for _, _, _, hold in timed} == {0.25}
    assert {w for _, w, _, _ in timed} == {2}
    assert {i for _, _, i, _ in timed} == {2}


def test_host_bound_points_take_more_samples(monkeypatch):
    """Below S = 4096 (host-bound calls) each implementation gets 40 samples over the rounds,
    10 below S = 16384, 5 from there: the rounds' iters are those divided by the rounds,
    rounded up, at least 2."""
    import peers
    import torch

    assert [seed_grid.samples_per_point(s) for s in (128, 2048, 4096, 8192, 16384, 65536)] == [40, 40, 10, 10, 5, 5]
    iters = []
    monkeypatch.setattr(seed_grid, "timed_call", lambda impl, layout, shape, dtype, direction: (lambda: None))
    monkeypatch.setattr(peers, "time_ms", lambda step, **kw: iters.append(kw["iters"]) or 1.0)
    monkeypatch.setattr(peers, "common_hold_ms", lambda steps: 0.25)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for s, rounds, expected in ((1024, 3, 14), (1024, 5, 8), (8192, 3, 4), (32768, 3, 2)):
        iters.clear()
        seed_grid.measure_point({"cute_flash": "ours"}, (1, 16, s, 64), None, "fwd", rounds=rounds)
        assert iters == [expected] * rounds
