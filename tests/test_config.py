"""Loading the YAML tile configs, on the CPU: the shipped file, each kind of bad file, and the
rule that picks a file for a device."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from cute_flash.config import (
    BackwardTileConfig,
    ConfigError,
    SeparateDqConfig,
    TileConfig,
    config_path_for_device,
    default_config_dir,
    load_config_file,
    rows_fitted,
)
from cute_flash.kernels import rules

SHIPPED = default_config_dir() / "h100.yaml"
GOOD_CONFIG = dict(block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2, pingpong=True,
                   rescale_before_pv=False)
GOOD_MATCH = dict(dtype="float16", head_dim=128, causal=False, direction="fwd")


def write(tmp_path, data, name="gpu.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def one_entry(match=None, config=None, **extra):
    entry = dict(match=dict(GOOD_MATCH, **(match or {})), config=dict(GOOD_CONFIG, **(config or {})), **extra)
    return dict(gpu="test GPU", entries=[entry])


def test_shipped_file_covers_every_key_of_both_directions():
    table = load_config_file(SHIPPED)
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128):
            for causal in (False, True):
                config = table.lookup(dtype, head_dim, causal, "fwd")
                assert isinstance(config, TileConfig)
                assert config.block_m == 64 * config.num_mma_warpgroups
                assert isinstance(table.lookup(dtype, head_dim, causal, "bwd"), BackwardTileConfig)
                assert isinstance(table.lookup(dtype, head_dim, causal, "bwd_dq"), SeparateDqConfig)


def test_separate_dq_entries(tmp_path):
    dq = dict(min_seqlen_q=65536, block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2)
    data = dict(gpu="g", entries=[dict(match=dict(GOOD_MATCH, direction="bwd_dq"), config=dq)])
    config = load_config_file(write(tmp_path, data)).lookup("float16", 128, False, "bwd_dq")
    assert config == SeparateDqConfig(**dq)
    assert config.applies(131072) and config.applies(65536) and not config.applies(65535)
    assert not dataclasses.replace(config, min_seqlen_q=0).applies(131072)  # 0: never
    for bad, words in [(dict(block_m=192, num_mma_warpgroups=3), "num_mma_warpgroups"),
                       (dict(block_m=64), r"block_m \(64\) must equal 64 x num_mma_warpgroups \(2\)"),
                       (dict(min_seqlen_q=-1), "min_seqlen_q"), (dict(block_n=256), "block_n")]:
        data["entries"][0]["config"] = dict(dq, **bad)
        with pytest.raises(ConfigError, match=words):
            load_config_file(write(tmp_path, data))


def test_a_file_without_bwd_dq_entries_never_separates_dq(tmp_path):
    table = load_config_file(write(tmp_path, one_entry()))
    assert table.lookup("float16", 128, False, "bwd_dq", required=False) is None
    with pytest.raises(ConfigError, match="direction=bwd_dq"):
        table.lookup("float16", 128, False, "bwd_dq")


def test_backward_entries_use_the_backward_fields(tmp_path):
    bwd = dict(block_m=64, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1,
               deterministic=False, dq_swap_ab=False, dv_after_ds=False, dq_stages=1, fused_preprocess=False,
               split_head_dim=False, grads_transposed=False)
    data = dict(gpu="g", entries=[dict(match=dict(GOOD_MATCH, direction="bwd"), config=bwd)])
    assert load_config_file(write(tmp_path, data)).lookup("float16", 128, False, "bwd") == BackwardTileConfig(**bwd)
    data["entries"][0]["config"] = dict(bwd, block_m=128)  # needs dq_atom_m 2
    with pytest.raises(ConfigError, match=r"block_m \(128\) must equal 64 x dq_atom_m \(1\)"):
        load_config_file(write(tmp_path, data))
    # A block of 80 query rows needs the swapped dQ GEMM.
    data["entries"][0]["config"] = dict(bwd, block_m=80)
    with pytest.raises(ConfigError, match="key 'block_m' must be 64 or 128"):
        load_config_file(write(tmp_path, data))
    data["entries"][0]["config"] = dict(bwd, block_m=128, dq_atom_m=2, dq_swap_ab=True)
    with pytest.raises(ConfigError, match="dq_swap_ab needs dq_atom_m 1"):
        load_config_file(write(tmp_path, data))
    # Each consumer warpgroup's S^T is one 64-key WGMMA tile.
    data["entries"][0]["config"] = dict(bwd, block_n=64)
    with pytest.raises(ConfigError, match=r"block_n \(64\) must equal 64 x num_mma_warpgroups \(2\)"):
        load_config_file(write(tmp_path, data))
    data["entries"][0]["config"] = dict(bwd, dq_stages=2, num_mma_warpgroups=3, block_n=192)
    with pytest.raises(ConfigError, match="dq_stages x num_mma_warpgroups must be at most 5"):
        load_config_file(write(tmp_path, data))
    data["entries"][0]["config"] = dict(bwd, dq_stages=3)
    with pytest.raises(ConfigError, match="key 'dq_stages' must be 1 or 2"):
        load_config_file(write(tmp_path, data))
    data["entries"][0]["config"] = dict(bwd, dq_stages=2)
    assert load_config_file(write(tmp_path, data)).lookup("float16", 128, False, "bwd").dq_stages == 2
    swapped = dict(bwd, block_m=80, dq_swap_ab=True, dv_after_ds=True, fused_preprocess=True)
    data["entries"][0]["config"] = swapped
    assert load_config_file(write(tmp_path, data)).lookup("float16", 128, False, "bwd").block_m == 80
    data["entries"][0]["config"] = GOOD_CONFIG  # forward fields under a bwd key
    with pytest.raises(ConfigError, match="unknown key 'pingpong'"):
        load_config_file(write(tmp_path, data))
    # Switches of deleted kernel paths are unknown keys now.
    for gone in ("mma_dkv_from_registers", "dq_writer_warp", "dq_red_vector"):
        data["entries"][0]["config"] = dict(bwd, **{gone: True if gone != "dq_red_vector" else 2})
        with pytest.raises(ConfigError, match=f"unknown key '{gone}'"):
            load_config_file(write(tmp_path, data))


def test_good_file_round_trips(tmp_path):
    table = load_config_file(write(tmp_path, one_entry(measured={"ms": 1.0})))
    assert table.gpu == "test GPU"
    assert table.lookup("float16", 128, False, "fwd") == TileConfig(**GOOD_CONFIG)


@pytest.mark.parametrize("data, words", [
    (one_entry(config={"block_k": 64}), ["entries[0].config", "unknown key 'block_k'"]),
    (one_entry(config={"persistent": False}), ["unknown key 'persistent'"]),  # deleted switches
    (one_entry(config={"intra_wg_overlap": True}), ["unknown key 'intra_wg_overlap'"]),
    (one_entry(match={"sm": 90}), ["entries[0].match", "unknown key 'sm'"]),
    ({"gpu": "x", "entries": [], "extra": 1}, ["unknown key 'extra'"]),
    ({"entries": []}, ["missing key 'gpu'"]),
    (one_entry(), None),  # placeholder replaced below: missing config key
    (one_entry(config={"block_m": 100}), ["key 'block_m' must be a multiple of 64", "100"]),
    (one_entry(config={"block_n": 0}), ["key 'block_n'", "0"]),
    (one_entry(config={"num_stages": 9}), ["key 'num_stages' must be in [1, 4]", "9"]),
    (one_entry(config={"block_m": "128"}), ["key 'block_m' must be int", "'128'"]),
    (one_entry(config={"pingpong": 1}), ["key 'pingpong' must be bool", "1"]),
    (one_entry(config={"block_m": True}), ["key 'block_m' must be int", "True"]),
    (one_entry(config={"speed_over_fitted": True}), ["key 'speed_over_fitted' must be float", "True"]),
    (one_entry(config={"speed_over_fitted": "1.03"}), ["key 'speed_over_fitted' must be float", "'1.03'"]),
    (one_entry(config={"block_m": 192}), ["block_m (192) must equal 64 x num_mma_warpgroups (2)"]),
    (one_entry(match={"dtype": "float64"}), ["key 'dtype' must be one of", "'float64'"]),
    (one_entry(match={"direction": "sideways"}), ["key 'direction'", "'sideways'"]),
    (one_entry(match={"causal": "yes"}), ["key 'causal' must be bool", "'yes'"]),
    ({"gpu": "x", "entries": {"a": 1}}, ["key 'entries' must be a list"]),
    ("gpu: [unclosed\n", ["not valid YAML"]),
    ("- just\n- a list\n", ["expected a mapping"]),
])
def test_bad_file_names_file_and_key(tmp_path, data, words):
    if words is None:
        del data["entries"][0]["config"]["num_stages"]
        words = ["entries[0].config", "missing key 'num_stages'"]
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_duplicate_entries_are_rejected(tmp_path):
    data = one_entry()
    data["entries"].append(data["entries"][0])
    with pytest.raises(ConfigError, match="duplicate entry"):
        load_config_file(write(tmp_path, data))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config_file(tmp_path / "absent.yaml")


def test_lookup_without_entry_names_the_key(tmp_path):
    table = load_config_file(write(tmp_path, one_entry()))
    with pytest.raises(ConfigError, match=r"no entry for dtype=bfloat16, head_dim=64, causal=True, direction=fwd"):
        table.lookup("bfloat16", 64, True, "fwd")


def test_every_config_field_is_checked_for_presence(tmp_path):
    required = [f for f in dataclasses.fields(TileConfig) if f.default is dataclasses.MISSING]
    assert len(required) >= 5
    for field in required:
        data = one_entry()
        del data["entries"][0]["config"][field.name]
        with pytest.raises(ConfigError, match=f"missing key '{field.name}'"):
            load_config_file(write(tmp_path, data))


def test_a_field_with_a_default_may_be_left_out(tmp_path):
    """A file written before a field existed (rescale_before_pv) still loads, with the
    field's default; given, the field is read and type-checked like the others."""
    data = one_entry()
    del data["entries"][0]["config"]["rescale_before_pv"]
    assert load_config_file(write(tmp_path, data)).lookup("float16", 128, False, "fwd").rescale_before_pv is False
    data["entries"][0]["config"]["rescale_before_pv"] = True
    assert load_config_file(write(tmp_path, data)).lookup("float16", 128, False, "fwd").rescale_before_pv is True
    data["entries"][0]["config"]["rescale_before_pv"] = 1
    with pytest.raises(ConfigError, match="key 'rescale_before_pv' must be bool"):
        load_config_file(write(tmp_path, data))


