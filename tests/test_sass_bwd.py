"""The backward kernels compile for sm_90a on the CPU, and the main kernel's SASS shows the
Hopper machinery (WGMMA with register A operands, TMA loads and stores, bulk reductions for
dQ) and no local-memory traffic (register spills)."""

import dataclasses
import re

import pytest

from cute_flash.compile_bwd import compile_backward_cubins
from cute_flash.config import BackwardTileConfig, default_config_dir, load_config_file, one_launch_config
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.sass import disassemble, find_nvdisasm, instructions, opcode_counts, wgmma_batched

pytestmark = pytest.mark.sass


@pytest.fixture(scope="module", autouse=True)
def _needs_nvdisasm():
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")


# Tile shapes compiled below beside the shipped YAML entries: FA3's sm90 backward shapes per
# head dim (D=64: 128 x 128 with the dQ GEMM split over both warpgroups along query rows).
FA3_SHAPES = {
    64: dict(block_m=128, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=1, num_mma_warpgroups=2, dq_atom_m=2),
    128: dict(block_m=64, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1),
}


def _shipped(head_dim, causal, dtype="float16"):
    return load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, causal, "bwd")


def _shipped_16bit_tiles():
    """(dtype, head_dim) of every 16-bit bwd entry of the shipped YAML whose configs (causal and
    not) differ from those of an earlier dtype at that head dim: one compile per distinct tile."""
    table = load_config_file(default_config_dir() / "h100.yaml")
    tiles, seen = [], set()
    for dtype in ("float16", "bfloat16"):
        for head_dim in sorted({e.head_dim for e in table.entries if e.direction == "bwd" and e.dtype == dtype}):
            configs = tuple(table.lookup(dtype, head_dim, causal, "bwd") for causal in (False, True))
            if (head_dim, configs) not in seen:
                seen.add((head_dim, configs))
                tiles.append((dtype, head_dim))
    return tiles


def _no_spills(counts):
    return counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, head_dim, shape", [(dtype, d, "shipped") for dtype, d in _shipped_16bit_tiles()]
                         + [("float16", 128, "fa3")])
