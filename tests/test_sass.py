"""Every forward config shipped in configs/h100.yaml compiles for sm_90a on the CPU, and its
SASS shows the Hopper machinery (WGMMA, TMA), no local-memory traffic (register spills), and
main loops that issue each GEMM as one WGMMA group (not serialised k-step by k-step)."""

import dataclasses
import math
import re
from collections import Counter

import pytest

from cute_flash.config import (
    band_fitted,
    default_config_dir,
    load_config_file,
    rows_fitted,
    softcap_fitted,
    takes_clusters,
    without_clusters,
)
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.rules import DTYPES
from cute_flash.sass import (
    compile_forward_cubin,
    compile_operand_pass_cubin,
    disassemble,
    find_nvdisasm,
    main_loops,
    opcode_counts,
    wgmma_groups,
)

pytestmark = pytest.mark.sass

H100_FWD = [
    entry for entry in load_config_file(default_config_dir() / "h100.yaml").entries
    if entry.direction == "fwd"
]


@pytest.fixture(scope="module", autouse=True)
def _needs_nvdisasm():
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")


def _as_run(config, problem):
    """An entry's config as the host runs it on `problem`: without clusters of query heads
    where the problem does not take them (config.heads_clustered), on a softcap's own key
    block where the entry has one (config.softcap_fitted)."""
    return softcap_fitted(config if takes_clusters(config, problem) else without_clusters(config), problem)


def _entry_id(e):
    value = f"v{e.value_head_dim}" if e.value_head_dim else ""
    return f"{e.dtype}-d{e.head_dim}{value}-causal{int(e.causal)}"


def _forward_problems():
    """(entry, problem) per shipped forward entry: its top-left problem, and for a causal
    16-bit one also the bottom-right problem a causal call with Sq = Sk runs (tiles aligned to
    the last query, AttentionProblem.end_aligned)."""
    out = []
    for entry in H100_FWD:
        top_left = AttentionProblem.of(entry.causal)
        out += [(entry, p) for p in dict.fromkeys((top_left, top_left.end_aligned(True, entry.dtype in DTYPES)))]
    return out


@pytest.mark.parametrize("entry, problem", _forward_problems(),
                         ids=lambda x: _entry_id(x) if hasattr(x, "config") else ("end" if x.bottom_right else "start"))
def test_forward_config_compiles_to_hopper_sass(entry, problem, tmp_path):
    # A pair of tiles (a value tile of its own) compiles for tensors of its two head dims.
    # Dense heads run one query head per cluster (config.heads_clustered; clusters below).
    config = without_clusters(entry.config)
    cubin = compile_forward_cubin(entry.dtype, entry.head_dim, problem, config,
                                  tmp_path, value_head_dim=entry.value_head_dim,
                                  value_tile_head_dim=entry.value_head_dim)
    sass = disassemble(cubin)
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0, "no warpgroup MMA in the kernel"
    assert counts.get("UTMALDG", 0) > 0, "no TMA loads in the kernel"
    assert counts.get("UTMASTG", 0) > 0, "no TMA store of O in the kernel"
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0, (
        f"local-memory traffic (spills): LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}"
    )
    # setmaxnreg: producer gives registers up, consumers take them.
    assert counts.get("USETMAXREG", 0) >= 2
    _assert_two_gemm_groups_per_key_block(sass)


def _assert_two_gemm_groups_per_key_block(sass):
    """S = Q K^T and O += P V as one WGMMA group each per key block. Until 2026-11-27 the bf16
    forwards on key blocks other than 128 issued each P V k-step as a group of its own (ptxas
    serialising them around moves into P's registers; perf/NOTES.md, twenty-ninth session)."""
    loops = main_loops(sass)
    assert loops, "no main loop found in the SASS"
    assert [wgmma_groups(body) for body in loops] == [2] * len(loops)


def _grid_fitted_entries():
    """Entries fitted to the grid (speed_over_fitted) whose two-warpgroup tile, which
    config.grid_fitted runs on small grids, no entry of the same key has (D = 128's S = 4096
    entries have theirs), each such tile once (D = 64's causal entries at S = 1024 and 8192
    fit to the same one)."""
    seen, out = set(), []
    for e in H100_FWD:
        tile = without_clusters(rows_fitted(e.config, 128))
        own = {without_clusters(o.config) for o in H100_FWD if o.key() == e.key()}
        if e.config.speed_over_fitted and tile not in own and (e.key(), tile) not in seen:
            seen.add((e.key(), tile))
            out.append(e)
    return out