def test_device_rule(tmp_path):
    (tmp_path / "h100.yaml").write_text("")
    (tmp_path / "h200.yaml").write_text("")
    assert config_path_for_device("NVIDIA H100 80GB HBM3", (9, 0), tmp_path).name == "h100.yaml"
    assert config_path_for_device("NVIDIA H200", (9, 0), tmp_path).name == "h200.yaml"
    # Other Hopper parts without a file of their own use the documented default.
    assert config_path_for_device("NVIDIA H800 PCIe", (9, 0), tmp_path).name == "h100.yaml"
    assert config_path_for_device("NVIDIA GH200 480GB", (9, 0), tmp_path).name == "h100.yaml"
    with pytest.raises(ConfigError, match=r"NVIDIA A100.*compute capability 8\.0.*Hopper"):
        config_path_for_device("NVIDIA A100-SXM4-80GB", (8, 0), tmp_path)


def test_config_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CONFIG_DIR", str(tmp_path))
    assert default_config_dir() == tmp_path


def test_nearest_tuned_seqlen_is_selected(tmp_path):
    """The documented rule: nearest tuned seqlen in log2, ties to the longer; an entry without
    seqlen only when no entry of the key names one."""
    def entry(seqlen, block_n):
        match = dict(GOOD_MATCH, **({"seqlen": seqlen} if seqlen else {}))
        return dict(match=match, config=dict(GOOD_CONFIG, block_n=block_n))

    data = dict(gpu="g", entries=[entry(None, 16), entry(1024, 32), entry(8192, 64)])
    table = load_config_file(write(tmp_path, data))
    pick = lambda s: table.lookup("float16", 128, False, "fwd", seqlen=s).block_n  # noqa: E731
    assert [pick(s) for s in (1, 512, 1024, 2048, 2896, 2897, 8192, 131072)] == [
        32, 32, 32, 32, 32, 64, 64, 64]  # 2896.3 = sqrt(1024 * 8192) is the midpoint
    assert pick(None) == 64  # length unknown: the longest tuned entry
    tie = load_config_file(write(tmp_path, dict(gpu="g", entries=[entry(1024, 32), entry(4096, 64)])))
    assert tie.lookup("float16", 128, False, "fwd", seqlen=2048).block_n == 64  # a tie goes to the longer
    only_default = load_config_file(write(tmp_path, dict(gpu="g", entries=[entry(None, 16)])))
    assert only_default.lookup("float16", 128, False, "fwd", seqlen=777).block_n == 16
    data["entries"].append(entry(1024, 48))
    with pytest.raises(ConfigError, match="duplicate entry .* at seqlen 1024"):
        load_config_file(write(tmp_path, data))
    data["entries"][-1] = entry(0, 48)
    data["entries"][-1]["match"]["seqlen"] = 0
    with pytest.raises(ConfigError, match="'seqlen' must be >= 1"):
        load_config_file(write(tmp_path, data))


