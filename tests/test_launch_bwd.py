"""Host-side decisions of cute_flash.launch_bwd that need no GPU: how many heads the main
kernel's idle warps prepare (fused_preprocess), and the config derived for a variant."""

import dataclasses

import pytest

from cute_flash import launch_bwd
from cute_flash.config import BackwardTileConfig, SeparateDqConfig
from cute_flash.kernels.problem import AttentionProblem

FUSED = BackwardTileConfig(block_m=80, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2,
                           dq_atom_m=1, dq_swap_ab=True, dv_after_ds=True, fused_preprocess=True)


def plan(config=FUSED, dq_config=None, causal=False, batch=4, heads=64, seqlen_k=8192, sms=132, dlse=None,
         rows_contiguous=True, **kwargs):
    return launch_bwd.prepare_ahead_plan(config, dq_config, AttentionProblem.of(causal), batch, heads, seqlen_k, sms,
                                         dlse, rows_contiguous, **kwargs)


def test_large_shape_prepares_a_few_heads_ahead_two_waves_later():
    # 64 key blocks per head: heads 0..4 by the preprocess (5 x 64 >= 2 x 132 CTAs), then
    # head j prepared by all 64 CTAs (non-causal) or the 32 longest ones (causal) of head j - 5.
    assert plan() == (5, 64)
    assert plan(causal=True) == (5, 32)
    assert plan(seqlen_k=8192 + 1) == (5, 65)  # 65 key blocks: ceil(264 / 65) = 5 heads
    assert plan(seqlen_k=1000, causal=True) == (33, 4)


def test_small_problems_are_prepared_by_the_preprocess_alone():
    assert plan(batch=1, heads=2, seqlen_k=1000)[0] == 2
    assert plan(batch=1, heads=1, seqlen_k=1) == (1, 1)


@pytest.mark.parametrize("why", ["no fused_preprocess", "deterministic", "separate dq",
                                 "dlse", "strided rows", "one-launch kernel"])
def test_everything_else_leaves_the_preprocess_to_prepare_every_head(why):
    kwargs = {
        # (It prepares only its own heads, in its consumers; off its counted path, none.)
        "one-launch kernel": dict(config=dataclasses.replace(FUSED, fused_postprocess=True)),
        "no fused_preprocess": dict(config=dataclasses.replace(FUSED, fused_preprocess=False)),
        "deterministic": dict(config=dataclasses.replace(FUSED, deterministic=True)),
        "separate dq": dict(dq_config=SeparateDqConfig(min_seqlen_q=1, block_m=128, block_n=128, num_stages=2,
                                                       num_mma_warpgroups=2)),
        "dlse": dict(dlse=object()),
        "strided rows": dict(rows_contiguous=False),
    }[why]
    assert plan(**kwargs)[0] == 4 * 64


def test_at_least_one_head_is_prepared_by_the_preprocess():
    # It also zeroes every head's counts: a grid of zero heads would leave them unset.
    assert plan(waves=0) == (1, 64)


def test_grouped_causal_grids_run_in_sections_of_pairs():
    """derived_config: a grouped causal backward (16-bit, with or without a left window) numbers
    its key blocks longest first across sections of GROUPED_SECTION_PAIRS (head, batch) pairs;
    MHA, non-causal (a band too) and float32 problems keep the per-pair order (1), and so do
    packed batches and the deterministic mode, whose kernels keep the launch order anyway."""
    entry = BackwardTileConfig(block_m=128, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2,
                               num_mma_warpgroups=2, dq_atom_m=2, dv_after_ds=True)
    pairs = {name: launch_bwd.derived_config(entry, dtype, problem, 64, 64, False).section_pairs
             for name, dtype, problem in [
                 ("gqa-causal", "bfloat16", AttentionProblem.of(True, grouped=True)),
                 ("gqa-causal-bottom-right", "float16", AttentionProblem.of(True, alignment="bottom_right", grouped=True)),
                 ("gqa-causal-softcap", "bfloat16", AttentionProblem.of(True, softcap=20.0, grouped=True)),
                 ("mha-causal", "bfloat16", AttentionProblem.of(True)),
                 ("gqa-full", "bfloat16", AttentionProblem.of(False, grouped=True)),
                 ("gqa-window", "bfloat16", AttentionProblem.of(True, (4095, 0), grouped=True)),
                 ("gqa-band", "bfloat16", AttentionProblem.of(False, (200, 30), grouped=True)),
                 ("gqa-causal-float32", "float32", AttentionProblem.of(True, grouped=True)),
                 ("gqa-causal-packed", "bfloat16", AttentionProblem.of(True, grouped=True, packed=True)),
             ]}
    deterministic = launch_bwd.derived_config(entry, "bfloat16", AttentionProblem.of(True, grouped=True), 64, 64, True)
    assert deterministic.deterministic and deterministic.section_pairs == 1
    prepared_ahead = dataclasses.replace(entry, fused_preprocess=True)
    prepared_ahead = launch_bwd.derived_config(prepared_ahead, "bfloat16", AttentionProblem.of(True, grouped=True), 64,
                                               64, False)
    assert prepared_ahead.preprocess_in_main and prepared_ahead.section_pairs == 1
    assert launch_bwd.GROUPED_SECTION_PAIRS > 1
    assert pairs == {"gqa-causal": launch_bwd.GROUPED_SECTION_PAIRS,
                     "gqa-causal-bottom-right": launch_bwd.GROUPED_SECTION_PAIRS,
                     "gqa-causal-softcap": launch_bwd.GROUPED_SECTION_PAIRS,
                     "gqa-window": launch_bwd.GROUPED_SECTION_PAIRS,
                     "mha-causal": 1, "gqa-full": 1, "gqa-band": 1, "gqa-causal-float32": 1,
                     "gqa-causal-packed": 1}


