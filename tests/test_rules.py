"""One validity rule per kernel (cute_flash.kernels.rules), asked by the config loader, the
kernel constructors and the tuner: each refuses the same configs with the same reason. CPU
only; constructing a kernel imports the DSL but compiles nothing."""

import dataclasses
import pickle
import re

import pytest

from cute_flash.config import (
    BackwardTileConfig,
    ConfigError,
    SeparateDqConfig,
    TileConfig,
    default_config_dir,
    load_config_file,
    validate,
)
from cute_flash.kernels import rules
from cute_flash.kernels.problem import AttentionProblem

FWD = TileConfig(block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2, pingpong=True)
BWD = BackwardTileConfig(block_m=64, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1)
DQ = SeparateDqConfig(min_seqlen_q=65536, block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2)

# (direction, head_dim, config, words of the reason)
BROKEN = [
    ("fwd", 72, FWD, "head_dim (72) must be a multiple of 16 in [16, 256]"),
    ("bwd", 40, BWD, "head_dim (40) must be a multiple of 16 in [16, 256]"),
    ("fwd", 128, dataclasses.replace(FWD, block_m=192), "block_m (192) must equal 64 x num_mma_warpgroups (2)"),
    ("fwd", 128, dataclasses.replace(FWD, block_n=200), "key 'block_n' must be a multiple of 16 in [16, 256]"),
    ("bwd", 64, dataclasses.replace(BWD, block_m=80, dq_swap_ab=True),
     "dq_swap_ab needs head_dim (64) = 64 x num_mma_warpgroups (2)"),
    ("bwd", 128, dataclasses.replace(BWD, block_m=128), "block_m (128) must equal 64 x dq_atom_m (1)"),
    ("bwd", 128, dataclasses.replace(BWD, block_n=64), "block_n (64) must equal 64 x num_mma_warpgroups (2)"),
    ("bwd", 128, dataclasses.replace(BWD, num_stages_pds=3), "key 'num_stages_pds' must be 1 or num_stages"),
    ("bwd", 128, dataclasses.replace(BWD, num_mma_warpgroups=3, block_n=192, dq_stages=2),
     "dq_stages x num_mma_warpgroups must be at most 5"),
    ("bwd_dq", 128, dataclasses.replace(DQ, block_m=64), "block_m (64) must equal 64 x num_mma_warpgroups (2)"),
    ("bwd_dq", 128, dataclasses.replace(DQ, num_mma_warpgroups=3, block_m=192), "key 'num_mma_warpgroups' must be 2"),
    ("fwd", 64, dataclasses.replace(FWD, num_mma_warpgroups=4), "key 'num_mma_warpgroups' must be in [1, 3]"),
    ("fwd", 64, dataclasses.replace(FWD, num_mma_warpgroups=1, block_m=64),
     "pingpong needs at least 2 consumer warpgroups"),
]


@pytest.mark.parametrize("direction, head_dim, config, words", BROKEN)
def test_the_loader_refuses_with_the_kernels_reason(direction, head_dim, config, words):
    assert words in rules.for_entry(direction, "float16", head_dim, config)
    with pytest.raises(ConfigError, match="^where: " + re.escape(words)):
        validate(direction, "float16", head_dim, config, "where")


def _construct(direction, head_dim, config, dtype_name="float16", value_head_dim=None):
    """Build (not compile) the kernels an entry of `direction` builds (float32's bwd entries:
    the preprocess and the dK / dV kernel; its dQ comes from the bwd_dq entry's kernel), with
    the entry's value tile of its own where it names one."""
    import cutlass

    # The scaled halves run fp16 kernels on split operands.
    dtype = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16,
             rules.SCALED_HALVES: cutlass.Float16}.get(dtype_name, cutlass.Float32)
    split = dtype_name in rules.SPLIT_DTYPES
    # (The scaled halves' gradients above 128 in chunks: each chunk's kernels, alike but for their columns.)
    chunks = rules.gradient_chunks(dtype_name, head_dim)
    if direction == "fwd":
        from cute_flash.kernels.fwd_sm90 import FlashForwardSm90

        # An entry with clusters of query heads runs them on grouped heads (rules.cluster_heads).
        problem = AttentionProblem(grouped=True) if config.cluster_heads > 1 else AttentionProblem()
        FlashForwardSm90(dtype, head_dim, problem, config, split_operands=split, value_head_dim=value_head_dim)
    elif direction == "bwd":
        from cute_flash.kernels.bwd_postprocess import BackwardPostprocess
        from cute_flash.kernels.bwd_preprocess import BackwardPreprocess
        from cute_flash.kernels.bwd_sm90 import FlashBackwardSm90

        BackwardPreprocess(cutlass.Float32 if split else dtype, head_dim)
        if dtype_name in rules.FLOAT32_INPUTS:
            for chunk in chunks:
                FlashBackwardSm90(dtype, head_dim, AttentionProblem(), config, with_dq=False, split_operands=split,
                                  grad_columns=chunk)
        else:
            FlashBackwardSm90(dtype, head_dim, AttentionProblem(), config, value_head_dim=value_head_dim)
            BackwardPostprocess(dtype, head_dim, rules.dq_fragment_tile(config))
    else:
        from cute_flash.kernels.bwd_dq_sm90 import FlashBackwardDqSm90

        for chunk in chunks:
            FlashBackwardDqSm90(dtype, head_dim, AttentionProblem(), config, split_operands=split, grad_columns=chunk)