def test_get_config_selects_by_the_longer_of_sq_and_sk(tmp_path, monkeypatch):
    """get_config applies the rule to S = max(Sq, Sk), and answers repeated calls the same."""
    from cute_flash import config as config_module

    def entry(seqlen, block_n):
        return dict(match=dict(GOOD_MATCH, seqlen=seqlen), config=dict(GOOD_CONFIG, block_n=block_n))

    table = load_config_file(write(tmp_path, dict(gpu="g", entries=[entry(1024, 32), entry(8192, 64)])))
    monkeypatch.setattr(config_module, "_device_tables", {None: table})
    monkeypatch.setattr(config_module, "_lookups", {})
    pick = lambda seqlens: config_module.get_config(  # noqa: E731
        "float16", 128, False, "fwd", device=None, seqlens=seqlens).block_n
    assert pick((1024, 8192)) == 64 and pick((8192, 1024)) == 64 and pick((1024, 17)) == 32
    assert pick((1024, 17)) == 32 and pick(None) == 64


def test_config_dir_lookup_order(tmp_path, monkeypatch):
    """CUTE_FLASH_CONFIG_DIR, else the package's configs/ (a wheel install), else the top-level
    configs/ beside the package (a source checkout: editable install or PYTHONPATH)."""
    from cute_flash import config as config_module

    site = tmp_path.resolve() / "site"
    (site / "cute_flash").mkdir(parents=True)
    monkeypatch.setattr(config_module, "__file__", str(site / "cute_flash" / "config.py"))
    monkeypatch.delenv("CUTE_FLASH_CONFIG_DIR", raising=False)
    assert default_config_dir() == site / "configs"
    (site / "cute_flash" / "configs").mkdir()
    assert default_config_dir() == site / "cute_flash" / "configs"
    monkeypatch.setenv("CUTE_FLASH_CONFIG_DIR", str(tmp_path / "mine"))
    assert default_config_dir() == tmp_path / "mine"


