"""Host-side decisions of cute_flash.compile_bwd that need no GPU: the kernels' cache keys."""

import dataclasses

import pytest

from cute_flash import compile_bwd
from cute_flash.config import BackwardTileConfig, SeparateDqConfig
from cute_flash.kernels.problem import AttentionProblem

FULL = AttentionProblem()

FUSED = BackwardTileConfig(block_m=80, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2,
                           dq_atom_m=1, dq_swap_ab=True, dv_after_ds=True, fused_preprocess=True)


def test_separate_dq_main_kernel_drops_the_dq_fields():
    """With the separate dQ kernel the dK/dV-only main kernel is keyed (and compiled) by a
    config without dQ's switches, so the deterministic variant is the same kernel set, and
    the postprocess's fragment order follows the config itself."""
    dq_config = SeparateDqConfig(min_seqlen_q=1, block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2)
    fused = dataclasses.replace(FUSED, dq_stages=2)
    keys = [key for key, _ in compile_bwd.backward_parts("float16", 128, FULL, fused, "sm_90a", dq_config)]
    assert [k[0] for k in keys] == ["bwd-pre", "bwd-main-dkv", "bwd-dq"]
    assert keys[1][5] == keys[2][5] == FULL  # the problem is in the keys of the kernels that read it
    main = keys[1][6]
    assert main == dataclasses.replace(FUSED, block_m=64, dq_swap_ab=False, fused_preprocess=False)
    deterministic = dataclasses.replace(fused, deterministic=True)
    assert [k for k, _ in compile_bwd.backward_parts("float16", 128, FULL, deterministic, "sm_90a",
                                                      dq_config)] == keys
    keys = [key for key, _ in compile_bwd.backward_parts("float16", 128, FULL, fused, "sm_90a")]
    assert [k[0] for k in keys] == ["bwd-pre", "bwd-main", "bwd-post"]
    assert keys[2][4] == (80, 1, 2, True)  # block_m, dq_atom_m, num_mma_warpgroups, dq_swap_ab
    assert keys[2][5] is True  # the postprocess overlaps the main kernel
    serial = compile_bwd.backward_parts("float16", 128, FULL, fused, "sm_90a", overlap_postprocess=False)
    assert [k for k, _ in serial][:2] == keys[:2] and serial[2][0][5] is False


def test_a_head_dim_served_by_a_wider_tile_is_in_every_key():
    """D = 80 on the 128 tile: the tensors' head dim and the tile both key every kernel (one
    binary per D), and a config that prepares heads inside the main kernel is refused (its
    preparing warps read rows of the tile's width)."""
    plain = dataclasses.replace(FUSED, fused_preprocess=False)
    keys = [key for key, _ in compile_bwd.backward_parts("float16", 80, FULL, plain, "sm_90a", tile_head_dim=128)]
    assert [k[2:4] for k in keys] == [(80, 128), (80, 80), (80, 128)]
    assert keys[1][4] == 128
    native = [key for key, _ in compile_bwd.backward_parts("float16", 128, FULL, plain, "sm_90a")]
    assert [k[2:5] for k in native] == [(128, 128, True), (128, 128, 128), (128, 128, (80, 1, 2, True))]
    with pytest.raises(ValueError, match="fused_preprocess"):
        compile_bwd.backward_parts("float16", 80, FULL, FUSED, "sm_90a", tile_head_dim=128)


def test_a_value_head_dim_of_its_own_keys_the_kernels_that_read_v():
    """(D, Dv) = (192, 128) on the 192 tile: the preprocess reads O and dO (Dv), the main
    kernel every tensor (D and Dv), the postprocess writes dQ (D); fused_preprocess refused."""
    split = BackwardTileConfig(block_m=64, block_n=64, num_stages=2, num_stages_do=2, num_stages_pds=1, num_mma_warpgroups=2,
                               dq_atom_m=1, split_head_dim=True)
    keys = [key for key, _ in compile_bwd.backward_parts("bfloat16", 192, FULL, split, "sm_90a", tile_head_dim=192,
                                                         value_head_dim=128)]
    assert [k[2:4] for k in keys] == [(128, 192), (192, 128), (192, 192)]
    assert keys[1][4] == 192
    with pytest.raises(ValueError, match="fused_preprocess"):
        compile_bwd.backward_parts("float16", 128, FULL, FUSED, "sm_90a", value_head_dim=64)


def test_the_separate_dq_main_kernel_pins_all_its_exp2s():
    """The separate dQ path's 64-query step keeps its exp2s pinned whole, whatever share the
    entry's own step pins (those shares were timed on the entries' steps only)."""
    dq_config = SeparateDqConfig(min_seqlen_q=1, block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2)
    entry = BackwardTileConfig(block_m=128, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2,
                               num_mma_warpgroups=2, dq_atom_m=2, dv_after_ds=True)
    for pinned in (16, 8, 0):
        config = dataclasses.replace(entry, pinned_exp_columns=pinned)
        keys = dict(compile_bwd.backward_parts("float16", 64, FULL, config, "sm_90a", dq_config))
        main = next(key for key in keys if key[0] == "bwd-main-dkv")[6]
        assert main.block_m == 64 and main.exps_above_dp_wait and main.pinned_exp_columns == 0


def test_float32_gradients_above_128_compile_a_kernel_per_chunk():
    """The scaled halves at D = 256: a dK / dV and a dQ kernel per 128-column gradient chunk,
    their keys ending in the chunk (one launch's keys keep their old form), and the launch's
    callables (GradientChunks) hand each kernel its chunk's column views of the gradients."""
    import torch

    config = BackwardTileConfig(block_m=32, block_n=64, num_stages=1, num_stages_do=1, num_stages_pds=1,
                                num_mma_warpgroups=1, dq_atom_m=1)
    dq_config = SeparateDqConfig(min_seqlen_q=1, block_m=64, block_n=32, num_stages=1, num_mma_warpgroups=1)
    parts = compile_bwd.backward_parts("float32x3h", 200, FULL, config, "sm_90a", dq_config, tile_head_dim=256)
    assert [(k[0], k[-1]) for k, _ in parts][1:] == [("bwd-main-dkv", (0, 128)), ("bwd-main-dkv", (128, 128)),
                                                     ("bwd-dq", (0, 128)), ("bwd-dq", (128, 128))]
    narrow = compile_bwd.backward_parts("float32x3h", 128, FULL, config, "sm_90a", dq_config)
    # (One launch's main key ends in its value tile, as before.)
    assert [k[0] for k, _ in narrow] == ["bwd-pre", "bwd-main-dkv", "bwd-dq"] and narrow[1][0][-1] == 128
    seen = []
    kernels = [lambda *args, name=name: seen.append((name, args)) for name in "pabcd"]
    pre, main, dq = compile_bwd._in_chunks(tuple(kernels), parts)
    assert pre is kernels[0]
    dk, dv, grad_q = (torch.arange(2 * 200.0).view(1, 1, 2, 200) for _ in range(3))
    main(*range(10), dk, dv, "rest")
    dq(*range(6), grad_q, "rest")
    assert [name for name, _ in seen] == list("abcd")
    for (_, args), (first, width) in zip(seen[:2], [(0, 128), (128, 72)]):
        assert args[10].shape[-1] == args[11].shape[-1] == width and args[10][0, 0, 0, 0] == first
        assert args[:10] == tuple(range(10)) and args[12] == "rest"
    for (_, args), first in zip(seen[2:], (0, 128)):
        assert args[6][0, 0, 0, 0] == first and args[7] == "rest"
