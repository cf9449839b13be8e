"""The tuner's CPU-side parts: candidates are valid configs, the YAML it writes loads back,
its state file survives an interrupted run, and the command refuses to run without a GPU."""

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from pathlib import Path

from cute_flash import tune
from cute_flash.config import BackwardTileConfig, default_config_dir, load_config_file, validate


REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_candidates_are_valid_and_distinct(head_dim):
    candidates = tune.forward_candidates("float16", head_dim)
    assert len(candidates) == len(set(candidates)) >= 4
    for config in candidates:
        validate("fwd", "float16", head_dim, config)


def test_forward_candidates_include_the_shipped_d64_tiles():
    """The tuner times the tiles the D = 64 forward entries ship, the short causal sequences'
    192 x 96 (fitted to 128 keys, with its fitted speed) among them (the fields set by hand
    aside: where O is rescaled, a softcap's key block)."""
    table = load_config_file(REPO / "configs" / "h100.yaml")
    candidates = tune.forward_candidates("bfloat16", 64)
    for seqlen in (1024, 8192):
        entry = table.lookup("bfloat16", 64, True, "fwd", seqlen=seqlen)
        assert dataclasses.replace(entry, rescale_before_pv=False, rescale_every_block=False,
                                   softcap_block_n=0) in candidates
    assert table.lookup("bfloat16", 64, True, "fwd", seqlen=1024).block_n == 96


@pytest.mark.parametrize("dtype, head_dim, causal, seqlen", [("bfloat16", 64, True, 1024), ("float16", 64, False, 8192),
                                                             ("bfloat16", 128, True, 8192), ("float16", 256, True, 8192)])
def test_forward_candidates_keep_the_entrys_hand_set_fields(dtype, head_dim, causal, seqlen):
    """Re-tuning an entry: the entry itself is the first candidate (so the min_gain rule can keep
    it), every tile carries its fields outside the searched space (a re-tune once dropped
    rescale_every_block and rescale_before_pv for their defaults), and each timed hand-set
    field is tried flipped on the entry."""
    table = load_config_file(REPO / "configs" / "h100.yaml")
    current = table.lookup(dtype, head_dim, causal, "fwd", seqlen=seqlen)
    candidates = tune.forward_candidates(dtype, head_dim, current=current)
    assert candidates[0] == current and len(candidates) == len(set(candidates))
    for config in candidates:
        validate("fwd", dtype, head_dim, config)
    carried = [f.name for f in dataclasses.fields(current) if f.name not in tune.SEARCHED_FWD_FIELDS]
    assert set(carried) >= set(tune.TOGGLED_FWD_FIELDS) | {"cluster_heads"}
    flipped = {name: dataclasses.replace(current, **{name: not getattr(current, name)}) for name in tune.TOGGLED_FWD_FIELDS}
    assert all(config in candidates for config in flipped.values())
    others = [c for c in candidates if c != current and c not in flipped.values()]
    assert len(others) >= 2 and all(getattr(c, name) == getattr(current, name) for c in others for name in carried)
    # Without an entry (a new head dim): the plain space, the dataclass's defaults.
    assert all(not c.rescale_every_block and c.cluster_heads == 1 for c in tune.forward_candidates(dtype, head_dim))


@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_forward_candidates_try_ping_pong_both_ways(head_dim):
    """Above D = 128 the shipped entries run without ping-pong where that won (causal D = 192,
    D = 256): the tuner must time both, on every key block (those too large for shared memory
    beside Q fail to compile and are skipped there)."""
    candidates = tune.forward_candidates("bfloat16", head_dim)
    assert len(candidates) == len(set(candidates))
    for config in candidates:
        validate("fwd", "bfloat16", head_dim, config)
    assert {(c.block_n, c.pingpong) for c in candidates} == {
        (n, pingpong) for n in (64, 80, 96, 112, 128) for pingpong in (True, False)}


@pytest.mark.parametrize("dtype, head_dim, causal", [("float16", 64, True), ("float16", 128, True),
                                                     ("bfloat16", 64, False)])