def test_checkout_uses_its_top_level_configs(monkeypatch):
    """The top-level configs/ is the one copy in the repository (the wheel's is built from it):
    nothing inside the package shadows it."""
    import cute_flash

    repo = Path(__file__).resolve().parent.parent
    assert not (repo / "cute_flash" / "configs").exists()
    if Path(cute_flash.__file__).resolve().parent == repo / "cute_flash":  # imported from this checkout
        monkeypatch.delenv("CUTE_FLASH_CONFIG_DIR", raising=False)
        assert default_config_dir() == repo / "configs"


def test_selection_is_logged_once_per_key(monkeypatch, caplog):
    import logging

    import torch

    from cute_flash import config

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(config, "_lookups", {})
    monkeypatch.setattr(config, "_device_tables", {})
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="cute_flash"):
        for _ in range(3):
            config.get_config("float16", 128, True, "fwd", device, seqlens=(1000, 1000))
    messages = [r.getMessage() for r in caplog.records if r.name == "cute_flash.config"]
    assert len(messages) == 1, messages
    assert "h100.yaml" in messages[0] and "dtype=float16 head_dim=128 causal=True fwd S=1000" in messages[0]
    assert "tuned at seqlen 4096" in messages[0] and "block_m=" in messages[0]


@pytest.mark.parametrize("config, rows, expected", [
    # A decode step's group of query heads (4 rows): one warpgroup, without ping-pong.
    (TileConfig(128, 128, 2, 2, True), 4, TileConfig(64, 128, 2, 1, False)),
    (TileConfig(128, 128, 2, 2, True), 64, TileConfig(64, 128, 2, 1, False)),
    (TileConfig(128, 128, 2, 2, True), 65, TileConfig(128, 128, 2, 2, True)),
    # Three warpgroups (D = 64's entries): as many as the rows fill, ping-pong kept from two.
    (TileConfig(192, 128, 2, 3, True), 1, TileConfig(64, 128, 2, 1, False)),
    (TileConfig(192, 128, 2, 3, True), 100, TileConfig(128, 128, 2, 2, True)),
    (TileConfig(192, 128, 2, 3, True), 129, TileConfig(192, 128, 2, 3, True)),
    # Other fields travel unchanged.
    (TileConfig(128, 80, 2, 2, False, True), 16, TileConfig(64, 80, 2, 1, False, True)),
    # D = 128's three warpgroups on 80 keys: fewer warpgroups take the entry's fitted_block_n keys.
    (TileConfig(192, 80, 2, 3, True, fitted_block_n=128, speed_over_fitted=1.04), 4, TileConfig(64, 128, 2, 1, False)),
    (TileConfig(192, 80, 2, 3, True, fitted_block_n=128, speed_over_fitted=1.04), 128, TileConfig(128, 128, 2, 2, True)),
    (TileConfig(192, 80, 2, 3, True, fitted_block_n=128, speed_over_fitted=1.04), 129,
     TileConfig(192, 80, 2, 3, True, fitted_block_n=128, speed_over_fitted=1.04)),
])
def test_forward_tiles_have_no_more_warpgroups_than_their_rows_fill(config, rows, expected):
    fitted = rows_fitted(config, rows)
    assert fitted == expected
    assert rules.forward("bfloat16", 128, fitted) is None