GRID_FITTED = _grid_fitted_entries()


@pytest.mark.parametrize("entry", GRID_FITTED, ids=_entry_id)
def test_grid_fitted_two_warpgroup_tiles_compile_without_spills(entry, tmp_path):
    """D = 64's and D = 96's tiles on two warpgroups (128 x 128, 128 x 112), which short
    sequences run (config.grid_fitted): plain, and causal with every variant (GQA, a
    bottom-right window, softcap, a sink)."""
    assert GRID_FITTED and entry.head_dim in (64, 96)
    problems = [AttentionProblem.of(entry.causal)]
    if entry.causal:
        problems.append(AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True))
    for i, problem in enumerate(problems):
        config = _as_run(rows_fitted(entry.config, 128), problem)
        assert (config.block_m, config.num_mma_warpgroups) == (128, 2)
        sass = disassemble(compile_forward_cubin(entry.dtype, entry.head_dim, problem, config, tmp_path / str(i)))
        counts = opcode_counts(sass)
        assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0
        assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0, (
            f"{problem}: LDL={counts.get('LDL', 0)} STL={counts.get('STL', 0)}")
        _assert_two_gemm_groups_per_key_block(sass)


CLUSTERED = [e for e in H100_FWD if e.config.cluster_heads > 1]


@pytest.mark.parametrize("entry", CLUSTERED, ids=_entry_id)
def test_clusters_of_query_heads_multicast_in_the_producer_only(entry, tmp_path):
    """An entry with clusters of query heads, on grouped heads: K and V arrive by multicast
    TMA, and the consumers' main loops are those of the kernel without clusters: the same
    instructions but for a register copy or two (the handshake stays in the producer:
    tma_pipeline.MulticastRing; remote arrives from the consumers cost 96 instructions per
    key block)."""
    problem = AttentionProblem.of(entry.causal, alignment="bottom_right", grouped=True)
    loops = {}
    for heads in (1, entry.config.cluster_heads):
        config = dataclasses.replace(entry.config, cluster_heads=heads)
        sass = disassemble(compile_forward_cubin(entry.dtype, entry.head_dim, problem, config, tmp_path / str(heads)))
        counts = opcode_counts(sass)
        assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
        assert ("MULTICAST" in sass) == (heads > 1)
        # A register copy, as MOV or IMAD, or a uniform register's (the host's tile divisors left
        # one more UMOV URa, URb in the loop of the kernel without clusters: fifty-second session).
        moves = re.compile(r"^(MOV|IMAD\.MOV\S*|IMAD\.U32 \S+ RZ, RZ,|UMOV UR\d+, UR\d+ ;)(\s|$)")
        # Integer adds and shifts as VIADD, IADD3, SHF or IMAD: ptxas picks among them (the
        # three-warpgroup D = 128 tile swaps two of them between the two kernels' loops).
        integer = {"VIADD": "int", "IADD3": "int", "SHF.L.U32": "int", "IMAD.U32": "int", "IMAD.SHL.U32": "int"}
        loops[heads] = [(Counter(integer.get(op, op) for op in (line.split()[0] for line in body
                                                                if not line.startswith(".L_x")
                                                                and not moves.match(line))),
                         sum(bool(moves.match(line)) for line in body))
                        for body in main_loops(sass)]
    single, clustered = loops[1], loops[entry.config.cluster_heads]
    assert single and [ops for ops, _ in single] == [ops for ops, _ in clustered]
    # As long but for a register copy or two.
    assert all(abs(a - b) <= 2 for (_, a), (_, b) in zip(single, clustered)), (single, clustered)


@pytest.mark.parametrize("dtype, head_dim, seqlen", [
    ("bfloat16", 128, None), ("float16", 64, None), ("bfloat16", 64, 1024), ("bfloat16", 64, None),
    ("bfloat16", 96, None), ("bfloat16", 256, None), ("float32", 128, None), ("float32", 256, None),
    ("float32x3h", 128, None)])