def test_backward_candidates_vary_the_current_entry(dtype, head_dim, causal):
    table = load_config_file(default_config_dir() / "h100.yaml")
    current = table.lookup(dtype, head_dim, causal, "bwd")
    candidates = tune.backward_candidates(current, dtype, head_dim)
    assert candidates[0] == dataclasses.replace(current, deterministic=False)
    assert len(candidates) == len(set(candidates)) >= 3
    for config in candidates:
        validate("bwd", dtype, head_dim, config)
        assert not config.deterministic  # the fast path is tuned; determinism is a user switch
    # FA3's 80-row step only where the swapped dQ GEMM can take it (D = 64 per warpgroup).
    assert any(c.block_m == 80 for c in candidates) == (head_dim == 128)
    assert {c.dq_stages for c in candidates} == {1, 2}
    assert {c.num_stages_pds for c in candidates} == {1, current.num_stages}
    assert {c.exps_above_dp_wait for c in candidates} == {True, False}
    # Half the exp2 columns pinned where the entry pins all, all where it pins part (8 of 32 in
    # the bf16 D = 64 non-causal entry); unpinned, no share.
    pinned = {c.pinned_exp_columns for c in candidates if c.exps_above_dp_wait}
    assert pinned == {0, current.pinned_exp_columns or current.block_m // 8}
    assert all(c.pinned_exp_columns == 0 for c in candidates if not c.exps_above_dp_wait)


def test_a_variant_with_another_step_keeps_a_fitted_pinned_share():
    """An entry pinning 16 of its 32 exp2 columns: a variant with the 80- or 64-row step pins
    the same share of its columns (16 of 16 would pin all of them), and steps without those
    columns (split_head_dim, grads_transposed) pin none (tune.pinned_share_fitted)."""
    base = BackwardTileConfig(block_m=128, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2,
                              num_mma_warpgroups=2, dq_atom_m=2, pinned_exp_columns=16)
    fitted = {name: tune.pinned_share_fitted(dataclasses.replace(base, **fields), base).pinned_exp_columns
              for name, fields in [("same", {}), ("80", dict(block_m=80, dq_atom_m=1, dq_swap_ab=True)),
                                   ("64", dict(block_m=64, dq_atom_m=1)), ("split", dict(block_m=64, split_head_dim=True)),
                                   ("transposed", dict(block_m=64, grads_transposed=True))]}
    assert fitted == {"same": 16, "80": 10, "64": 8, "split": 0, "transposed": 0}


@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_backward_candidates_try_both_ways_to_share_a_key_block(head_dim):
    table = load_config_file(default_config_dir() / "h100.yaml")
    current = table.lookup("bfloat16", head_dim, False, "bwd")
    candidates = tune.backward_candidates(current, "bfloat16", head_dim)
    assert candidates[0] == current
    for config in candidates:
        validate("bwd", "bfloat16", head_dim, config)
    assert any(c.split_head_dim for c in candidates)
    # 96 keys of transposed grads: D = 192 (the rule refuses no D that is a multiple of 64; at
    # 256 their tiles overflow shared memory, which the tuner's compile drops).
    assert any(c.grads_transposed and c.block_n == 96 and c.num_stages_do == 1 for c in candidates)
    assert current.grads_transposed == (head_dim == 192)


def test_rendered_yaml_loads_back_with_measurements(tmp_path):
    table = load_config_file(default_config_dir() / "h100.yaml")
    entries = []
    for i, (match, config, _) in enumerate(tune.merge_winners(table.entries, {})):
        measured = dict(ms=1.5 + i, shape="4x64x8192x128", candidates=8, correct=8) if i % 2 else None
        entries.append((match, config, measured))
    text = tune.render_yaml(table.gpu, entries, dict(date="2026-11-23", gpu="NVIDIA H100 80GB HBM3", iters=10))
    path = tmp_path / "h100.yaml"
    path.write_text(text)
    again = load_config_file(path)
    assert again.entries == table.entries and again.gpu == table.gpu


def test_a_rewritten_file_keeps_every_comment_where_it_was():
    """The shipped file's notes (why a field was set by hand, on what measurement) are YAML
    comments, which the loader drops: a re-tune writes them back in place (tune.entry_comments).
    Written with no winners, the file comes back line for line but for config lines that now
    name every field."""
    path = default_config_dir() / "h100.yaml"
    text = path.read_text()
    table = load_config_file(path)
    out = tune.render_yaml(table.gpu, tune.merge_winners(table.entries, {}), yaml.safe_load(text)["tuned"],
                           tune.entry_comments(text))
    kept = [line for line in out.splitlines() if not line.startswith("    config:")]
    assert kept == [line for line in text.splitlines() if not line.startswith("    config:")]
    assert sum(line.lstrip().startswith("#") for line in kept) > 100  # the notes, not a file without any


def test_a_retuned_entry_keeps_its_notes_under_a_line_that_says_so():
    text = """gpu: G
entries:
  # Group note of the two entries below.
  - match: {dtype: "float16", head_dim: 64, causal: true, direction: "fwd"}
    config: {block_m: 128, block_n: 128, num_stages: 2, num_mma_warpgroups: 2, pingpong: true}
    # Hand-set note.
    measured: {ms: 1.0}
  - match: {dtype: "float16", head_dim: 128, causal: true, direction: "fwd"}
    config: {block_m: 128, block_n: 128, num_stages: 2, num_mma_warpgroups: 2, pingpong: true}
  # Trailing note.
"""
    comments = tune.entry_comments(text)
    first = dict(dtype="float16", head_dim=64, causal=True, direction="fwd")
    second = dict(first, head_dim=128)
    assert comments[tune._comment_key(first)] == (["# Group note of the two entries below."], ["# Hand-set note."])
    assert comments[tune._comment_key(second)] == ([], []) and comments[None] == (["# Trailing note."], [])
    config = dict(block_m=128, block_n=128)
    out = tune.render_yaml("G", [(first, config, None), (second, config, None)], {}, comments,
                           {tune._comment_key(first): "# Re-tuned."}).splitlines()
    start = out.index("  # Group note of the two entries below.")
    assert out[start + 1].startswith("  - match:") and out[start + 2].startswith("    config:")
    assert out[start + 3:start + 5] == ["    # Re-tuned.", "    # Hand-set note."]
    assert out[-1] == "  # Trailing note."


def test_state_file_skips_a_line_cut_short(tmp_path):
    state = tmp_path / "state.jsonl"
    good = dict(key="float16/128/full/fwd", config="{}", status="ok", ms=1.0)
    state.write_text(json.dumps(good) + "\n" + '{"key": "float16/128/ca')
    assert tune._load_state(state) == {(good["key"], good["config"]): good}


def test_tune_without_gpu_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cute_flash", "tune", "--state", str(tmp_path / "s.jsonl")],
                          capture_output=True, text=True, cwd=REPO,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "needs an NVIDIA Hopper GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_measurements_of_untuned_entries_are_read_back_from_the_file():
    """A run that tunes some keys must not drop what earlier runs measured for the others
    (a bwd-only run once rewrote configs/h100.yaml without the forward's measurements)."""
    table = load_config_file(default_config_dir() / "h100.yaml")
    fwd = [e for e in table.entries if e.direction == "fwd"]
    assert fwd and all(e.measured and set(e.measured) >= {"ms", "shape"} for e in fwd)


def test_bwd_dq_is_not_a_tunable_direction(tmp_path):
    # Refused before anything touches the GPU or the output file.
    with pytest.raises(ValueError, match=r"cannot tune direction\(s\) \['bwd_dq'\]"):
        tune.tune(["fwd", "bwd_dq"], ["float16"], [128], [False], (1, 1, 128, 128), tmp_path / "o.yaml",
                  tmp_path / "s.jsonl", None, 1)
    assert not (tmp_path / "o.yaml").exists()


def test_winners_replace_their_seqlen_or_join_their_key():
    from cute_flash.config import ConfigEntry

    table = load_config_file(default_config_dir() / "h100.yaml")
    fwd = [e for e in table.entries if e.key() == ("float16", 128, False, "fwd", None)]
    assert [e.seqlen for e in fwd] == [4096, 8192]
    other = dataclasses.replace(fwd[0].config, pingpong=not fwd[0].config.pingpong)
    winners = {("float16", 128, False, "fwd", 8192, None): (other, {"ms": 1.0}),
               ("float16", 128, False, "fwd", 1024, None): (other, {"ms": 0.1})}
    rows = tune.merge_winners(table.entries, winners)
    mine = [(m.get("seqlen"), c, r) for m, c, r in rows
            if (m["dtype"], m["head_dim"], m["causal"], m["direction"]) == ("float16", 128, False, "fwd")]
    assert [(s, r) for s, _, r in mine] == [(4096, fwd[0].measured), (8192, {"ms": 1.0}), (1024, {"ms": 0.1})]
    assert mine[0][1] == dataclasses.asdict(fwd[0].config)  # the seqlen no winner names: kept
    assert all(c == dataclasses.asdict(other) for _, c, _ in mine[1:])
    assert len(rows) == len(table.entries) + 1  # one new entry, nothing lost
    # A key whose only entry names no seqlen: the winner takes it over and names its length.
    plain = ConfigEntry("float16", 64, True, "fwd", fwd[0].config)
    (row,) = tune.merge_winners([plain], {("float16", 64, True, "fwd", 4096, None): (other, None)})
    assert row[0]["seqlen"] == 4096 and row[1] == dataclasses.asdict(other)
    # A key the file has no entry for (a new head dim) gets one, after the others.
    rows = tune.merge_winners([plain], {("float16", 256, False, "fwd", 8192, None): (other, {"ms": 2.0})})
    assert [r[0]["head_dim"] for r in rows] == [64, 256] and rows[1][0]["seqlen"] == 8192
    # A pair of tiles is an entry of its own, its match naming the value tile.
    rows = tune.merge_winners([plain], {("float16", 192, False, "fwd", 8192, 128): (other, {"ms": 2.0})})
    assert rows[1][0] == dict(dtype="float16", head_dim=192, causal=False, direction="fwd", value_head_dim=128,
                              seqlen=8192)


def test_head_dim_pairs_parse_and_have_forward_candidates():
    assert tune.head_dim_pair("128") == (128, None) and tune.head_dim_pair("192:128") == (192, 128)
    assert tune.head_dim_pair("96:96") == (96, None)
    candidates = tune.forward_candidates("bfloat16", 192, 128)
    assert {c.block_n for c in candidates} == {64, 80, 96, 112, 128}
    assert tune.forward_candidates("bfloat16", 128, 192) == []  # a value tile is narrower than Q's


def test_a_backward_pair_of_tiles_keeps_the_transposed_grads_candidates():
    """tune --directions bwd --head-dims 192:128: the candidates around the square tile's entry
    that the kernel builds with a value tile of their own (transposed grads; the dO ring two
    deep among them), none of the split head dim's."""
    from cute_flash.config import default_config_dir, load_config_file

    square = load_config_file(default_config_dir() / "h100.yaml").lookup("bfloat16", 192, False, "bwd")
    candidates = tune.backward_candidates(square, "bfloat16", 192, 128)
    assert candidates and all(c.grads_transposed and not c.split_head_dim for c in candidates)
    assert {(c.num_stages, c.num_stages_do) for c in candidates} >= {(1, 1), (2, 1), (2, 2)}
    assert any(c.split_head_dim for c in tune.backward_candidates(square, "bfloat16", 192))


def test_a_tuning_run_keeps_hand_set_fields_and_notes(tmp_path, monkeypatch):
    """tune() end to end with the GPU parts stubbed: a candidate that beats the bf16 D = 64
    causal entry by more than min_gain replaces its tile, keeps its hand-set
    rescale_every_block, and the entry's notes stay under a line naming the change; the
    untouched entries come back as they were."""
    shipped = default_config_dir() / "h100.yaml"
    output = tmp_path / "h100.yaml"
    output.write_text(shipped.read_text())
    table = load_config_file(shipped)
    current = table.lookup("bfloat16", 64, True, "fwd", seqlen=1024)
    faster = dataclasses.replace(current, block_n=128, fitted_block_n=0, speed_over_fitted=1.24)  # the S = 8192 tile
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda: table.gpu)
    monkeypatch.setattr(tune, "prepare", lambda *args, **kwargs: (dict(status="ok", error=0.0), lambda: None))
    fastest = [faster]

    def timed(calls, iters, rounds):
        return {name: 1.0 if json.loads(name) == dataclasses.asdict(fastest[0]) else 2.0 for name in calls}
    monkeypatch.setattr(tune, "time_interleaved", timed)
    tune.tune(["fwd"], ["bfloat16"], [64], [True], (2, 32, 1024), output, tmp_path / "s.jsonl", None, 1, log=lambda _: None)
    again = load_config_file(output)
    assert again.lookup("bfloat16", 64, True, "fwd", seqlen=1024) == faster
    assert faster.rescale_every_block
    def others(entries):
        return [e for e in entries if (e.key(), e.seqlen) != (("bfloat16", 64, True, "fwd", None), 1024)]
    assert others(again.entries) == others(table.entries) and len(again.entries) == len(table.entries)
    lines = output.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  - match:") and '"bfloat16", head_dim: 64, causal: true'
              in line and "seqlen: 1024" in line)
    assert lines[at + 2].startswith("    # Re-tuned ") and "block_n 96" in lines[at + 2]
    assert lines[at + 3].startswith("    # rescale_every_block set by hand")
    # Tuned at a length the file has no entry for (its nearest, S = 1024, now the tile above
    # loses to the entry's old one): the winner joins as a new entry, without a "Re-tuned" line
    # (it replaced nothing), and the others keep their notes.
    fastest[0] = current
    tune.tune(["fwd"], ["bfloat16"], [64], [True], (2, 32, 2048), output, tmp_path / "s.jsonl", None, 1, log=lambda _: None)
    lines = output.read_text().splitlines()
    new = next(i for i, line in enumerate(lines) if line.startswith("  - match:") and '"bfloat16", head_dim: 64, causal: true'
               in line and "seqlen: 2048" in line)
    assert not lines[new + 2].lstrip().startswith("#") and sum("# Re-tuned" in line for line in lines) == 1
    assert load_config_file(output).lookup("bfloat16", 64, True, "fwd", seqlen=2048) == current