@pytest.mark.parametrize("window, causal, row_bytes, narrowed", [
    ((127, 0), False, 128, True),  # gpt-oss's window, bf16 D = 64
    ((127, -1), True, 128, True),  # causal: the right edge is 0
    ((127, 128), False, 128, True),  # 256 keys: the limit
    ((128, 128), False, 128, False),  # 257 keys
    ((1023, 0), False, 128, False),  # measured slower (0.95x)
    ((127, 0), False, 256, False),  # D = 128: one CTA per SM (0.73x)
    ((-1, -1), True, 128, False),  # causal without a window: no left edge
    ((-1, 5), False, 128, False),
])
def test_a_narrow_band_runs_on_one_warpgroup_tiles(window, causal, row_bytes, narrowed):
    """config.band_fitted: a band of at most NARROW_BAND_KEYS keys per row on K / V rows of at
    most NARROW_BAND_ROW_BYTES runs 64-row tiles of one warpgroup; every other problem its entry."""
    from cute_flash.config import band_fitted
    from cute_flash.kernels.problem import AttentionProblem

    entry = TileConfig(192, 128, 2, 3, True)
    fitted = band_fitted(entry, AttentionProblem.of(causal, window), row_bytes)
    assert fitted == (TileConfig(64, 128, 2, 1, False) if narrowed else entry)
    assert rules.forward("bfloat16", 64, fitted) is None


