"""The benchmark suite's tables and the README headline update, on the CPU (no timing)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

import suite  # noqa: E402
import update_readme  # noqa: E402


def _row(impl, ms, direction="fwd", causal=False, point="seed", seqlen=8192):
    return dict(date="2026-11-23", gpu="GPU X", point=point, direction=direction, dtype="float16",
                head_dim=128, causal=causal, batch=4, heads=64, seqlen=seqlen, impl=impl,
                ms=ms, tflops=round(1000 / ms, 1) if ms != "" else "", pct_matmul="", note="")


def test_headline_has_one_table_per_direction_and_the_speedup_over_the_fastest_peer():
    rows = [_row("cute_flash", 10.0), _row("sdpa_cudnn", 12.0), _row("flash_attn_4", 11.0),
            _row("cute_flash", 40.0, "fwd_bwd"), _row("sdpa_cudnn", 36.0, "fwd_bwd"),
            _row("flash_attn_4", "", "fwd_bwd")]
    text = suite.headline(rows, 700.0)
    assert "GPU X" in text and "700 TFLOP/s" in text
    assert "**forward**" in text and "**forward + backward**" in text
    fwd_line = next(line for line in text.splitlines() if line.startswith("| 4x64x8192x128") and "10.000" in line)
    assert fwd_line.endswith("| 1.10× |")  # 11.0 / 10.0: the fastest peer, not cuDNN
    bwd_line = next(line for line in text.splitlines() if "40.000" in line)
    assert "| – |" in bwd_line and bwd_line.endswith("| 0.90× |")  # an untimed peer is a dash
    assert suite.headline([], 700.0) == ""


def test_summary_ignores_seed_points(capsys):
    rows = [_row("cute_flash", 10.0, point="seed"), _row("sdpa_cudnn", 20.0, point="seed"),
            _row("cute_flash", 10.0, point="sweep", seqlen=512), _row("sdpa_cudnn", 12.0, point="sweep", seqlen=512)]
    suite.summary(rows)
    assert "sdpa_cudnn 1.20x (1 pts)" in capsys.readouterr().out


def test_readme_headline_is_replaced_between_the_markers():
    readme = f"intro\n{update_readme.BEGIN}\nold table\n{update_readme.END}\nrest\n"
    new = update_readme.replace_headline(readme, "| new |\n", "perf/results/x")
    assert "old table" not in new and "| new |" in new
    assert new.startswith("intro\n") and new.endswith(f"{update_readme.END}\nrest\n")
    assert "perf/results/x/headline.md" in new
    assert update_readme.replace_headline(new, "| newer |", "y").count(update_readme.BEGIN) == 1


def test_readme_without_markers_is_refused():
    with pytest.raises(ValueError, match="headline:begin"):
        update_readme.replace_headline("no markers here", "| t |", "x")


def test_shipped_readme_has_the_headline_markers():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert update_readme.BEGIN in text and update_readme.END in text


def test_a_run_writes_the_csv_the_sweep_table_and_the_headline(tmp_path, monkeypatch):
    """The whole main() with the GPU parts replaced: seed cases first, then the sweep."""
    monkeypatch.setattr(suite.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(suite.torch.cuda, "get_device_name", lambda: "GPU X")
    monkeypatch.setattr(suite, "matmul_tflops", lambda: (1.0, 700.0))
    monkeypatch.setattr(suite, "implementations", lambda causal, dtype: {"cute_flash": None, "peer": None})
    measured = []

    def fake_measure(name, impl, shape, dtype, causal, direction, iters):
        measured.append((name, shape, direction))
        return (1.0 if name == "cute_flash" else 2.0), ""

    monkeypatch.setattr(suite, "measure_point", fake_measure)
    monkeypatch.setattr(sys, "argv", ["suite.py", "--out", str(tmp_path), "--seqlens", "1024", "--head-dims", "128",
                                      "--dtypes", "float16", "--causal", "0", "--directions", "fwd_bwd"])
    assert suite.main() == 0
    seed_shapes = [(1, 64, 1024, 128), (2, 64, 4096, 128), (4, 64, 8192, 128)]
    assert [m[1] for m in measured[::2]] == seed_shapes * 2 + [(32, 16, 1024, 128)]
    rows = (tmp_path / "suite.csv").read_text().splitlines()
    assert rows[0].startswith("date,gpu,point,") and len(rows) == 1 + 2 * 7
    headline = (tmp_path / "headline.md").read_text()
    assert "**forward**" in headline and "**forward + backward**" in headline and headline.count("2.00×") == 6
    assert "| fwd_bwd | float16 | 128 | False | 1024 |" in (tmp_path / "suite.md").read_text()


def test_seed_cases_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(suite.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(suite.torch.cuda, "get_device_name", lambda: "GPU X")
    monkeypatch.setattr(suite, "matmul_tflops", lambda: (1.0, 700.0))
    monkeypatch.setattr(suite, "implementations", lambda causal, dtype: {"cute_flash": None})
    monkeypatch.setattr(suite, "measure_point", lambda *a: (1.0, ""))
    monkeypatch.setattr(sys, "argv", ["suite.py", "--out", str(tmp_path), "--seqlens", "none"])
    assert suite.main() == 0
    rows = (tmp_path / "suite.csv").read_text().splitlines()[1:]
    assert len(rows) == 3 * 2 * 2 and all(",seed," in r for r in rows)  # cases x causal x directions
