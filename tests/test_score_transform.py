"""kernels/score_transform.py on the CPU: which capped scores run the softmax without a
running maximum (bounded_offset_log2), and that its offset keeps every probability normal."""

import math

import cutlass
import pytest

from cute_flash.kernels import score_transform
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.score_transform import BOUNDED_BOTTOM_LOG2, BOUNDED_TOP_LOG2, ScoreTransform


def _offset(softcap, dtype=cutlass.BFloat16, float32_accurate=False):
    return ScoreTransform(AttentionProblem.of(softcap=softcap), float32_accurate).bounded_offset_log2(dtype)


@pytest.mark.parametrize("softcap", [0.5, 10.0, 30.0, 44.0, 50.0, 65.0])
def test_caps_up_to_65_run_bounded_with_every_probability_normal(softcap):
    offset = _offset(softcap)
    top = softcap * math.log2(math.e)
    assert offset is not None and offset >= 0.0
    # exp2(t * top - offset) over t in [-1, 1]: the smallest stays normal, the largest leaves
    # 2^64 of headroom for the row sum and P V.
    assert -top - offset >= BOUNDED_BOTTOM_LOG2 and top - offset <= BOUNDED_TOP_LOG2
    # The smallest such integer (ptx.exp2_fma_bounded folds it into its rounding).
    assert offset == (0.0 if top <= BOUNDED_TOP_LOG2 else math.ceil(top - BOUNDED_TOP_LOG2))


@pytest.mark.parametrize("softcap, dtype, accurate", [
    (0.0, cutlass.BFloat16, False),    # no cap: scores unbounded
    (66.0, cutlass.BFloat16, False),   # exp2(-2c log2 e) would flush to 0
    (30.0, cutlass.Float16, False),    # fp16 P: 2^-43 is below its range
    (30.0, cutlass.Float32, True),     # the float32-accurate forward keeps its own path
])
def test_other_scores_keep_the_running_maximum(softcap, dtype, accurate):
    assert _offset(softcap, dtype, accurate) is None


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(score_transform, "BOUNDED_SOFTMAX", False)
    assert _offset(30.0) is None


def test_every_tile_head_dim_has_an_exp2_share():
    """The FMA pipe's share of exp2 is looked up by the tile's head dim: every head dim a tile
    may have (1 ... 256) finds one, and only a softcap outside the float32-accurate path
    takes one (ScoreTransform.fma_exp2_columns)."""
    capped, plain = ScoreTransform(AttentionProblem.of(softcap=30.0)), ScoreTransform(AttentionProblem.of())
    accurate = ScoreTransform(AttentionProblem.of(softcap=30.0), float32_accurate=True)
    for bounded, table in ((True, score_transform.SOFTCAP_FMA_EXP2_COLUMNS),
                           (False, score_transform.SOFTCAP_FMA_EXP2_COLUMNS_GENERAL)):
        shares = {d: capped.fma_exp2_columns(d, bounded) for d in range(1, 257)}
        assert set(shares.values()) == set(table.values())
        assert all(plain.fma_exp2_columns(d, bounded) is None and accurate.fma_exp2_columns(d, bounded) is None
                   for d in (64, 128))
    # The cheaper emulation of bounded scores takes a larger share where the SFU bounds the tile.
    assert capped.fma_exp2_columns(64, True) == (2, 4) and capped.fma_exp2_columns(64, False) == (1, 4)