def test_three_warpgroup_tiles_run_where_the_grid_model_says_they_finish_first():
    """config.grid_fitted: an entry with speed_over_fitted runs its tile or rows_fitted's
    two-warpgroup tile on fitted_block_n keys, whichever cute_flash.grid_makespan models to
    finish first on the call's grid; an unknown grid (none given) runs the latter; grids of
    ROUNDS_WITHOUT_MODEL tiles per SM the entry; entries without the field run as they are."""
    from cute_flash.config import grid_fitted
    from cute_flash.grid_makespan import ROUNDS_WITHOUT_MODEL
    from cute_flash.kernels.problem import AttentionProblem

    entry = TileConfig(192, 80, 2, 3, True, cluster_heads=2, fitted_block_n=128, speed_over_fitted=1.06)
    two = TileConfig(128, 128, 2, 2, True, cluster_heads=2)
    full, causal = AttentionProblem.of(), AttentionProblem.of(causal=True)
    # Full masks, 132 SMs: (1, 4, 6144) is one round of 128 192-row tiles against two of 192
    # 128-row ones (measured 1.34x faster); (1, 28, 8192) 9.1 rounds against 13.6 (0.976x).
    assert grid_fitted(entry, full, 1, 4, 6144, 6144, 512, 132) is entry
    assert grid_fitted(entry, full, 1, 28, 8192, 8192, 512, 132) == two
    # The batch counts as heads do: (4, 7) is (1, 28).
    assert grid_fitted(entry, full, 4, 7, 8192, 8192, 512, 132) == two
    # The SMs count: 128 of them take (1, 4, 6144)'s 128 tiles in one round too, 100 do not.
    assert grid_fitted(entry, full, 1, 4, 6144, 6144, 512, 128) is entry
    assert grid_fitted(entry, full, 1, 4, 6144, 6144, 512, 100) == two
    # The mask counts: causal (1, 4, 8192) measured 0.772x, (1, 6, 8192) 1.102x.
    assert grid_fitted(entry, causal, 1, 4, 8192, 8192, 512, 132) == two
    assert grid_fitted(entry, causal, 1, 6, 8192, 8192, 512, 132) is entry
    assert grid_fitted(entry, full, 0, 0, 8192, 8192, 512, 132) == two  # no grid given
    many = ROUNDS_WITHOUT_MODEL * 132 * 128 // 8192
    assert grid_fitted(entry, full, 1, many, 8192, 8192, 512, 132) is entry
    assert rules.forward("bfloat16", 128, two) is None
    for plain in (TileConfig(192, 128, 2, 3, True), TileConfig(128, 128, 2, 2, True, speed_over_fitted=1.04)):
        assert grid_fitted(plain, full, 1, 1, 1, 1, 512, 132) is plain


@pytest.mark.parametrize("speed, bad", [(0.0, False), (1.03, False), (0.5, False), (2.0, False), (0.3, True),
                                        (2.5, True), (float("nan"), True), (-1.0, True)])
def test_speed_over_fitted_is_a_plausible_ratio(speed, bad):
    message = rules.forward("bfloat16", 128, TileConfig(192, 80, 2, 3, True, fitted_block_n=128,
                                                        speed_over_fitted=speed))
    assert (message is not None and "speed_over_fitted" in message) if bad else message is None


@pytest.mark.parametrize("fitted, warpgroups, bad", [(128, 3, False), (0, 1, False), (100, 3, True), (272, 3, True),
                                                     (128, 1, True)])