@pytest.mark.parametrize("direction, head_dim, config, words", BROKEN)
def test_the_kernel_constructors_refuse_with_the_same_reason(direction, head_dim, config, words):
    pytest.importorskip("cutlass")
    with pytest.raises(ValueError, match=re.escape(words)):
        _construct(direction, head_dim, config)


def test_every_shipped_entry_constructs():
    pytest.importorskip("cutlass")
    for entry in load_config_file(default_config_dir() / "h100.yaml").entries:
        _construct(entry.direction, entry.head_dim, entry.config, entry.dtype, entry.value_head_dim)


def test_clusters_of_query_heads_need_grouped_heads_over_rows_that_share_key_blocks():
    clustered = dataclasses.replace(FWD, cluster_heads=2)
    assert rules.forward("bfloat16", 128, clustered) is None
    assert "'cluster_heads' must be 1 or 2" in rules.forward("bfloat16", 128, dataclasses.replace(FWD, cluster_heads=4))
    assert rules.cluster_heads(AttentionProblem.of(True, grouped=True), 2) is None
    assert rules.cluster_heads(AttentionProblem.of(True, alignment="bottom_right", grouped=True, keys_used=True,
                                                   cached_keys=True), 2) is None
    assert rules.cluster_heads(AttentionProblem.of(True), 1) is None
    for problem in (AttentionProblem.of(True), AttentionProblem.of(grouped=True, packed=True),
                    AttentionProblem.of(grouped=True, keys_used=True, cached_keys=True, page_size=64),
                    AttentionProblem.of(keys_used=True, cached_keys=True, split_keys=True, grouped_rows=True)):
        assert "cluster_heads > 1 needs grouped query heads" in rules.cluster_heads(problem, 2)


def test_the_dk_dv_only_main_kernel_skips_the_dq_rules():
    # dq_stages x warpgroups and the swapped dQ GEMM's head_dim rule concern the dQ GEMM only.
    config = dataclasses.replace(BWD, num_mma_warpgroups=3, block_n=192, dq_stages=2)
    assert rules.backward("float16", 128, config) is not None
    assert rules.backward("float16", 128, config, with_dq=False) is None


