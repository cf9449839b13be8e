"""The bench command's table on the CPU, and one real run on the GPU."""

import csv

import pytest
import torch

from cute_flash import bench
from cute_flash.test_cases import Case


def row(case, causal, impl, ms, speedup):
    return dict(case=case, causal=causal, impl=impl, ms=ms, tflops=100.0, pct_matmul=13.0,
                cute_flash_speedup=speedup)


def test_table_has_one_line_per_case_and_a_column_per_peer():
    rows = [row("1x1x128x64", False, "cute_flash", 1.0, 1.0), row("1x1x128x64", False, "sdpa_cudnn", 1.5, 1.5),
            row("1x1x128x64", True, "cute_flash", 0.5, 1.0)]
    lines = bench.format_table(rows).splitlines()
    assert len(lines) == 3 and "sdpa_cudnn ms" in lines[0]
    assert "1.50x" in lines[1] and lines[2].rstrip().endswith("-")
    assert bench.format_table([]) == "(no measurements)"


@pytest.mark.gpu
def test_bench_checks_times_and_writes_csv(tmp_path):
    rows = bench.run_bench([Case(1, 2, 300, 64)], [False, True], torch.float16, tmp_path, warmup=1, iters=3,
                           log=lambda _: None)
    assert rows is not None
    with open(tmp_path / "bench.csv") as f:
        written = list(csv.DictReader(f))
    assert {r["impl"] for r in written} >= {"cute_flash", "sdpa_flash"}
    assert all(float(r["ms"]) > 0 for r in written)