def test_fitted_block_n_is_a_key_block_of_a_multi_warpgroup_entry(fitted, warpgroups, bad):
    config = TileConfig(64 * warpgroups, 80, 2, warpgroups, warpgroups > 1, fitted_block_n=fitted)
    message = rules.forward("bfloat16", 128, config)
    assert (message is not None and "fitted_block_n" in message) if bad else message is None


@pytest.mark.parametrize("softcap_block_n, bad", [(0, False), (96, False), (16, False), (256, False), (100, True),
                                                  (272, True), (8, True)])
def test_softcap_block_n_is_a_key_block(softcap_block_n, bad):
    config = TileConfig(192, 112, 2, 3, True, softcap_block_n=softcap_block_n)
    message = rules.forward("bfloat16", 96, config)
    assert (message is not None and "softcap_block_n" in message) if bad else message is None


def test_a_softcap_runs_the_entrys_softcap_key_block():
    """config.softcap_fitted: a call with a softcap runs the entry on softcap_block_n keys (the
    shipped bf16 D = 96 entries: 96, where the tensor cores sum P; some others where 128 or
    112 spilled), and its tiles of fewer
    warpgroups keep the entry's key block; without a softcap, or an entry without one, the
    entry runs."""
    from cute_flash.config import softcap_fitted
    from cute_flash.kernels.problem import AttentionProblem

    capped, plain = AttentionProblem.of(True, softcap=30.0), AttentionProblem.of(True)
    entry = TileConfig(192, 112, 2, 3, True, speed_over_fitted=1.2, softcap_block_n=96)
    fitted = softcap_fitted(entry, capped)
    assert fitted == TileConfig(192, 96, 2, 3, True, speed_over_fitted=1.2, fitted_block_n=112)
    assert rows_fitted(fitted, 100) == TileConfig(128, 112, 2, 2, True)
    assert softcap_fitted(entry, plain) is entry
    other = TileConfig(192, 80, 2, 3, True, fitted_block_n=128)
    assert softcap_fitted(other, capped) is other
    table = load_config_file(default_config_dir() / "h100.yaml")
    # The shipped long-sequence entries' key blocks, without and with a softcap, as the GPU tests
    # expect them (the others spilled on their own key block, dense or packed: perf/NOTES.md,
    # seventieth and seventy-first sessions).
    from test_variants import SOFTCAP_THREE_WARPGROUP_TILES, THREE_WARPGROUP_TILES

    for (dtype, head_dim, causal), (_, softcap_block) in SOFTCAP_THREE_WARPGROUP_TILES.items():
        shipped = table.lookup(str(dtype).removeprefix("torch."), head_dim, causal, "fwd")
        problem = AttentionProblem.of(causal, softcap=30.0)
        assert (shipped.block_n, softcap_fitted(shipped, problem).block_n) == (
            THREE_WARPGROUP_TILES[head_dim][1], softcap_block), (dtype, head_dim, causal)