def test_float32_runs_dense_batches_and_its_backward_on_tf32_with_the_separate_dq_kernel():
    assert rules.forward("float32", 128, FWD) is None and rules.forward("float32x3", 128, FWD) is None
    # float32: dK / dV only (dQ from the separate kernel), 32- or 64-query steps, no split head dim.
    f32 = dataclasses.replace(BWD, block_m=32)
    assert rules.backward("float32", 128, f32, with_dq=False) is None
    # float32x3 (both TF32 parts in every tile): the same up to D = 128, with one consumer
    # warpgroup and 16-query steps where the tiles need them (16-bit and float32 take 2 or 3).
    assert rules.backward("float32x3", 64, f32, with_dq=False) is None
    assert "at most 128 for a float32x3 backward" in rules.backward("float32x3", 144, f32, with_dq=False)
    assert "separate dQ kernel" in rules.backward("float32x3", 64, f32)
    one = dataclasses.replace(f32, block_m=16, block_n=64, num_mma_warpgroups=1)
    assert rules.backward("float32x3", 128, one, with_dq=False) is None
    assert "'num_mma_warpgroups' must be in [2, 3]" in rules.backward(
        "float32", 128, dataclasses.replace(one, block_m=32), with_dq=False)
    assert "'block_m' must be 32 or 64" in rules.backward("float32", 128, dataclasses.replace(one, block_m=16,
                                                                                              num_mma_warpgroups=2,
                                                                                              block_n=128),
                                                         with_dq=False)
    assert rules.separate_dq("float32x3", 64, DQ) is None
    assert rules.separate_dq("float32x3", 128, dataclasses.replace(DQ, block_m=64, num_mma_warpgroups=1)) is None
    assert "'num_mma_warpgroups' must be 2" in rules.separate_dq("float32", 128, dataclasses.replace(
        DQ, block_m=64, num_mma_warpgroups=1))
    assert "at most 128 for a float32x3 backward" in rules.separate_dq("float32x3", 144, DQ)
    # The scaled halves above 128: their gradients in chunks of 128 columns, one launch each.
    halves = dataclasses.replace(one, block_m=32)
    halves_dq = dataclasses.replace(DQ, block_m=64, num_mma_warpgroups=1)
    assert rules.backward("float32x3h", 256, halves, with_dq=False, grad_columns=(128, 128)) is None
    assert rules.separate_dq("float32x3h", 256, halves_dq, (0, 128)) is None
    assert "at most 128 for a float32x3h backward's gradients in one launch" in rules.backward(
        "float32x3h", 256, halves, with_dq=False)
    assert "a chunk of 128 columns" in rules.separate_dq("float32x3h", 256, halves_dq, (64, 128))
    assert "gradient chunks are built for 'float32x3h'" in rules.separate_dq("float32x3", 256, halves_dq, (0, 128))
    assert "built for split operands" in rules.backward("float16", 256, BWD, grad_columns=(0, 128))
    assert rules.for_entry("bwd", "float32x3h", 256, halves) is None
    assert rules.for_entry("bwd_dq", "float32x3h", 256, halves_dq) is None
    assert "separate dQ kernel" in rules.backward("float32", 128, f32)
    wide = dataclasses.replace(BWD, block_m=128)
    assert "key 'block_m' must be 32 or 64 (float32)" in rules.backward("float32", 128, wide, with_dq=False)
    split = dataclasses.replace(f32, split_head_dim=True, block_n=64)
    assert "split_head_dim is not built for float32" in rules.backward("float32", 128, split, with_dq=False)
    assert rules.separate_dq("float32", 16, DQ) is None and "multiple of 64" in rules.separate_dq("float16", 16, DQ)
    validate("bwd", "float32", 128, f32, "where")
    with pytest.raises(ConfigError, match="at most 128 for a float32x3 backward"):
        validate("bwd", "float32x3", 144, f32, "where")
    assert rules.float32_problem(AttentionProblem.of(True, (8, 0), "bottom_right", 5.0, True, True)) is None
    assert "dense batches only" in rules.float32_problem(AttentionProblem.of(packed=True))
    assert "dense batches only" in rules.float32_problem(AttentionProblem.of(keys_used=True, cached_keys=True))


def test_postprocess_rows_are_whole_stores():
    # D = 192: 24 threads per row; whole rows of them (192 of the 256 threads) store.
    assert rules.backward_postprocess("float16", 192, (64, 1, 2, False)) is None
    assert rules.backward_postprocess("float16", 192, (64, 1, 3, False)) is None
    assert "dQ postprocess" in rules.backward_postprocess("float16", 196, (64, 1, 2, False))


def test_transposed_grads_rules():
    transposed = dataclasses.replace(BWD, block_m=64, block_n=96, num_stages_do=1, num_stages_pds=1, dq_atom_m=1,
                                     fused_preprocess=False, grads_transposed=True)
    assert rules.backward("float16", 192, transposed) is None
    assert rules.backward("bfloat16", 128, transposed) is None
    assert "block_m (128) must be 64 with grads_transposed" in rules.backward(
        "float16", 192, dataclasses.replace(transposed, block_m=128, dq_atom_m=2))
    assert "block_n (80) must split into multiples of 16 keys" in rules.backward(
        "float16", 192, dataclasses.replace(transposed, block_n=80))
    assert "head_dim (160) must be a multiple of 64 with grads_transposed" in rules.backward("float16", 160, transposed)
    assert "split_head_dim and grads_transposed exclude each other" in rules.backward(
        "float16", 192, dataclasses.replace(transposed, block_n=64, split_head_dim=True))
    assert "grads_transposed is built for 16-bit dtypes" in rules.backward(
        "float32", 64, dataclasses.replace(transposed, num_stages_do=2), with_dq=False)
    assert "key 'num_stages_do' must be in [1, num_stages]" in rules.backward(
        "float16", 192, dataclasses.replace(transposed, num_stages_do=3))