def test_forward_with_every_variant_compiles_without_spills(dtype, head_dim, seqlen, tmp_path):
    """GQA, a bottom-right causal window, softcap and a sink in one forward kernel (seqlen: the
    entry of that sequence length, D = 64's short causal 192 x 96; else the longest; bf16
    D = 64's runs a softcap on 112 keys: it spilled 2 / 1 on 128, and a window with a softcap
    20-26, perf/NOTES.md, seventieth session)."""
    problem = AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, True, "fwd", seqlen=seqlen)
    sass = disassemble(compile_forward_cubin(dtype, head_dim, problem, _as_run(entry, problem), tmp_path))
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("causal", [True, False])
def test_o_rescaled_on_every_block_among_the_exp2s(causal, tmp_path):
    """The D = 64 causal entries rescale O on every key block (rescale_every_block): no vote or
    branch around it, and its FMULs are interleaved with the softmax's exp2s (none after the
    last). The full entries keep the vote (they rescale before P V, where it lost)."""
    problem = AttentionProblem.of(causal)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup("bfloat16", 64, causal, "fwd")
    assert entry.rescale_every_block == causal
    loop = main_loops(disassemble(compile_forward_cubin("bfloat16", 64, problem, entry, tmp_path)))[-1]
    assert any("VOTE" in line for line in loop) != causal
    if causal:
        last_exp2 = max(i for i, line in enumerate(loop) if "MUFU.EX2" in line)
        fmuls = [i for i, line in enumerate(loop) if re.search(r"\bFMUL\b", line)]
        assert len(fmuls) >= 32 and max(fmuls) < last_exp2


@pytest.mark.parametrize("dtype, softcap, bounded", [("bfloat16", 30.0, True), ("bfloat16", 65.0, True),
                                                   ("bfloat16", 70.0, False), ("float16", 30.0, False)])
def test_capped_bf16_scores_need_no_running_maximum(dtype, softcap, bounded, tmp_path):
    """With a softcap up to 65 in bf16 the softmax keeps no row maximum (OnlineSoftmax's bounded
    scores): no quad shuffles in the main loops, which the running maximum needs on every key
    block (a larger cap, and fp16's narrow exponent range, keep it)."""
    problem = AttentionProblem.of(True, softcap=softcap)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, 128, True, "fwd")
    sass = disassemble(compile_forward_cubin(dtype, 128, problem, _as_run(entry, problem), tmp_path))
    loops = main_loops(sass)
    assert loops and all(("SHFL" in "\n".join(body)) != bounded for body in loops)
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_softcap_on_three_warpgroups_compiles_without_spills(head_dim, dtype, causal, packed, tmp_path):
    """The plain softcap forward on the entries' 192-row tiles for long sequences, on the key
    block a softcap runs (softcap_fitted). fp16 keeps a running maximum and transforms the
    scores before the softmax there: handing the transform to the softmax spilled 8 and 4
    registers at D = 64 and 96 (perf/NOTES.md, sixty-ninth session). The every-variant test
    above compiles other problems. Dense and over a packed batch, whose kernels hold each
    sequence's bounds too: on the entries' own key blocks fp16's full mask spilled 14 / 13
    registers at D = 64 and 3 / 3 at D = 96, and packed batches up to 31 (fp16 D = 96) and 19
    (bf16 D = 64 full), so those entries run a softcap on fewer keys (perf/NOTES.md, seventieth
    and seventy-first sessions)."""
    problem = dataclasses.replace(AttentionProblem.of(causal, softcap=30.0), packed=packed)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, causal, "fwd")
    config = _as_run(entry, problem)
    assert config.num_mma_warpgroups == 3
    counts = opcode_counts(disassemble(compile_forward_cubin(dtype, head_dim, problem, config, tmp_path)))
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


# Which shipped bf16 tiles sum the rounded probabilities on the tensor cores
# (kernels/probability_sums.py fits): the three-warpgroup ones with room in their registers.
# (D = 96 runs a softcap on 96 keys for it: TileConfig.softcap_block_n.)
SUMS_ON_TENSOR_CORES = {32: True, 64: True, 96: True, 128: True, 256: False}


@pytest.mark.parametrize("head_dim", sorted(SUMS_ON_TENSOR_CORES))
def test_bounded_scores_sum_their_probabilities_on_the_tensor_cores_where_they_fit(head_dim, tmp_path):
    """A bf16 softcap forward adds P times a ones tile (HGMMA N = 8) to each P V group where
    probability_sums.fits says so (not on two-warpgroup tiles, nor on D = 96's 192 x 112, which
    spilled with it: its softcap runs 96 keys); either way without spills."""
    problem = AttentionProblem.of(True, softcap=30.0)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup("bfloat16", head_dim, True, "fwd")
    config = _as_run(entry, problem)
    sass = disassemble(compile_forward_cubin("bfloat16", head_dim, problem, config, tmp_path))
    assert ("HGMMA.64x8x16" in sass) == SUMS_ON_TENSOR_CORES[head_dim]
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