def test_clusters_of_query_heads_apply_to_grouped_grids_of_many_tiles():
    """config.heads_clustered: an entry's clusters of query heads run on grouped heads whose
    group divides into them, in grids of CLUSTER_MIN_WAVES tiles per SM or more; else the
    entry runs with one query head per cluster."""
    from cute_flash.config import CLUSTER_MIN_WAVES, heads_clustered
    from cute_flash.kernels.problem import AttentionProblem

    entry = TileConfig(block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2, pingpong=True, cluster_heads=2)
    grouped = AttentionProblem.of(True, grouped=True)
    rows = 128 * CLUSTER_MIN_WAVES * 132 // 8  # 8 query heads, batch 1: exactly the threshold's tiles
    assert heads_clustered(entry, grouped, 1, 8, 2, rows, 132).cluster_heads == 2
    assert heads_clustered(entry, grouped, 1, 8, 2, rows - 128, 132).cluster_heads == 1  # a tile short
    assert heads_clustered(entry, grouped, 2, 8, 2, rows // 2, 132).cluster_heads == 2  # the batch counts
    assert heads_clustered(entry, grouped, 1, 6, 2, 2 * rows, 132).cluster_heads == 1  # a group of 3
    assert heads_clustered(entry, AttentionProblem.of(True), 1, 8, 8, 2 * rows, 132).cluster_heads == 1  # MHA
    packed = AttentionProblem.of(True, grouped=True, packed=True)
    assert heads_clustered(entry, packed, 1, 8, 2, 2 * rows, 132).cluster_heads == 1
    plain = dataclasses.replace(entry, cluster_heads=1)
    assert heads_clustered(plain, grouped, 1, 8, 2, 2 * rows, 132) is plain



def test_one_launch_config_prepares_heads_in_the_main_kernel_only_where_it_may():
    """config.one_launch_config: a backward grid of at most one CTA per SM, or of up to four
    waves whose count times a head's key blocks times the tile's head dim is at most 32 x 64
    (runs_as_one_launch), runs its entry with fused_preprocess
    and fused_postprocess (no preprocess launch, and dQ converted by each head's last CTA:
    launch_bwd.BackwardPlan.one_launch); larger grids, deterministic and softcap calls,
    float32, packed batches, head dims that do not divide 512 and tiles serving another head
    dim keep their entry."""
    from cute_flash.config import one_launch_config
    from cute_flash.kernels.problem import AttentionProblem

    table = load_config_file(default_config_dir() / "h100.yaml")
    entry = table.lookup("bfloat16", 64, True, "bwd")
    assert not entry.preprocess_in_main
    plain = AttentionProblem.of(True)
    fused = one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 33, 4, 132)
    assert fused.preprocess_in_main and fused.section_pairs == 1 and fused.fused_postprocess
    assert dataclasses.replace(fused, fused_preprocess=False, fused_postprocess=False) == \
        dataclasses.replace(entry, section_pairs=1)
    # At D = 64 two waves of 16-block heads, four of 4-block heads; one wave of 128-block heads.
    assert one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 16, 16, 132) == fused
    assert one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 132, 4, 132) == fused
    assert one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 1, 128, 132) == fused
    # An entry that prepares later heads already (D = 128 non-causal) gains the in-kernel dQ conversion.
    d128 = table.lookup("bfloat16", 128, False, "bwd")
    assert d128.preprocess_in_main
    assert one_launch_config(d128, "bfloat16", AttentionProblem.of(False), 128, 128, 128, 66, 2, 132) == \
        dataclasses.replace(d128, fused_postprocess=True)
    kept = [
        one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 529, 1, 132),  # four waves and a CTA
        one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 2, 129, 132),  # two waves of long heads
        one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 16, 17, 132),  # two waves of 17-block heads
        one_launch_config(entry, "bfloat16", plain, 64, 64, 64, 67, 8, 132),  # over four waves of 8-block heads
        one_launch_config(entry, "bfloat16", AttentionProblem.of(True, softcap=30.0), 64, 64, 64, 1, 1, 132),
        one_launch_config(entry, "bfloat16", AttentionProblem.of(True, packed=True), 64, 64, 64, 1, 1, 132),
        one_launch_config(entry, "bfloat16", plain, 64, 40, 40, 1, 1, 132),  # D = 40 on the 64 tile
        one_launch_config(entry, "bfloat16", plain, 64, 64, 32, 1, 1, 132),  # a value head dim of its own
        one_launch_config(entry, "float32", plain, 64, 64, 64, 1, 1, 132),
    ]
    assert all(c is entry for c in kept)
    # D = 128: two waves x 16 blocks x 128 columns is above the bound.
    assert one_launch_config(d128, "bfloat16", plain, 128, 128, 128, 16, 16, 132) is d128
    deterministic = dataclasses.replace(entry, deterministic=True)
    assert one_launch_config(deterministic, "bfloat16", plain, 64, 64, 64, 1, 1, 132) is deterministic
    d96 = table.lookup("bfloat16", 96, True, "bwd")
    assert one_launch_config(d96, "bfloat16", plain, 96, 96, 96, 1, 1, 132) is d96  # 512 % 96 != 0