def test_the_softcap_step_pins_all_its_exp2s():
    """derived_config: the softcap's 64-query step keeps every exp2 pinned (its pinned block
    also holds P^T's 16-bit copy and the softcap's factor), whatever share the entry pins."""
    entry = BackwardTileConfig(block_m=128, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2,
                               num_mma_warpgroups=2, dq_atom_m=2, dv_after_ds=True, pinned_exp_columns=16)
    capped = launch_bwd.derived_config(entry, "bfloat16", AttentionProblem.of(True, softcap=30.0), 64, 64, False)
    assert capped.block_m == 64 and capped.exps_above_dp_wait and capped.pinned_exp_columns == 0
    plain = launch_bwd.derived_config(entry, "bfloat16", AttentionProblem.of(True), 64, 64, False)
    assert plain.pinned_exp_columns == 16


@pytest.fixture
def planned(monkeypatch):
    """plan_backward on CPU tensors of head dim 64, bf16, with an H100's 132 SMs and no
    kernels compiled: planned(batch, heads, seqlen_q, seqlen_k, causal, config, dlse, layout
    ("bnsd", or "bsnd": transposed (B, S, N, D) views), kv_heads (grouped when given))."""
    import torch

    monkeypatch.setattr(launch_bwd.compile_bwd, "get_backward", lambda *args, **kwargs: ("pre", "main", "post"))
    monkeypatch.setattr(launch_bwd, "device_traits", lambda device: ("sm_90a", 132))
    monkeypatch.setattr(launch_bwd, "_current_device", lambda: None)  # CPU tensors' device index

    def plan(batch, heads, seqlen_q, seqlen_k, causal=True, config=FUSED, dlse=None, layout="bnsd", kv_heads=None):
        def tensor(n, s):
            if layout == "bsnd":
                return torch.empty(batch, s, n, 64, dtype=torch.bfloat16).transpose(1, 2)
            return torch.empty(batch, n, s, 64, dtype=torch.bfloat16)

        q, out, dout = (tensor(heads, seqlen_q) for _ in range(3))
        k, v = (tensor(kv_heads or heads, seqlen_k) for _ in range(2))
        lse = torch.empty(batch, heads, seqlen_q)
        return launch_bwd.plan_backward(q, k, v, out, dout, lse, AttentionProblem.of(causal, grouped=kv_heads is not None),
                                        config, dlse)

    return plan


def test_grids_of_one_launch_plan_no_preprocess(planned):
    """plan_backward's one_launch: a grid of at most one CTA per SM, or of up to four waves of
    short heads (config.runs_as_one_launch), whose config prepares heads in
    the main kernel runs without the preprocess (BackwardPlan._launch on a counted set), its
    prep_ctas the preparing key blocks of each head; not a larger grid, a config without
    fused_preprocess, an upstream LSE gradient, O / dO rows that are not contiguous ((B, S,
    N, D) buffers) unless the config is a one-launch kernel's (fused_postprocess), nor grouped
    heads whose group leaves no preparing CTA."""
    import torch

    small = planned(1, 4, 300, 300)  # 3 key blocks x 4 heads: 12 CTAs
    # Every key block prepares (causal too: all of the head's CTAs wait for it).
    assert small.one_launch and small.prep_ctas == 3 and small.prep_ahead == 4  # (the fallback: the preprocess)
    assert planned(1, 4, 300, 300, causal=False).prep_ctas == 3
    assert planned(1, 44, 300, 300).one_launch  # 132 CTAs
    assert planned(1, 176, 300, 300).one_launch  # 528: four waves of 3-block heads
    assert not planned(1, 177, 300, 300).one_launch  # 531
    assert planned(1, 1, 300, 16384).one_launch  # one wave of 128 key blocks
    assert planned(1, 8, 300, 128 * 17).one_launch  # 136: a wave and 4 CTAs of 17-block heads
    assert not planned(1, 16, 300, 128 * 17).one_launch  # 272: two waves x 17 blocks x 64 > 32 x 64
    assert not planned(1, 4, 300, 300, config=dataclasses.replace(FUSED, fused_preprocess=False)).one_launch
    assert not planned(1, 4, 300, 300, dlse=torch.empty(1, 4, 300)).one_launch
    assert not planned(1, 4, 300, 300, layout="bsnd").one_launch
    # A one-launch kernel's consumers prepare through the rows' own strides.
    assert planned(1, 4, 300, 300, layout="bsnd", config=dataclasses.replace(FUSED, fused_postprocess=True)).one_launch
    assert planned(1, 4, 300, 300, kv_heads=2).one_launch  # group 2: 2 of the 3 key blocks prepare, a query head each
    assert not planned(1, 8, 300, 300, kv_heads=2).one_launch  # group 4 > 3 preparing CTAs