@pytest.mark.parametrize("dtype, head_dim, operands", [("float32", 16, "TF32"), ("float32", 128, "TF32"),
                                                       ("float32x3", 16, "TF32"), ("float32x3h", 64, "F16"),
                                                       ("float32x3h", 128, "F16")])
def test_float32_forward_runs_every_gemm_on_its_parts(dtype, head_dim, operands, tmp_path):
    """float32 tiles: both GEMMs on the TF32 WGMMA (kernels/wgmma.py), or on the fp16 one for
    the scaled halves, with float32 accumulators; the halves store a float32 O."""
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, False, "fwd")
    sass = disassemble(compile_forward_cubin(dtype, head_dim, AttentionProblem.of(False), entry, tmp_path))
    gemms = re.findall(r"HGMMA\.(\S+)", sass)
    # (nvdisasm names no operand type for fp16: "64x64x16.F32".)
    suffix = ".F32.TF32" if operands == "TF32" else "x16.F32"
    assert gemms and all(g.endswith(suffix) for g in gemms), sorted(set(gemms))
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


@pytest.mark.parametrize("name, head_dim, tile, backward", [
    ("halves", 128, 128, False), ("halves", 256, 256, False), ("halves", 128, 128, True), ("halves", 256, 256, True),
    ("tf32x3", 16, 16, False), ("tf32x3", 8, 16, True), ("tf32", 128, 128, True)])
def test_float32_operand_passes_move_16_byte_vectors_without_spills(name, head_dim, tile, backward, tmp_path):
    """The float32 operand passes (kernels/half_operands.py: the maxima's reduction and the
    split; kernels/tf32_operands.py: rounding and transposes, one launch) read q, k, v (and dO)
    in 16-byte vectors and keep every value in registers (the halves' reduction at D = 256
    spilled with 64- and 32-row blocks: half_operands.reduce_chunk)."""
    sass = disassemble(compile_operand_pass_cubin(name, head_dim, tile, backward, tmp_path))
    assert "LDG.E.128" in sass
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "every-variant"])
def test_float32_value_chunks_run_on_fp16_without_spills(causal, tmp_path):
    """Above D = 128 the scaled halves' (256, 128) pair, one launch per 128 columns of V and O
    (float32.value_chunks): fp16 GEMMs with float32 accumulators, no spills; causal with GQA, a
    bottom-right window, softcap and a sink."""
    problem = AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True) if causal \
        else AttentionProblem.of(False)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup("float32x3h", 256, causal, "fwd",
                                                                          value_head_dim=128)
    sass = disassemble(compile_forward_cubin("float32x3h", 256, problem, _as_run(entry, problem), tmp_path,
                                             tile_head_dim=256, value_head_dim=128, value_tile_head_dim=128))
    gemms = re.findall(r"HGMMA\.(\S+)", sass)
    assert gemms and all(g.endswith("x16.F32") for g in gemms), sorted(set(gemms))
    counts = opcode_counts(sass)
    assert counts.get("UTMALDG", 0) > 0 and counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0


def test_float32_forward_refuses_packed_batches(tmp_path):
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup("float32", 64, False, "fwd")
    problem = AttentionProblem.of(packed=True)
    with pytest.raises(RuntimeError, match="float32 inputs run dense batches only"):
        compile_forward_cubin("float32", 64, problem, entry, tmp_path)


@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 64), ("float32x3h", 64),
                                             ("float32x3h", 128)])