def test_a_backward_value_tile_of_its_own_rules():
    """DeepSeek's (192, 128): V, dO and dV on a 128-wide tile, with transposed grads only."""
    transposed = dataclasses.replace(BWD, block_m=64, block_n=96, num_stages_do=1, num_stages_pds=1, dq_atom_m=1,
                                     fused_preprocess=False, grads_transposed=True)
    assert rules.backward("float16", 192, transposed, value_head_dim=128) is None
    assert rules.backward("bfloat16", 192, transposed, value_head_dim=64) is None
    assert rules.backward("float16", 192, transposed, value_head_dim=192) is None  # square
    for value, words in ((96, "must equal head_dim (192), or with grads_transposed be a multiple of 64 below it"),
                         (256, "value_head_dim (256) must equal head_dim (192)")):
        assert words in rules.backward("float16", 192, transposed, value_head_dim=value)
    assert "value_head_dim (64) must equal head_dim (128)" in rules.backward("float16", 128, BWD, value_head_dim=64)
    assert "fused_preprocess reads O and dO rows of the tile's width" in rules.backward(
        "float16", 192, dataclasses.replace(transposed, fused_preprocess=True), value_head_dim=128)
    # YAML entries: forward and 16-bit backward ones may name a value tile.
    assert rules.for_entry("bwd", "bfloat16", 192, transposed, 128) is None
    assert "only forward and 16-bit backward entries" in rules.for_entry("bwd", "float32", 64, BWD, 32)
    assert "only forward and 16-bit backward entries" in rules.for_entry("bwd_dq", "float16", 128, BWD, 64)


def test_split_head_dim_rules():
    split = dataclasses.replace(BWD, block_m=64, block_n=64, dq_atom_m=1, dq_swap_ab=False, dv_after_ds=False,
                                fused_preprocess=False, split_head_dim=True)
    assert rules.backward("float16", 256, split) is None
    assert rules.backward("bfloat16", 192, split) is None
    assert "block_n (128) must be 64 with split_head_dim" in rules.backward(
        "float16", 256, dataclasses.replace(split, block_n=128))
    assert "must split into multiples of 16 columns" in rules.backward("float16", 208, split)
    assert "dv_after_ds does not apply" in rules.backward("float16", 256, dataclasses.replace(split, dv_after_ds=True))
    # Without the split, 64 keys per warpgroup.
    assert "must equal 64 x num_mma_warpgroups" in rules.backward(
        "float16", 128, dataclasses.replace(split, split_head_dim=False))
    assert "fused_preprocess takes head dims that divide 512, up to 128" in rules.backward(
        "float16", 256, dataclasses.replace(split, fused_preprocess=True))
    assert "fused_preprocess takes head dims" in rules.backward(
        "float16", 96, dataclasses.replace(BWD, fused_preprocess=True))


def test_the_problem_is_a_compile_time_value():
    # Frozen and hashable: it is part of compile keys and a Constexpr of the kernels' masks.
    assert AttentionProblem(causal=True) == AttentionProblem(causal=True)
    assert hash(AttentionProblem(causal=True)) != hash(AttentionProblem(causal=False))
    with pytest.raises(TypeError, match="causal must be a bool"):
        AttentionProblem(causal=1)
    # Its repr is in disk-cache key hashes (disk_cache.key_hash): it must not change by
    # accident (a new field, as packed / keys_used in the fourteenth session and cached_keys /
    # page_size in the sixteenth, split_keys in the seventeenth, row_heads in the thirty-eighth,
    # recompiles every cached kernel once).
    assert repr(AttentionProblem(causal=True)) == (
        "AttentionProblem(causal=True, window_left=-1, window_right=-1, bottom_right=False, softcap=0.0, "
        "sink=False, grouped=False, packed=False, keys_used=False, cached_keys=False, page_size=0, "
        "split_keys=False, grouped_rows=False, row_heads=0)")
    with pytest.raises(ValueError, match="needs a packed batch"):
        AttentionProblem(keys_used=True)
    assert hash(AttentionProblem(causal=True)) == hash(AttentionProblem(causal=True))