def test_an_entry_that_takes_a_seqlen_keeps_its_notes_and_no_other_entry_gets_them():
    """A key's only entry, naming no seqlen, is replaced by a winner tuned at 8192 and takes
    that seqlen (merge_winners): its notes follow it. Where such an entry stays beside the new
    one (the key has entries of several lengths), the new entry gets none of its notes."""
    from cute_flash.config import ConfigEntry, TileConfig

    base = TileConfig(128, 128, 2, 2, True)
    other = dataclasses.replace(base, pingpong=False)
    text = """gpu: G
entries:
  - match: {dtype: "float16", head_dim: 64, causal: true, direction: "fwd"}
    config: {block_m: 128, block_n: 128, num_stages: 2, num_mma_warpgroups: 2, pingpong: true}
    # Note of the entry without a seqlen.
"""
    comments = tune.entry_comments(text)
    only = [ConfigEntry("float16", 64, True, "fwd", base)]
    rows = tune.merge_winners(only, {("float16", 64, True, "fwd", 8192, None): (other, None)})
    out = tune.render_yaml("G", rows, {}, comments).splitlines()
    assert [line for line in out if "#" in line and "Tile configs" not in line] == [
        "    # Note of the entry without a seqlen."]
    assert "seqlen: 8192" in out[out.index("    # Note of the entry without a seqlen.") - 2]
    beside = only + [ConfigEntry("float16", 64, True, "fwd", base, seqlen=1024)]
    rows = tune.merge_winners(beside, {("float16", 64, True, "fwd", 8192, None): (other, None)})
    assert len(rows) == 3
    out = tune.render_yaml("G", rows, {}, comments).splitlines()
    assert sum("# Note of the entry without a seqlen." in line for line in out) == 1
