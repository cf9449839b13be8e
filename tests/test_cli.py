"""The main job's command line without a GPU: a one-line message, a non-zero exit, no
traceback."""

import os
import subprocess
import sys
from pathlib import Path

from cute_flash import __main__ as cli

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, env_extra=None):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "cute_flash", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bench_without_gpu_says_so_and_exits_2():
    proc = run_cli("bench")
    assert proc.returncode == cli.EXIT_NO_GPU == 2
    assert "needs an NVIDIA Hopper GPU (compute capability 9.x)" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_case_file_is_reported_without_traceback(tmp_path):
    bad = tmp_path / "cases.txt"
    bad.write_text("1 2 3\n")
    proc = run_cli("bench", "--cases", str(bad))
    assert proc.returncode == 1
    assert f"{bad}:1: expected 4 integers" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_usage_error_exits_2():
    proc = run_cli("frobnicate")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_non_hopper_gpu_is_refused_in_process(monkeypatch, capsys):
    from cute_flash import bench

    monkeypatch.setattr(bench, "hopper_problem", lambda: "found NVIDIA A100 with compute capability 8.0")
    assert cli.main(["bench"]) == 2
    assert "found NVIDIA A100 with compute capability 8.0" in capsys.readouterr().err
