"""`python -m cute_flash precompile` on the CPU: which kernel sets a YAML selects, and a real
fill of the disk cache from a one-entry YAML (compiles for sm_90a without a GPU)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cute_flash.config import default_config_dir, load_config_file, rows_fitted
from cute_flash.kernels.rules import FLOAT32_INPUTS
from cute_flash.precompile import tasks_for, tasks_of_dtypes


def test_every_shipped_entry_is_a_task_once():
    table = load_config_file(default_config_dir() / "h100.yaml")
    tasks = tasks_for(table)
    fwd = [e for e in table.entries if e.direction == "fwd" and e.dtype not in FLOAT32_INPUTS
           and e.value_head_dim is None]
    pairs = [e for e in table.entries if e.value_head_dim is not None and e.direction == "fwd"]  # the dense forward
    bwd_pairs = [e for e in table.entries if e.value_head_dim is not None and e.direction == "bwd"]
    fwd32 = [e for e in table.entries if e.direction == "fwd" and e.dtype in FLOAT32_INPUTS
             and e.value_head_dim is None]
    bwd = [e for e in table.entries if e.direction == "bwd" and e.dtype not in FLOAT32_INPUTS]
    separate = [e for e in table.entries if e.direction == "bwd_dq" and e.config.min_seqlen_q > 0
                and e.dtype not in FLOAT32_INPUTS]
    # float32's backward (TF32 and the scaled halves): its dK / dV kernel with the dQ kernel
    # (one set) and its operand pass.
    bwd32 = [e for e in table.entries if e.direction == "bwd" and e.dtype in FLOAT32_INPUTS]
    helpers = {(e.dtype, e.head_dim) for e in fwd}  # the KV cache's append and merge kernels
    # float32's operand pass (and the scaled halves' value chunks': a pair of tiles).
    operands = {(e.dtype, e.head_dim) for e in fwd32 + [e for e in pairs if e.dtype in FLOAT32_INPUTS]}
    # Entries with clusters of query heads: their grouped prefill over a KV cache (the one
    # precompiled problem that takes clusters) also with them.
    clustered = [e for e in fwd if e.config.cluster_heads > 1 and e.causal]
    assert clustered, "the shipped file has clusters of heads"
    assert fwd32, "the shipped file has float32 entries"
    assert pairs, "the shipped file has pairs of tiles"
    assert bwd32, "the shipped file has float32 backward entries"
    # Per entry its tile, and for a causal one its grouped prefill over a KV cache; per distinct
    # decode tile (config.rows_fitted: entries of other sequence lengths may share one) the
    # decode step, flash_attention's split one, and for a non-causal one the step over a cache,
    # whole and split.
    decode = {(e.dtype, e.head_dim, e.causal, dataclasses.replace(rows_fitted(e.config, 1), cluster_heads=1))
              for e in fwd}
    non_causal_decode = [d for d in decode if not d[2]]
    causal = [e for e in fwd if e.causal]
    # Entries with speed_over_fitted: the two-warpgroup tile config.grid_fitted runs on small
    # grids, where no other entry of the key has it already (D = 128's S = 4096 entries do).
    one = lambda config: dataclasses.replace(config, cluster_heads=1)  # noqa: E731
    grid_fitted = {(e.dtype, e.head_dim, e.causal, one(rows_fitted(e.config, 128))) for e in fwd
                   if e.config.speed_over_fitted} - {(e.dtype, e.head_dim, e.causal, one(e.config)) for e in fwd}
    assert grid_fitted, "the shipped file has entries fitted to the grid whose tile no entry has"
    # A causal forward with Sq = Sk runs bottom-right (tiles aligned to the last query,
    # AttentionProblem.end_aligned): each causal 16-bit tile, fitted or not, once more.
    end_aligned = len(causal) + len([t for t in grid_fitted if t[2]])
    assert end_aligned and any(t.problem.bottom_right and t.problem.causal and not t.problem.cached_keys
                               and not t.problem.split_keys for t in tasks)
    # A backward grid run as one launch runs its entry with fused_preprocess and fused_postprocess
    # (config.one_launch_config): each 16-bit entry whose head dim takes them, once more.
    one_launch = [e for e in bwd if e.value_head_dim is None and 512 % e.head_dim == 0 and e.head_dim <= 128]
    assert one_launch and sum("in-kernel preprocess in-kernel postprocess" in t.label() and t.dq_config is None
                            for t in tasks) == len(one_launch)
    assert len(tasks) == (len(fwd) + len(causal) + 2 * len(decode) + 2 * len(non_causal_decode) + len(clustered)
                          + len(grid_fitted) + end_aligned + len(one_launch)
                          + 2 * len(bwd)
                          + len(separate) + len(helpers)
                          + len(fwd32) + len(operands) + len(pairs) + len(bwd32)
                          + len({(e.dtype, e.head_dim) for e in bwd32}))
    assert all(t.dq_config is not None for t in tasks if t.direction == "bwd" and t.dtype in FLOAT32_INPUTS)
    assert bwd_pairs, "the shipped file has backward pairs of tiles"
    for direction, entries in (("fwd", pairs), ("bwd", bwd_pairs)):
        assert {(t.head_dim, t.value_head_dim, t.tiles) for t in tasks if t.value_head_dim and t.direction == direction
                } == {(e.head_dim, e.value_head_dim, (e.head_dim, e.value_head_dim)) for e in entries}
    # float32: the dense forward and its operand pass; KV caches take 16-bit dtypes only.
    float32_tasks = [t for t in tasks if t.dtype in FLOAT32_INPUTS]
    assert not any(t.problem.cached_keys or t.direction == "kvcache" for t in float32_tasks)
    assert {(t.dtype, t.head_dim) for t in float32_tasks
            if t.direction in ("tf32-operands", "halves-operands")} == operands
    assert any(t.direction == "halves-operands" for t in float32_tasks), "the shipped file has scaled halves"
    assert len(set(tasks)) == len(tasks)
    # The entries' configs, the decode steps' fitted to a group's rows (one warpgroup), and the
    # grids' fitted two-warpgroup tiles.
    assert {t.config for t in tasks if t.direction == "fwd"} == (
        {one(e.config) for e in fwd + fwd32 + pairs} | {one(rows_fitted(e.config, 1)) for e in fwd}
        | {e.config for e in clustered} | {g[3] for g in grid_fitted})
    assert all(t.problem.grouped and t.problem.cached_keys for t in tasks
               if t.direction == "fwd" and t.config.cluster_heads > 1)
    # Each fwd entry's forward over a KV cache: the decode step (non-causal; whole and in split
    # parts) or a grouped prefill.
    cached = [t for t in tasks if t.direction == "fwd" and t.problem.cached_keys]
    assert len(cached) == len(causal) + 2 * len(non_causal_decode) + len(clustered)
    # ... and flash_attention's split decode step over a dense batch's keys.
    dense_split = [t for t in tasks if t.direction == "fwd" and t.problem.split_keys and not t.problem.cached_keys]
    assert len(dense_split) == len(decode)
    assert all(t.problem.grouped == t.problem.causal for t in cached if not t.problem.split_keys)
    assert sum(t.problem.split_keys for t in cached) == len(non_causal_decode)
    decode = [t for t in cached if not t.problem.causal] + dense_split
    assert all(t.config.num_mma_warpgroups == 1 for t in decode)
    # Both backward variants that torch.use_deterministic_algorithms can pick.
    assert sum(t.config.deterministic for t in tasks if t.direction == "bwd") == len(bwd)
    assert {(t.dtype, t.head_dim) for t in tasks if t.direction in ("tf32-bwd-operands", "halves-bwd-operands")
            } == {(e.dtype, e.head_dim) for e in bwd32}
    assert any(t.direction == "halves-bwd-operands" for t in tasks), "the shipped file has the halves' backward"


ONE_ENTRY = """\
gpu: test
entries:
  - match: {dtype: "float16", head_dim: 64, causal: true, direction: "fwd"}
    config: {block_m: 128, block_n: 128, num_stages: 2, num_mma_warpgroups: 2, pingpong: true}