def test_one_launch_plans_convert_dq_in_the_main_kernel_where_a_group_is_small(planned):
    """BackwardPlan.converts_dq: a one-launch plan whose config has fused_postprocess launches no
    postprocess where the dq_accum of a key/value head's group (which its last CTA converts
    alone) is at most IN_KERNEL_DQ_BYTES and the group fits the writer's bit mask; not
    without fused_postprocess, nor on a grid that does not run as one launch (which
    config.one_launch_config never gives a converting config: there it prepares nothing ahead)."""
    converting = dataclasses.replace(FUSED, fused_postprocess=True)

    def square(heads, seqlen, kv_heads=None, config=converting, causal=True):
        return planned(1, heads, seqlen, seqlen, causal=causal, config=config, kv_heads=kv_heads)

    small = square(4, 300)
    assert small.one_launch and small.converts_dq
    assert 4 * small.rows[2] * 64 <= launch_bwd.IN_KERNEL_DQ_BYTES
    assert square(4, 900).converts_dq  # 1024 rows (80-row blocks, padded) x 64 x 4 bytes: 256 KiB a head
    large = square(4, 1000)  # 8 key blocks x 4 heads, one wave; 1152 rows: 288 KiB
    assert large.one_launch and not large.converts_dq
    assert not square(4, 300, config=FUSED).converts_dq
    assert square(88, 300).converts_dq  # 264 CTAs: two waves
    beyond = square(177, 300)  # 531 CTAs
    assert not beyond.one_launch and not beyond.converts_dq and beyond.prep_ahead == 177
    # Groups of 2 query heads (non-causal: every key block prepares, one query head each).
    assert square(4, 400, kv_heads=2, causal=False).converts_dq  # 2 heads of 512 rows: 256 KiB
    assert not square(4, 600, kv_heads=2, causal=False).converts_dq  # 2 x 160 KiB


def test_a_forward_plans_backward_plans_are_found_by_the_upstream_gradients_layout(monkeypatch):
    """launch_bwd.backward with `plans` (the forward plan's dict, cute_flash.api): a plan is
    made (through the signature's cache) once per dO layout and call switches and then found
    by that short key; dO with other strides or alignment, an LSE gradient or deterministic
    mode get plans of their own."""
    import torch

    made = []

    class Recorded:
        def run(self, *args):
            return self

    def planned(*args):
        made.append(args)
        return Recorded()

    monkeypatch.setattr(launch_bwd, "_planned", planned)
    monkeypatch.setattr(launch_bwd, "_current_device", lambda: 0)
    q, k, v, out = (torch.empty(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.empty(1, 2, 8)
    plans = {}

    def call(dout, dlse=None, deterministic=False):
        return launch_bwd.backward(q, k, v, out, dout, lse, AttentionProblem.of(True), 0.25, dlse=dlse,
                                   deterministic=deterministic, plans=plans)

    dout = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16)
    first = call(dout)
    assert call(torch.empty(1, 2, 8, 16, dtype=torch.bfloat16)) is first and len(made) == 1
    transposed = torch.empty(1, 8, 2, 16, dtype=torch.bfloat16).transpose(1, 2)
    assert call(transposed) is not first and len(made) == 2
    offset = torch.empty(1 * 2 * 8 * 16 + 4, dtype=torch.bfloat16)[4:].view(1, 2, 8, 16)  # 8-byte aligned
    call(offset)
    call(dout, dlse=torch.empty(1, 2, 8))
    call(dout, deterministic=True)
    assert len(made) == 5 and len(plans) == 5
    assert call(dout) is first and len(made) == 5