def test_backward_compiles_to_hopper_sass(dtype, head_dim, shape, causal, tmp_path):
    # Every shipped 16-bit tile (for D=64 the shipped entries are the FA3 shape, with dV issued
    # after dS) and FA3's D = 128 one.
    config = _variant(head_dim) if shape == "fa3" else _shipped(head_dim, causal, dtype)
    cubins = compile_backward_cubins(dtype, head_dim, AttentionProblem.of(causal), config, tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0, "no warpgroup MMA in the main kernel"
    assert wgmma_batched(sass, counts), "ptxas serialised the WGMMAs (register pressure)"
    assert counts.get("UTMALDG", 0) > 0, "no TMA loads in the main kernel"
    assert counts.get("UTMASTG", 0) > 0, "no TMA stores of dK / dV in the main kernel"
    if config.split_head_dim:
        # dV and dK: D / 2 columns per warpgroup, both operands in shared memory (P^T, dS^T).
        assert re.search(rf"HGMMA\.64x{head_dim // 2}x16\.F32(\.BF16)? R\d+, gdesc", sass), "no split dK / dV WGMMA"
    elif config.grads_transposed:
        # dV^T and dK^T: each warpgroup's keys as N, both operands in shared memory (dO^T / Q^T, P / dS).
        keys = config.block_n // config.num_mma_warpgroups
        assert re.search(rf"HGMMA\.64x{keys}x16\.F32(\.BF16)? R\d+, gdesc", sass), "no transposed dK / dV WGMMA"
    else:
        # dV and dK take their A operand from registers: 'HGMMA.64xDx16.F32 Racc, Ra, gdesc...'.
        assert re.search(rf"HGMMA\.64x{head_dim}x16\.F32(\.BF16)? R\d+, R\d+, gdesc", sass), "no register-A WGMMA"
    if shape == "shipped" and config.exps_above_dp_wait and config.pinned_exp_columns:
        _assert_pinned_share(sass, config)
    # dQ is accumulated by the writer warp's bulk reduce-adds.
    assert counts.get("UBLKRED", 0) > 0, "no bulk dQ accumulation in the main kernel"
    assert counts.get("USETMAXREG", 0) >= 2, "no setmaxnreg split between producer and consumers"
    assert _no_spills(counts), (
        f"main kernel spills: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    )
    for name in ("preprocess", "postprocess"):
        counts = opcode_counts(disassemble(cubins[name]))
        assert _no_spills(counts), f"{name} spills"
    _assert_postprocess_overlap(sass, disassemble(cubins["postprocess"]))


def _one_launch_variants():
    """(dtype, head_dim, problem, config) per shipped 16-bit bwd entry that a grid run as one
    launch runs with fused_preprocess (config.one_launch_config changes it); in bf16 grouped-query
    attention too (the writer warp flags a group's finished heads bit by bit)."""
    table = load_config_file(default_config_dir() / "h100.yaml")
    out = []
    for e in table.entries:
        if e.direction != "bwd" or e.dtype not in ("float16", "bfloat16") or e.value_head_dim:
            continue
        for grouped in (False, True) if e.dtype == "bfloat16" else (False,):
            problem = dataclasses.replace(AttentionProblem.of(e.causal), grouped=grouped)
            config = one_launch_config(e.config, e.dtype, problem, e.head_dim, e.head_dim, e.head_dim, 1, 1, 1)
            if config is not e.config:
                out.append((e.dtype, e.head_dim, problem, config))
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("dtype, head_dim, problem, config", _one_launch_variants(),
                         ids=lambda x: x if isinstance(x, (str, int)) else "")
def test_one_launch_backward_prepares_heads_without_spills(dtype, head_dim, problem, config, tmp_path):
    """The main kernel a backward run as one launch runs (config.one_launch_config: the entry with
    fused_preprocess and fused_postprocess, so no preprocess launch and, for small heads, no
    postprocess): every GEMM batched, dQ by bulk reductions, each CTA's count an atomic whose
    old value tells the head's last CTA (which then stores dQ rows in 16-byte vectors), no
    spills anywhere (the consumers prepare the head's rows before their first step)."""
    assert config.preprocess_in_main and config.fused_postprocess
    cubins = compile_backward_cubins(dtype, head_dim, problem, config, tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and wgmma_batched(sass, counts)
    assert counts.get("UBLKRED", 0) > 0, "no bulk dQ accumulation in the main kernel"
    assert re.search(r"ATOMG\.E\.ADD\.S32\.STRONG\.GPU", sass), "no GPU-scope atomic count of the finished dQ sums"
    # (The preparing warps' 16-byte stores zero dq_accum: RZ.)
    assert re.search(r"STG\.E\.128 [^\n]*, R\d+ ;", sass), "no 16-byte stores of converted dQ rows"
    assert _no_spills(counts), f"main kernel spills: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"


def _assert_postprocess_overlap(main_sass, post_sass):
    """The dQ postprocess overlaps the main kernel (bwd_postprocess): the main kernel lets
    dependents launch (griddepcontrol.launch_dependents = PREEXIT) and counts each CTA with a
    GPU-scope release add after a GPU-scope fence; the postprocess polls that count with
    GPU-scope acquire loads that invalidate L1, and one CTA waits for the whole main grid
    (griddepcontrol.wait = ACQBULK)."""
    assert "PREEXIT" in main_sass, "main kernel never lets the postprocess launch early"
    assert re.search(r"MEMBAR\.ALL\.GPU.*?REDG\.E\.ADD\.S32\.STRONG\.GPU", main_sass, re.S), (
        "no fenced GPU-scope count of the finished dQ reductions"
    )
    assert re.search(r"LDG\.E\.STRONG\.GPU[^\n]*\n\s*/\*[0-9a-f]+\*/\s+CCTL\.IVALL", post_sass), (
        "the postprocess's wait is not an acquire load (GPU scope, L1 invalidated)"
    )
    assert "ACQBULK" in post_sass, "no postprocess CTA waits for the main grid to complete"


@pytest.mark.parametrize("dtype, problem", [("float16", AttentionProblem.of(False)),
                                            ("bfloat16", AttentionProblem.of(True, grouped=True, packed=True))],
                         ids=["fp16-full", "bf16-causal-packed-gqa"])
def test_a_backward_value_tile_of_its_own_runs_the_value_gemms_at_its_width(dtype, problem, tmp_path):
    """The shipped (192, 128) bwd entries: dP = dO V^T contracts over 128 columns and dV^T has
    128 rows (2 of 64), so each step issues D/16 + Dv/16 + (D + Dv)/64 x block_m/16 = 40
    warpgroup MMAs of 64 x 48 beside dQ's block_n/16 = 6 of 64 x 96 (48 on the square 192
    tile); spill-free, batched, TMA loads."""
    from cute_flash.launch_bwd import derived_config

    table = load_config_file(default_config_dir() / "h100.yaml")
    head_dim, value_tile = table.tile_head_dims(dtype, 192, 128, "bwd")
    assert (head_dim, value_tile) == (192, 128)
    entry = table.lookup(dtype, 192, problem.causal, "bwd", value_head_dim=128)
    config = derived_config(entry, dtype, problem, 192, 192, False, 128)
    sass = disassemble(compile_backward_cubins(dtype, 192, problem, config, tmp_path, tile_head_dim=192,
                                               value_head_dim=128, value_tile_head_dim=128)["main"])
    counts = opcode_counts(sass)
    assert _no_spills(counts), f"spills: LDL {counts.get('LDL', 0)}, STL {counts.get('STL', 0)}"
    assert wgmma_batched(sass, counts)
    assert counts.get("UTMALDG", 0) > 0
    step_gemms, dq_gemms = (len(re.findall(rf"HGMMA\.64x{n}x16\.", sass)) for n in (48, 96))
    assert dq_gemms and step_gemms * 6 == dq_gemms * 40, (step_gemms, dq_gemms)


def _variant(head_dim, **fields):
    return BackwardTileConfig(**{**FA3_SHAPES[head_dim], **fields})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_backward_compiles_without_spills(head_dim, causal, tmp_path):
    # The variant torch.use_deterministic_algorithms runs (launch_bwd).
    config = dataclasses.replace(_shipped(head_dim, causal), deterministic=True)
    cubins = compile_backward_cubins("float16", head_dim, AttentionProblem.of(causal), config, tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0, "no warpgroup MMA in the main kernel"
    assert _no_spills(counts), (
        f"main kernel spills: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    )
    # The turn semaphore: acquire polls, and a release increment after a GPU-scope fence.
    assert "LDG.E.STRONG.GPU" in sass, "no acquire load of the dQ semaphore"
    assert "REDG.E.ADD.S32.STRONG.GPU" in sass, "no increment of the dQ semaphore"
    assert counts.get("MEMBAR", 0) > 0, "no fence before passing the dQ turn on"


# dQ accumulation variants (staged tiles, deterministic order) on the 64-row step (bf16 D=128 entries).
YAML_SHAPE = dict(block_m=64, block_n=128, num_stages=2, num_stages_do=2, num_stages_pds=2, num_mma_warpgroups=2, dq_atom_m=1)


def _semaphore_present(sass):
    return "LDG.E.STRONG.GPU" in sass and "REDG.E.ADD.S32.STRONG.GPU" in sass


@pytest.mark.parametrize("extra", [
    {}, {"deterministic": True}, {"dq_stages": 2}, {"dq_stages": 2, "deterministic": True},
], ids=["wr", "wr-det", "wr-dq2", "wr-dq2-det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_writer_warp_uses_bulk_reductions(head_dim, causal, extra, tmp_path):
    config = _variant(head_dim, **{**YAML_SHAPE, **extra})
    cubins = compile_backward_cubins("bfloat16", head_dim, AttentionProblem.of(causal), config, tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and _no_spills(counts)
    # One bulk reduce-add per consumer warpgroup and query block, nothing per thread.
    assert counts.get("UBLKRED", 0) > 0, "no bulk reduce-add of dQ"
    assert "REDG.E.ADD.F32" not in sass, "per-thread fp32 dQ atomics left"
    assert "STS.128" in sass, "dQ fragments not stored as 16-byte vectors"
    assert counts.get("UTMASTG", 0) > 0, "no TMA stores of dK / dV"
    assert _semaphore_present(sass) == bool(extra.get("deterministic"))
    # The postprocess reads the fragment-ordered accumulator with 16-byte loads.
    post = opcode_counts(disassemble(cubins["postprocess"]))
    assert post.get("LDG", 0) > 0 and _no_spills(post)
    assert "LDG.E.128" in disassemble(cubins["postprocess"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim, causal", [(64, True), (128, False)], ids=["d64-causal", "d128-full"])
def test_separate_dq_path_compiles_without_accumulator_traffic(head_dim, causal, dtype, tmp_path):
    """The long-sequence path (shipped bwd_dq tiles): the main kernel computes dK / dV only,
    so it has no dQ reductions of any kind; the dQ kernel is WGMMA + TMA without spills and
    stores dQ with a TMA store; the preprocess zeroes no accumulator (no 16-byte stores)."""
    table = load_config_file(default_config_dir() / "h100.yaml")
    dq_config = table.lookup(dtype, head_dim, causal, "bwd_dq")
    config = table.lookup(dtype, head_dim, causal, "bwd")
    cubins = compile_backward_cubins(dtype, head_dim, AttentionProblem.of(causal), config, tmp_path,
                                     dq_config=dq_config)
    main_sass = disassemble(cubins["main"])
    main = opcode_counts(main_sass)
    assert main.get("HGMMA", 0) > 0 and main.get("UTMASTG", 0) > 0 and _no_spills(main)
    assert main.get("UBLKRED", 0) == 0 and main.get("REDG", 0) == 0, "dQ accumulation left in the main kernel"
    dq = opcode_counts(disassemble(cubins["dq"]))
    assert dq.get("HGMMA", 0) > 0, "no warpgroup MMA in the dQ kernel"
    assert dq.get("UTMALDG", 0) > 0 and dq.get("UTMASTG", 0) > 0, "dQ kernel without TMA loads / store"
    assert dq.get("USETMAXREG", 0) >= 2 and _no_spills(dq)
    assert "STG.E.128" not in disassemble(cubins["preprocess"]), "the preprocess still zeroes an accumulator"


@pytest.mark.parametrize("block_m, dv_after_ds", [(64, False), (80, True)], ids=["m64", "m80-dv-after-ds"])
def test_swapped_dq_gemm_compiles(block_m, dv_after_ds, tmp_path):
    """dq_swap_ab (dQ^T = K^T dS^T), also with FA3's 80-row step: it compiles, reduces dQ with
    the writer warp, has no spills and batched WGMMAs. (80 rows need dv_after_ds: with dV
    issued while dS is formed, the 16-bit P^T lives beside S^T and dP^T in fp32, and ptxas
    spilled and serialised every WGMMA, 18 % slower: perf/NOTES.md.)"""
    config = _variant(128, **{**YAML_SHAPE, "block_m": block_m, "dq_swap_ab": True, "dv_after_ds": dv_after_ds})
    cubins = compile_backward_cubins("float16", 128, AttentionProblem(), config, tmp_path)
    sass = disassemble(cubins["main"])
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UBLKRED", 0) > 0
    assert _no_spills(counts), f"LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    assert wgmma_batched(sass, counts), "ptxas serialised the WGMMAs (register pressure)"
    assert _no_spills(opcode_counts(disassemble(cubins["postprocess"])))


def test_a_tile_over_the_shared_memory_limit_fails_at_compile_time(tmp_path):
    """Two 80-row dQ tiles beside the Q / dO rings need ~247 KB: said when compiling, not
    as an opaque launch failure."""
    config = _variant(128, **{**YAML_SHAPE, "block_m": 80, "dq_swap_ab": True, "dv_after_ds": True,
                              "num_stages_pds": 1, "dq_stages": 2})
    # compile_backward_cubins compiles in a subprocess and passes its error text on.
    with pytest.raises(RuntimeError, match=r"ValueError: backward tile config needs \d+ bytes of shared memory, more than the 232448"):
        compile_backward_cubins("float16", 128, AttentionProblem(), config, tmp_path)


def _exp2s_in_gemm_shadow(sass):
    """(MUFU.EX2 that sit between a wait that leaves one WGMMA group in flight and the next
    wait for all of them, all MUFU.EX2): in the register-A step that is the exp2 of P^T
    running while dP^T is on the tensor cores."""
    inside, within, total = False, 0, 0
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            inside = False
        elif "MUFU.EX2" in line:
            total += 1
            within += inside
    return within, total


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_exp2s_run_while_dp_is_on_the_tensor_cores(causal, tmp_path):
    """ptxas likes to move the exp2s of P^T below the wait for dP^T (to interleave them with
    the dS math), which left the tensor cores idle through both: 3 % of the non-causal
    backward (perf/NOTES.md, tenth session). The kernel keeps them above the wait; checked
    on the shipped D=128 entries (before the fix: 24 of 80 at the 80-row step)."""
    cubins = compile_backward_cubins("float16", 128, AttentionProblem.of(causal), _shipped(128, causal), tmp_path)
    sass = disassemble(cubins["main"])
    within, total = _exp2s_in_gemm_shadow(sass)
    assert total > 0 and within == total, f"only {within} of {total} exp2s overlap the dP^T GEMM"


def _longest_exp2_run(sass):
    """The most MUFU.EX2 in a row (nothing issued between them)."""
    longest = run = 0
    for line in instructions(sass):
        if "MUFU.EX2" in line:
            run += 1
            longest = max(longest, run)
        elif not line.endswith(":"):  # labels are not instructions
            run = 0
    return longest


def _assert_pinned_share(sass, config):
    """The entries with pinned_exp_columns (16-bit D <= 96) keep that share of the exp2s above
    dP^T's wait and leave the rest below it: pinned whole, the SFU took 64 MUFU in a row
    (nothing else issued between them) for a GEMM half as long; unpinned, the exp2s left the
    GEMM's shadow. Part pinned was 1.02-1.11x faster (perf/NOTES.md, forty-first session)."""
    columns = config.block_m // 4  # of S^T's accumulator per thread (2 key rows each)
    assert 0 < config.pinned_exp_columns < columns
    within, total = _exp2s_in_gemm_shadow(sass)
    assert total * config.pinned_exp_columns // columns <= within < total, f"{within} of {total} above the wait"
    assert _longest_exp2_run(sass) <= 2 * config.pinned_exp_columns


# The variants' backward main kernels, with the config the host derives for them
# (launch_bwd.derived_config): spill-free and batched WGMMAs. At D = 128 a softcap with GQA
# runs on transposed gradients (its register step spilled 18-46 and serialised the WGMMAs).
# Known exceptions, not listed: at D = 128 the softcap with a left window and no GQA (4-7
# spilled registers, WGMMAs batched) or a two-sided band (2), at D = 96 with window and GQA (2);
# at D = 16 the softcap with GQA (48-57, batched; grads_transposed needs D a multiple of 64), with a
# window too ~100 and serialised (perf/NOTES.md, thirty-eighth and seventieth sessions; the full
# list: perf/experiments/spill_sweep.py --direction bwd).
VARIANT_PROBLEMS = {
    "gqa-window-bottom-right": AttentionProblem.of(True, (90, 0), "bottom_right", grouped=True),
    "gqa-band": AttentionProblem.of(False, (200, 30), grouped=True),
    "softcap-causal": AttentionProblem.of(True, softcap=20.0),
    "everything": AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True),
    "packed-gqa-causal": AttentionProblem.of(True, grouped=True, packed=True),
    "gqa-window-softcap": AttentionProblem.of(True, (4095, 0), softcap=50.0, grouped=True),
    "gqa-causal": AttentionProblem.of(True, grouped=True),  # key blocks in sections of pairs
}


@pytest.mark.parametrize("name, dtype, head_dim", [
    ("gqa-window-bottom-right", "float16", 128), ("gqa-band", "bfloat16", 128),
    ("softcap-causal", "bfloat16", 128), ("everything", "bfloat16", 64), ("everything", "float16", 32),
    ("packed-gqa-causal", "bfloat16", 128), ("packed-gqa-causal", "float16", 64),
    ("gqa-window-softcap", "float16", 128), ("everything", "bfloat16", 128),
    ("gqa-causal", "bfloat16", 64), ("gqa-causal", "float16", 128),
])
def test_variant_backward_compiles_without_spills(name, dtype, head_dim, tmp_path):
    from cute_flash.launch_bwd import derived_config

    problem = VARIANT_PROBLEMS[name]
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, problem.causal, "bwd")
    config = derived_config(entry, dtype, problem, head_dim, head_dim, False)
    counts = opcode_counts(sass := disassemble(compile_backward_cubins(dtype, head_dim, problem, config,
                                                                       tmp_path)["main"]))
    assert _no_spills(counts), f"spills: LDL {counts.get('LDL', 0)}, STL {counts.get('STL', 0)}"
    assert wgmma_batched(sass, counts)


@pytest.mark.parametrize("dtype, head_dim", [("float32", 16), ("float32", 32), ("float32", 64), ("float32", 128),
                                             ("float32x3", 16), ("float32x3", 32), ("float32x3", 64),
                                             ("float32x3", 128)])
def test_float32_backward_runs_every_gemm_on_tf32_without_spills(dtype, head_dim, tmp_path):
    """The shipped float32 and float32x3 bwd / bwd_dq entries (causal: one compile per tile),
    with a softcap at D = 128: the dK / dV kernel and the dQ kernel run every
    GEMM on the TF32 WGMMA, load and store by TMA and hold everything in registers (float32x3:
    each block's products in accumulators of their own beside dK, dV or dQ)."""
    table = load_config_file(default_config_dir() / "h100.yaml")
    config, dq_config = (table.lookup(dtype, head_dim, True, direction) for direction in ("bwd", "bwd_dq"))
    problem = AttentionProblem.of(True, softcap=30.0 if head_dim == 128 else 0.0)
    cubins = compile_backward_cubins(dtype, head_dim, problem, config, tmp_path, dq_config=dq_config)
    for kernel in ("main", "dq"):
        sass = disassemble(cubins[kernel])
        counts = opcode_counts(sass)
        gemms = re.findall(r"HGMMA\.(\S+)", sass)
        assert gemms and all(".F32.TF32" in g for g in gemms), (kernel, sorted(set(gemms)))
        assert counts.get("UTMALDG", 0) > 0 and counts.get("UTMASTG", 0) > 0, kernel
        if (dtype, head_dim, kernel) == ("float32x3", 128, "main"):
            # The one known exception: one consumer warpgroup holds dK, dV (128 registers) and a
            # step's product (64) beside the step, and ptxas spills a few loop scalars (4-6 LDL,
            # 2 STL: perf/NOTES.md, twenty-third session). Bounded, so that growth fails.
            assert counts.get("LDL", 0) <= 8 and counts.get("STL", 0) <= 4, (counts.get("LDL"), counts.get("STL"))
        else:
            assert _no_spills(counts), (kernel, counts.get("LDL", 0), counts.get("STL", 0))
        assert wgmma_batched(sass, counts), f"{kernel}: ptxas serialised the WGMMAs"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_halves_backward_runs_every_gemm_on_fp16(head_dim, packed, tmp_path):
    """The shipped float32x3h bwd / bwd_dq entries (causal, with a softcap at D = 128; or a
    packed batch with seqused_k, whose kernels zero key rows past the keys): the dK / dV and
    dQ kernels run every GEMM on the fp16 WGMMA with float32 accumulation, load and store by
    TMA, batch their WGMMAs, and hold everything in registers but the dK / dV kernel from D =
    128 (at 256 that of a gradient chunk: rules.gradient_chunks; its chunks' kernels differ in
    their columns' offsets only, and the last one compiled is checked)."""
    table = load_config_file(default_config_dir() / "h100.yaml")
    config, dq_config = (table.lookup("float32x3h", head_dim, True, direction) for direction in ("bwd", "bwd_dq"))
    problem = AttentionProblem.of(True, softcap=30.0 if head_dim == 128 else 0.0)
    if packed:
        problem = AttentionProblem.of(True, alignment="bottom_right", packed=True, keys_used=True)
    cubins = compile_backward_cubins("float32x3h", head_dim, problem, config, tmp_path, dq_config=dq_config)
    for kernel in ("main", "dq"):
        sass = disassemble(cubins[kernel])
        counts = opcode_counts(sass)
        gemms = re.findall(r"HGMMA\.(\S+)", sass)
        # (fp16 inputs carry no type suffix: HGMMA.64x64x16.F32; bf16 and TF32 ones do.)
        assert gemms and all(g.endswith("x16.F32") for g in gemms), (kernel, sorted(set(gemms)))
        # (A packed batch's gradients leave by predicated row stores: the next sequence's rows follow.)
        assert counts.get("UTMALDG", 0) > 0 and (counts.get("UTMASTG", 0) > 0) != packed, kernel
        if (head_dim, kernel) == (128, "main"):
            # The known exception: one consumer warpgroup holds dK, dV (128 registers) and a
            # step's product (64) beside the step, and ptxas spills: on the 64-query steps 200 LDL /
            # 253 STL in 73 four-byte slots with this softcap (172 / 225 in 58 without, 188 / 231
            # in 63 with grouped heads), and still 0.92x (causal) / 0.70x (non-causal) the time of
            # the 32- and 16-query steps that spilled a third as much (perf/NOTES.md, forty-sixth
            # session). Bounded near today's counts, so that growth fails.
            slots = set(re.findall(r"\[R1\+0x[0-9a-f]+\]", sass))
            assert len(slots) <= 80, sorted(slots)
            assert counts.get("LDL", 0) <= 220 and counts.get("STL", 0) <= 280, (counts.get("LDL"), counts.get("STL"))
        elif (head_dim, kernel) == (256, "main"):
            # A chunk's dK and dV take D = 128's registers on 32-query steps (the tiles of 256
            # columns leave room for no 64-query stage), and ptxas spills as at D = 128 (66 LDL /
            # 79 STL causal, 87 / 90 packed; 41 / 47 at D = 128's 32-query steps). Bounded, so
            # that growth fails.
            assert counts.get("LDL", 0) <= 100 and counts.get("STL", 0) <= 110, (counts.get("LDL"),
                                                                                 counts.get("STL"))
        elif packed and kernel == "dq":
            # The packed dQ kernel's sequence bookkeeping spills a few registers (4 LDL / 1 STL
            # at D = 64, 9 / 5 at D = 128, the same before and after its key-row zeroing:
            # perf/NOTES.md, forty-seventh session). Bounded, so that growth fails.
            assert counts.get("LDL", 0) <= 9 and counts.get("STL", 0) <= 5, (counts.get("LDL"), counts.get("STL"))
        else:
            assert _no_spills(counts), (kernel, counts.get("LDL", 0), counts.get("STL", 0))
        print(f"\nHALVES-BWD-SASS D={head_dim} {kernel}: LDL {counts.get('LDL', 0)} STL {counts.get('STL', 0)} "
              f"{sorted(set(gemms))}")
        assert wgmma_batched(sass, counts), f"{kernel}: ptxas serialised the WGMMAs"