def test_packed_forward_compiles_without_spills(dtype, head_dim, tmp_path):
    """A packed batch (kernels/sequences.py) with GQA, causal and seqused_k: the tile search
    and the predicated O stores cost no spills."""
    problem = AttentionProblem.of(True, grouped=True, packed=True, keys_used=True)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, True, "fwd")
    sass = disassemble(compile_forward_cubin(dtype, head_dim, problem, _as_run(entry, problem), tmp_path))
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0
    assert counts.get("UTMASTG", 0) == 0, "a packed tile must not bulk-store O past its sequence"
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("dtype, head_dim, group, kwargs, warpgroups", [
    ("bfloat16", 128, 4, dict(alignment="bottom_right"), 1),
    ("float16", 64, 8, dict(window_size=(127, 0), sink=True, keys_used=True), 3),
    ("bfloat16", 128, 16, dict(softcap=30.0), 3),
    ("bfloat16", 16, 2, dict(), 3),  # O's stores in passes of 64 rows (2 threads a row): whole rows of the tile
])
def test_packed_forward_with_a_group_as_rows_compiles_without_spills(dtype, head_dim, group, kwargs, warpgroups,
                                                                     tmp_path):
    """A packed batch with row_heads (a group's query heads at each position as a tile's rows,
    launch_fwd.packed_kernel_problem): q in five-dimensional TMA boxes of (group, positions)
    rows, O by predicated per-row stores (no bulk store past a sequence), no spills; on the
    decode step's one warpgroup and on the entry's tile."""
    problem = AttentionProblem.of(True, packed=True, row_heads=group, **kwargs)
    entry = _as_run(load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, True, "fwd"),
                    problem)
    config = rows_fitted(entry, 64 * warpgroups)
    sass = disassemble(compile_forward_cubin(dtype, head_dim, problem, config, tmp_path))
    counts = opcode_counts(sass)
    assert "UTMALDG.5D" in sass and counts.get("UTMASTG", 0) == 0
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("dtype, head_dim, page_size, cached", [
    ("bfloat16", 128, 16, False), ("float16", 64, 48, False), ("bfloat16", 128, 256, False),
    ("bfloat16", 128, 16, True), ("float16", 256, 16, True), ("float32x3h", 128, 16, False),
    ("float32x3h", 64, 64, False),
])
def test_paged_forward_compiles_without_spills(dtype, head_dim, page_size, cached, tmp_path):
    """A paged KV cache (kernels/key_pages.py): a key block in page-sized TMA boxes (8, 3, 1,
    8 and 5 per block; their pages looked up by the producer warp's lanes) costs no spills in
    the producer (32 registers from 8 boxes per block on, fwd_sm90.PAGED_REGISTER_SPLIT) or
    the consumers, for a packed batch and for queries over a cache (the decode step's
    problem); float32 caches' scaled halves as a packed batch (kvcache._float32_step)."""
    problem = AttentionProblem.of(False, grouped=True, packed=True, keys_used=True, page_size=page_size)
    if cached:
        problem = AttentionProblem.of(False, alignment="bottom_right", keys_used=True, cached_keys=True,
                                      page_size=page_size)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, False, "fwd")
    sass = disassemble(compile_forward_cubin(dtype, head_dim, problem, _as_run(entry, problem), tmp_path))
    counts = opcode_counts(sass)
    boxes_per_stage = 2 * entry.block_n // math.gcd(page_size, entry.block_n) * max(1, head_dim // 64)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) >= boxes_per_stage
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("causal, split, page_size, cached", [(False, True, 0, True), (False, True, 64, True),
                                                              (True, False, 0, True), (True, True, 0, False)])
