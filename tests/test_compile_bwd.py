"""Host-side decisions of cute_flash.compile_bwd that need no GPU: the kernels' cache keys."""

import dataclasses

import pytest

from cute_flash import compile_bwd
from cute_flash.config import BackwardTileConfig, SeparateDqConfig
from cute_flash.kernels.problem import AttentionProblem

FULL = AttentionProblem()

FUSED = BackwardTileConfig(block_m=80, block_n=128, num_stages=2, num_stages_pds=2, num_mma_warpgroups=2,
                           dq_atom_m=1, dq_swap_ab=True, dv_after_ds=True, fused_preprocess=True)


def test_separate_dq_main_kernel_drops_the_dq_fields():
    """With the separate dQ kernel the dK/dV-only main kernel is keyed (and compiled) by a
    config without dQ's switches, so the deterministic variant is the same kernel set, and
    the postprocess's fragment order follows the config itself."""
    dq_config = SeparateDqConfig(min_seqlen_q=1, block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2)
    fused = dataclasses.replace(FUSED, dq_stages=2)
    keys = [key for key, _ in compile_bwd.backward_parts("float16", 128, FULL, fused, "sm_90a", dq_config)]
    assert [k[0] for k in keys] == ["bwd-pre", "bwd-main-dkv", "bwd-dq"]
    assert keys[1][4] == keys[2][4] == FULL  # the problem is in the keys of the kernels that read it
    main = keys[1][5]
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
    assert all(k[2:4] == (80, 128) for k in keys)
    native = [key for key, _ in compile_bwd.backward_parts("float16", 128, FULL, plain, "sm_90a")]
    assert all(k[2:4] == (128, 128) for k in native)
    with pytest.raises(ValueError, match="fused_preprocess"):
        compile_bwd.backward_parts("float16", 80, FULL, FUSED, "sm_90a", tile_head_dim=128)