"""


def test_dtypes_select_their_kernel_sets():
    """precompile --dtypes: only those dtypes' sets (what a GPU run of one dtype's tests needs
    first), and an unknown dtype named with those the file has."""
    tasks = tasks_for(load_config_file(default_config_dir() / "h100.yaml"))
    chosen = tasks_of_dtypes(tasks, ["float32x3h", "float32x3"])
    assert chosen and {t.dtype for t in chosen} == {"float32x3h", "float32x3"}
    assert chosen == [t for t in tasks if t.dtype in ("float32x3h", "float32x3")]
    assert tasks_of_dtypes(tasks, None) is tasks
    with pytest.raises(ValueError, match=r"no kernel set of dtype 'float64' \(the file has bfloat16, float16"):
        tasks_of_dtypes(tasks, ["float64"])


def _precompile(tmp_path, env_extra):
    import os

    env = dict(os.environ, CUTE_FLASH_CONFIG_DIR=str(tmp_path / "configs"),
               CUTE_FLASH_CACHE_DIR=str(tmp_path / "cache"), **env_extra)
    env.pop("CUTE_FLASH_DISK_CACHE", None)
    return subprocess.run([sys.executable, "-m", "cute_flash", "precompile", "--gpu", "tiny", "--jobs", "1"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_precompile_fills_the_cache_then_finds_it_there(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text(ONE_ENTRY)
    first = _precompile(tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert first.returncode == 0, first.stderr
    assert "fwd float16 D=64 causal: compiled 1" in first.stderr
    assert "fwd float16 D=64 causal end-aligned: compiled 1" in first.stderr  # Sq = Sk
    assert "fwd float16 D=64 causal KV cache: compiled 1" in first.stderr
    assert "kvcache append+merge float16 D=64: compiled 2" in first.stderr
    # flash_attention's split decode, and its decode steps without split, on one warpgroup
    assert "fwd float16 D=64 causal split one warpgroup: compiled 1" in first.stderr
    assert "fwd float16 D=64 causal one warpgroup: compiled 1" in first.stderr
    objects = list(Path(tmp_path / "cache").rglob("*.o"))
    assert len(objects) == 7
    second = _precompile(tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert second.returncode == 0, second.stderr
    assert "fwd float16 D=64 causal: cached" in second.stderr
    assert "0 kernels compiled" in second.stderr


def test_precompile_names_the_configs_it_has(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "h100.yaml").write_text(ONE_ENTRY)
    result = _precompile(tmp_path, {})
    assert result.returncode == 1
    assert "tiny.yaml" in result.stderr and "configs here: h100" in result.stderr