def test_grouped_rows_forward_compiles_without_spills(causal, split, page_size, cached, tmp_path):
    """A group's query heads at each position as rows (problem.grouped_rows), split in parts
    (problem.split_keys) or whole, over a KV cache or a dense batch's keys: the rows' positions
    in the mask, the parts' block ranges, the LSE's coordinates and the output entry cost no
    spills."""
    cache = dict(keys_used=True, cached_keys=True, page_size=page_size) if cached else {}
    problem = AttentionProblem.of(causal, alignment="bottom_right", split_keys=split, grouped_rows=True, **cache)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup("bfloat16", 128, False, "fwd")
    sass = disassemble(compile_forward_cubin("bfloat16", 128, problem, _as_run(entry, problem), tmp_path))
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0 and counts.get("UTMASTG", 0) > 0
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("dtype, head_dim, group, kwargs", [
    ("bfloat16", 64, 8, dict(window_size=(127, 0), sink=True)),
    ("float16", 128, 4, dict(window_size=(60, 20), alignment="bottom_right", softcap=10.0, sink=True)),
    ("bfloat16", 256, 2, dict(softcap=50.0)),
])
def test_a_group_as_each_tiles_rows_loads_q_and_stores_o_in_boxes_of_positions(dtype, head_dim, group, kwargs,
                                                                               tmp_path):
    """problem.row_heads: q's and O's rows as (group, position) pairs, position-major, in
    five-dimensional TMA boxes (head dim, group, positions, key/value heads, batch) with no
    spills; K and V keep their four-dimensional boxes."""
    problem = AttentionProblem.of(True, row_heads=group, **kwargs)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, True, "fwd")
    sass = disassemble(compile_forward_cubin(dtype, head_dim, problem, _as_run(entry, problem), tmp_path))
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    assert "UTMALDG.5D" in sass and "UTMASTG.5D" in sass and "UTMALDG.4D" in sass
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("row_heads, window", [(8, (127, 0)), (0, (100, 37))], ids=["gpt-oss-rows", "band"])
def test_a_narrow_band_masks_with_bit_tests_on_one_warpgroup(row_heads, window, tmp_path):
    """A narrow band at D = 64 as the host runs it (config.band_fitted: one consumer warpgroup):
    no spills, both GEMMs per key block, and in the masked loops both edges as bit masks (R2P
    and one select per element, a handful of compares per row) instead of two compares per
    element (kernels/mask.py)."""
    problem = AttentionProblem.of(row_heads > 0 or window[1] == 0, window, sink=True, row_heads=row_heads)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup("bfloat16", 64, problem.causal, "fwd")
    config = band_fitted(_as_run(entry, problem), problem, 64 * 2)
    assert config.num_mma_warpgroups == 1
    sass = disassemble(compile_forward_cubin("bfloat16", 64, problem, config, tmp_path))
    counts = opcode_counts(sass)
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)
    elements = 64 * 128 // 128  # a thread's scores per key block (64 x 128 over one warpgroup)
    masked = [body for body in main_loops(sass) if sum(line.startswith("FSEL") for line in body) >= elements]
    assert masked, "no masked main loop"
    for body in masked:
        compares = sum(re.match(r"(@!?U?P\w+\s+)?ISETP", line) is not None for line in body)
        assert any(line.startswith("R2P") for line in body) and compares <= elements // 8, compares


@pytest.mark.parametrize("dtype, head_dim, page_size", [("bfloat16", 128, 0), ("float16", 64, 64),
                                                      ("bfloat16", 256, 16)])
def test_decode_forward_on_one_warpgroup_compiles_without_spills(dtype, head_dim, page_size, tmp_path):
    """A split decode step's tile of a group's query heads (config.rows_fitted: one consumer
    warpgroup, no ping-pong) over a contiguous or paged cache: both GEMMs per key block, no
    spills (at 24 producer registers the paged D = 256 one spilled 3)."""
    problem = AttentionProblem.of(False, alignment="bottom_right", keys_used=True, cached_keys=True,
                                  page_size=page_size, split_keys=True, grouped_rows=True)
    entry = rows_fitted(load_config_file(default_config_dir() / "h100.yaml").lookup(dtype, head_dim, False, "fwd"), 4)
    assert entry.num_mma_warpgroups == 1
    sass = disassemble(compile_forward_cubin(dtype, head_dim, problem, _as_run(entry, problem), tmp_path))
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0 and counts.get("UTMASTG", 0) > 0
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


@pytest.mark.parametrize("split, page_size", [(True, 64), (False, 16)])
def test_cached_forward_on_the_value_pair_tiles_compiles_without_spills(split, page_size, tmp_path):
    """A KV cache with v of a head dim of its own on the shipped (192, 128) forward tiles:
    a split decode step over pages (grouped rows) and a paged prefill chunk."""
    problem = AttentionProblem.of(not split, alignment="bottom_right", keys_used=True, cached_keys=True,
                                  split_keys=split, grouped_rows=split, page_size=page_size)
    table = load_config_file(default_config_dir() / "h100.yaml")
    entry = table.lookup("bfloat16", 192, problem.causal, "fwd", value_head_dim=128)
    cubin = compile_forward_cubin("bfloat16", 192, problem, entry, tmp_path, tile_head_dim=192, value_head_dim=128,
                                  value_tile_head_dim=128)
    sass = disassemble(cubin)
    counts = opcode_counts(sass)
    assert counts.get("HGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0
    assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0
    _assert_two_gemm_groups_per_key_block(sass)


def test_opcode_counts_reads_predicated_instructions():
    sass = (
        "        /*0010*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;\n"
        "        /*0020*/              @!P0 BAR.ARV 0x2, 0x100 ;\n"
        "        /*0030*/              @UP0 UTMALDG.2D [UR8], [UR12] ;\n"
    )
    assert opcode_counts(sass) == {"HGMMA": 1, "BAR": 1, "UTMALDG": 1}