def test_the_host_shares_one_problem_per_argument_set():
    # The eager fast path builds no object per call: of() returns shared instances.
    assert AttentionProblem.of(True) is AttentionProblem.of(1) is AttentionProblem.of(True)
    assert AttentionProblem.of(False) is AttentionProblem.of() == AttentionProblem()
    assert AttentionProblem.of(True) == AttentionProblem(causal=True)
    assert {AttentionProblem.of(True): 1}[AttentionProblem(causal=True)] == 1
    assert dataclasses.replace(AttentionProblem.of(False), causal=True) == AttentionProblem.of(True)
    assert pickle.loads(pickle.dumps(AttentionProblem.of(True))) == AttentionProblem.of(True)


def test_split_keys_and_grouped_rows_need_dense_queries():
    cache = dict(keys_used=True, cached_keys=True)
    assert AttentionProblem.of(True, (8, 0), "bottom_right", split_keys=True, grouped_rows=True, **cache).split_keys
    # Sinks: per row with grouped rows, added by the merge with split keys.
    assert AttentionProblem.of(sink=True, split_keys=True, grouped_rows=True, **cache).sink
    with pytest.raises(ValueError, match="split_keys needs"):
        AttentionProblem(packed=True, keys_used=True, split_keys=True)
    with pytest.raises(ValueError, match="grouped_rows needs"):
        AttentionProblem.of(grouped_rows=True, grouped=True, **cache)
    with pytest.raises(ValueError, match="grouped_rows needs"):
        AttentionProblem(packed=True, keys_used=True, grouped_rows=True)
    assert AttentionProblem.of(True, grouped_rows=True).grouped_rows  # a dense batch's decode-like step
    # ... split in parts (flash_attention's decode steps with few units), but not as plain rows.
    assert AttentionProblem.of(True, grouped_rows=True, split_keys=True).split_keys
    with pytest.raises(ValueError, match="split_keys needs"):
        AttentionProblem.of(True, split_keys=True)


def test_row_heads_need_equal_heads_in_the_kernels_view_and_whole_positions_per_tile():
    problem = AttentionProblem.of(True, (127, 0), sink=True, row_heads=8)
    assert problem.row_heads == 8 and not problem.grouped
    assert AttentionProblem.of(True, packed=True, keys_used=True, row_heads=4).row_heads == 4
    grouped = AttentionProblem.of(True, (127, 0), sink=True, grouped=True)
    assert grouped.with_group_in_rows(8) == problem and grouped.with_group_in_rows(8) is grouped.with_group_in_rows(8)
    for bad in (1, -2, 2.0):
        with pytest.raises((ValueError, TypeError), match="row_heads"):
            AttentionProblem(row_heads=bad)
    for other in (dict(grouped=True), dict(grouped_rows=True), dict(cached_keys=True, keys_used=True),
                  dict(grouped_rows=True, split_keys=True)):
        with pytest.raises(ValueError, match="row_heads needs"):
            AttentionProblem(row_heads=4, **other)
    assert rules.row_heads(problem, "bfloat16", 192) is None
    assert "divide block_m" in rules.row_heads(AttentionProblem.of(True, row_heads=16), "float16", 192 + 8)
    assert "16-bit" in rules.row_heads(problem, "float32", 128)
    assert rules.row_heads(AttentionProblem.of(True), "float32", 80) is None


def test_paged_keys_need_boxes_of_whole_swizzle_atoms():
    assert all(rules.paged_keys(page, 128) is None for page in (8, 16, 48, 64, 256, 1024))
    assert "multiple of 8" in rules.paged_keys(12, 128)
    with pytest.raises(ValueError, match="keys_used"):
        AttentionProblem(packed=True, page_size=16)
    with pytest.raises(ValueError, match="cached_keys needs"):
        AttentionProblem(packed=True, keys_used=True, cached_keys=True)
    with pytest.raises(ValueError, match="page_size"):
        AttentionProblem(packed=True, keys_used=True, page_size=-1)
    import cutlass

    from cute_flash.kernels.fwd_sm90 import FlashForwardSm90

    with pytest.raises(ValueError, match=r"FlashForwardSm90: page_size \(20\)"):
        FlashForwardSm90(cutlass.BFloat16, 128, AttentionProblem(packed=True, keys_used=True, page_size=20), FWD)
