"""Which (dtype, head dim, tile config) each kernel can implement: one rule per kernel.

Each function returns None when the kernel can be built for its arguments, else the first rule
they break, as a sentence naming the field and its value. The same function is asked by
* the kernel's constructor (which raises ValueError with the reason),
* the config loader (cute_flash.config: an entry of the YAML file must be buildable; it
  raises ConfigError naming the file and the entry),
* the tuner's candidate generation (cute_flash.tune drops candidates that break a rule).
Whether a config fits in shared memory is not decided here: the kernels measure their
compiled shared-memory struct at compile time.

No DSL import (the config loader and the tuner run without it) and no torch: configs are
duck-typed (cute_flash.config's dataclasses), dtypes are names ("float16", "bfloat16").
"""

import math

DTYPES = ("float16", "bfloat16")
# Float32 tiles run on the TF32 WGMMA (kernels/wgmma.py): one TF32 pass ("float32") or TF32
# hi | lo operand pairs at float32 accuracy (SPLIT_FLOAT32), forward and backward.
TF32 = "float32"
SPLIT_FLOAT32 = "float32x3"
FLOAT32_DTYPES = (TF32, SPLIT_FLOAT32)
# float32 at float32 accuracy on fp16 hi | lo parts scaled per (batch, head) (the scaled halves,
# cute_flash.float32; kernels/half_operands.py): its operands are fp16 in memory, O, dO and the
# gradients float32.
SCALED_HALVES = "float32x3h"
# Operands as hi | lo parts side by side (2 x the tile's head dim wide), three GEMMs per GEMM.
SPLIT_DTYPES = (SPLIT_FLOAT32, SCALED_HALVES)
# The kernels of float32 inputs, TF32 and the scaled halves: an operand pass before them, and a
# backward with the separate dQ kernel.
FLOAT32_INPUTS = FLOAT32_DTYPES + (SCALED_HALVES,)
FORWARD_DTYPES = DTYPES + FLOAT32_INPUTS
BACKWARD_DTYPES = FORWARD_DTYPES
# Split operands double every tile of the backward. Up to SPLIT_BACKWARD_PAIRED_HEAD_DIM two
# consumer warpgroups fit (the dK / dV kernel's 128 keys of K and V beside a 32-query stage of
# Q, dO, Q^T and dO^T: 192 KiB at 64; the dQ kernel's 128 rows of Q and dO beside two 32-key
# stages of K, V and K^T: 224 KiB); above it one (64 keys or 64 query rows per CTA; 16-query
# steps at 128: 192 KiB, and 16-key stages: 224 KiB).
SPLIT_BACKWARD_PAIRED_HEAD_DIM = 64
SPLIT_BACKWARD_MAX_HEAD_DIM = 128
# Above that (up to every kernel's 256) the scaled halves' gradients come in GRAD_CHUNK-column
# chunks, one launch of the dK / dV kernel and of the dQ kernel each: a launch still reads Q,
# K, V and dO whole (S and dP contract over every column, and are recomputed per chunk), but
# dK and dV (or dQ) of its chunk alone take the registers that D = 128's take
# (gradient_chunks; cute_flash.float32).
GRAD_CHUNK = 128
# The widest value tile of the scaled halves' forward kernels (O and its per-block P V
# accumulator: 128 registers per thread at 64 query rows): V of a wider tile is split in chunks
# of it (cute_flash.float32.value_chunks; kernels/half_operands.py lays them out).
VALUE_CHUNK = 128
THREADS_PER_WARPGROUP = 128
# K and V bytes a section of a causal forward grid may span: most of the H100's / H200's 50 MB
# L2 (kernels/tile_scheduler.py; cute_flash.grid_makespan replays the same sections on the host,
# without the DSL).
L2_SECTION_BYTES = 32 * 2**20
# The dQ writer warp's hand-off takes an empty and a full named barrier per staged chunk
# (dq_stages x num_mma_warpgroups of them) out of ids 5..14 of the 16 (kernels/dq_accumulate.py).
MAX_DQ_TILE_CHUNKS = 5
# Elements of dQ per thread and row where dq_accum is converted: one 16-byte store
# (dq_accumulate.DqBlockConverter, in the postprocess or a one-launch main kernel).
POSTPROCESS_VALUES = 8


def require(kernel: str, reason) -> None:
    """For a kernel's constructor: raise ValueError naming the kernel when a rule above (its
    result, `reason`) is broken."""
    if reason is not None:
        raise ValueError(f"{kernel}: {reason}")


def _first(checks):
    """The reason of the first failed (ok, reason) check, else None; reasons may be callables
    (formatted only when needed)."""
    for ok, reason in checks:
        if not ok:
            return reason() if callable(reason) else reason
    return None


def _key(config, key, rule):
    return lambda: f"key '{key}' must be {rule}, got {getattr(config, key)!r}"


def _common(dtype_name, head_dim, multiple: int = 64, dtypes=DTYPES):
    return [
        (dtype_name in dtypes, lambda: f"dtype must be one of {dtypes}, got {dtype_name!r}"),
        (head_dim % multiple == 0 and 0 < head_dim <= 256,
         lambda: f"head_dim ({head_dim}) must be a multiple of {multiple} in [{multiple}, 256]"),
    ]


def _block_m_per_warpgroup(config):
    """Kernels whose consumer warpgroups each own 64 query rows of a block."""
    return (config.block_m == 64 * config.num_mma_warpgroups,
            lambda: f"block_m ({config.block_m}) must equal 64 x num_mma_warpgroups ({config.num_mma_warpgroups}): "
                    "each consumer warpgroup owns 64 query rows")


def forward(dtype_name: str, head_dim: int, config, value_head_dim: int | None = None) -> str | None:
    """kernels/fwd_sm90.py, FlashForwardSm90, with a TileConfig. Head dims: multiples of 16
    (one WGMMA K step of S = Q K^T; the tiles' swizzle follows the row width). A value tile
    of its own (value_head_dim, None: head_dim) is a multiple of 16 below head_dim (O's tile
    reuses Q's buffer), and 16-bit (float32's operand pass lays out V for one head dim)."""
    value = head_dim if value_head_dim is None else value_head_dim
    return _first(_common(dtype_name, head_dim, multiple=16, dtypes=FORWARD_DTYPES) + [
        # V's hi and lo column halves are each the MN-major B operand of P V: whole 128-byte
        # swizzle atoms of fp16 (kernels/fwd_sm90.py).
        (dtype_name != SCALED_HALVES or head_dim % 64 == 0,
         lambda: f"head_dim ({head_dim}) must be a multiple of 64 for {SCALED_HALVES!r} (V's column halves)"),
        (value == head_dim or (value % 16 == 0 and 0 < value < head_dim and dtype_name in DTYPES)
         or (value % 64 == 0 and 0 < value < head_dim and dtype_name == SCALED_HALVES),
         lambda: f"value_head_dim ({value}) must be a multiple of 16 below head_dim ({head_dim}), "
                 f"with a 16-bit dtype (a multiple of 64 with {SCALED_HALVES!r}; got {dtype_name!r})"),
        (config.block_m % 64 == 0 and 64 <= config.block_m <= 192,
         _key(config, "block_m", "a multiple of 64 in [64, 192]")),
        (config.block_n % 16 == 0 and 16 <= config.block_n <= 256,
         _key(config, "block_n", "a multiple of 16 in [16, 256]")),
        (1 <= config.num_stages <= 4, _key(config, "num_stages", "in [1, 4]")),
        # fwd_sm90 has a register split for 2 and 3 consumer warpgroups (REGISTER_SPLIT) and
        # for one (ONE_WARPGROUP_SPLIT, HALF_FILE_SPLIT).
        (1 <= config.num_mma_warpgroups <= 3, _key(config, "num_mma_warpgroups", "in [1, 3]")),
        (not (config.pingpong and config.num_mma_warpgroups == 1),
         lambda: "pingpong needs at least 2 consumer warpgroups (they take turns issuing their GEMMs)"),
        _block_m_per_warpgroup(config),
        (getattr(config, "cluster_heads", 1) in (1, 2), _key(config, "cluster_heads", "1 or 2")),
        (getattr(config, "fitted_block_n", 0) == 0 or (config.fitted_block_n % 16 == 0 and 16 <= config.fitted_block_n
                                                        <= 256 and config.num_mma_warpgroups > 1),
         _key(config, "fitted_block_n", "0 or a multiple of 16 in [16, 256], on more than one consumer warpgroup")),
        (getattr(config, "softcap_block_n", 0) == 0 or (config.softcap_block_n % 16 == 0
                                                         and 16 <= config.softcap_block_n <= 256),
         _key(config, "softcap_block_n", "0 or a multiple of 16 in [16, 256]")),
        # (A NaN fails both comparisons, so it is refused too.)
        (getattr(config, "speed_over_fitted", 0.0) == 0.0 or 0.5 <= config.speed_over_fitted <= 2.0,
         _key(config, "speed_over_fitted", "0 or a speed ratio in [0.5, 2]")),
    ])


def cluster_heads(problem, heads: int) -> str | None:
    """kernels/fwd_sm90.py with TileConfig.cluster_heads: the CTAs of a cluster take one query
    block of neighbouring query heads and fill each other's K / V stages, so they must walk the
    same key blocks of one K/V head: a grouped (GQA) problem over dense rows or a contiguous
    cache, not a paged one (one TMA box per page) nor split keys. (The host also needs the
    group to be a multiple of `heads`: a run-time value.)"""
    return _first([
        (heads in (1, 2), lambda: f"cluster_heads must be 1 or 2, got {heads!r}"),
        (heads == 1 or (problem.grouped and not (problem.packed or problem.page_size or problem.split_keys
                                                 or problem.grouped_rows)),
         "cluster_heads > 1 needs grouped query heads over dense rows or a contiguous cache (not packed, paged, "
         "split keys or grouped rows)"),
    ])


def row_heads(problem, dtype_name: str, block_m: int) -> str | None:
    """kernels/fwd_sm90.py with problem.row_heads = G: a tile's rows are block_m / G whole
    positions of the group (HeadMapping.row_tile: TMA boxes of (G, block_m / G) rows), on
    16-bit tiles (the float32 operand pass lays out one query head's rows)."""
    return _first([
        (not problem.row_heads or block_m % problem.row_heads == 0,
         lambda: f"row_heads ({problem.row_heads}) must divide block_m ({block_m})"),
        (not problem.row_heads or dtype_name in DTYPES,
         lambda: f"row_heads takes 16-bit dtypes {DTYPES}, got {dtype_name!r}"),
    ])


def float32_problem(problem) -> str | None:
    """The float32 (TF32) tiles' kernels: V (forward), Q^T and dO^T (dK / dV), K^T (dQ) arrive
    transposed with their keys (queries) permuted in groups of 8 counted from each sequence's
    first row (cute_flash.float32), which the host lays out for a dense batch only. (The scaled
    halves read their operands as the 16-bit kernels do: packed batches too.)"""
    return _first([
        (not (problem.packed or problem.cached_keys),
         "float32 inputs run dense batches only (not packed sequences or KV caches)"),
    ])


def paged_keys(page_size: int, block_n: int) -> str | None:
    """kernels/key_pages.py, with a forward's block_n: a key block's TMA boxes of
    gcd(page_size, block_n) rows must be whole 8-row atoms of the swizzled K/V stages."""
    return _first([
        (page_size % 8 == 0 and math.gcd(page_size, block_n) % 8 == 0,
         lambda: f"page_size ({page_size}) must be a multiple of 8 (with block_n {block_n}: TMA boxes of whole "
                 "8-row swizzle atoms)"),
    ])


def backward_preprocess(dtype_name: str, head_dim: int) -> str | None:
    """kernels/bwd_preprocess.py, BackwardPreprocess: 8 elements per thread and load, a row
    within one warp."""
    return _first([
        (dtype_name in BACKWARD_DTYPES, lambda: f"dtype must be one of {BACKWARD_DTYPES}, got {dtype_name!r}"),
        (head_dim % 8 == 0 and 0 < head_dim // 8 <= 32,
         lambda: f"head_dim ({head_dim}) must be a multiple of 8, at most 256 (backward preprocess)"),
    ])


def gradient_chunks(dtype_name: str, head_dim: int) -> list:
    """The gradients' column chunks of a backward on tiles of `head_dim`: [(first column,
    columns)] of the scaled halves above SPLIT_BACKWARD_MAX_HEAD_DIM (one launch of the dK / dV
    kernel and of the dQ kernel each, see GRAD_CHUNK), else [None] (one launch, every column)."""
    if dtype_name != SCALED_HALVES or head_dim <= SPLIT_BACKWARD_MAX_HEAD_DIM:
        return [None]
    return [(first, GRAD_CHUNK) for first in range(0, head_dim, GRAD_CHUNK)]


def backward(dtype_name: str, head_dim: int, config, with_dq: bool = True, value_head_dim: int | None = None,
             grad_columns: tuple | None = None) -> str | None:
    """kernels/bwd_sm90.py, FlashBackwardSm90, with a BackwardTileConfig; with_dq=False (dK and
    dV only, the separate-dQ path) leaves out the rules of the dQ GEMM and its hand-off. Head dims:
    multiples of 16 (D = 16 and 32 ship; wider D must fit dK and dV in registers and the tiles in
    shared memory, which the compile checks). A value tile of its own (value_head_dim, None:
    head_dim): with grads_transposed, a multiple of 64 below head_dim (dV^T's 64-row WGMMA tiles).
    grad_columns: (first column, columns) of dK and dV that the kernel computes (gradient_chunks);
    None: all of them."""
    nwg = config.num_mma_warpgroups
    value = head_dim if value_head_dim is None else value_head_dim
    split = dtype_name in SPLIT_DTYPES
    if split:
        block_m = (config.block_m in (16, 32, 64), _key(config, "block_m", "16, 32 or 64 (split operands)"))
    elif dtype_name in FLOAT32_DTYPES:
        block_m = (config.block_m in (32, 64), _key(config, "block_m", "32 or 64 (float32)"))
    else:
        block_m = (config.block_m in (64, 128) or (config.dq_swap_ab and config.block_m in (80, 96, 112)),
                   _key(config, "block_m", "64 or 128 (80, 96 or 112 with dq_swap_ab)"))
    checks = _common(dtype_name, head_dim, multiple=16, dtypes=BACKWARD_DTYPES) + [
        block_m,
        (1 <= config.num_stages <= 2, _key(config, "num_stages", "in [1, 2]")),
        (config.num_stages_pds in (1, config.num_stages), _key(config, "num_stages_pds", "1 or num_stages")),
        (1 <= config.num_stages_do <= config.num_stages, _key(config, "num_stages_do", "in [1, num_stages]")),
        # bwd_sm90.REGISTER_SPLIT has a register split for 2 and 3 consumer warpgroups, and for
        # 1 where float32x3 needs it.
        (1 <= nwg <= 3 if split else 2 <= nwg <= 3,
         _key(config, "num_mma_warpgroups", "in [1, 3] (float32x3)" if split else "in [2, 3]")),
        (1 <= config.dq_atom_m <= nwg, _key(config, "dq_atom_m", "in [1, num_mma_warpgroups]")),
        (config.dq_stages in (1, 2), _key(config, "dq_stages", "1 or 2")),
        (config.section_pairs >= 1, _key(config, "section_pairs", "at least 1")),
        # (block_m / 4 or more pins all of them, like 0; tune.pinned_share_fitted keeps the
        # tuner's variants' shares meaningful.)
        (config.pinned_exp_columns >= 0, _key(config, "pinned_exp_columns", "at least 0 (0: all)")),
        (value == head_dim or (config.grads_transposed and value % 64 == 0 and 0 < value < head_dim),
         lambda: f"value_head_dim ({value}) must equal head_dim ({head_dim}), or with grads_transposed be a multiple "
                 "of 64 below it (dV^T's rows are 64-row WGMMA tiles)"),
        (value == head_dim or not config.fused_preprocess,
         "fused_preprocess reads O and dO rows of the tile's width: not with a value tile of its own"),
    ]
    if dtype_name == SCALED_HALVES:
        # The dK / dV kernel on fp16 parts, dQ from the separate kernel (as float32's).
        checks += [
            (not with_dq, "scaled halves compute dQ in the separate dQ kernel (a bwd_dq entry)"),
            (not config.split_head_dim and not config.grads_transposed and not config.dv_after_ds,
             "split_head_dim, grads_transposed and dv_after_ds are not built for scaled halves"),
            (head_dim % 64 == 0, lambda: f"head_dim ({head_dim}) must be a multiple of 64 for scaled halves"),
        ]
    if dtype_name in FLOAT32_DTYPES:
        # Every GEMM on the TF32 WGMMA, both operands K-major: P^T and dS^T stay register A
        # operands against Q^T / dO^T copies (not split_head_dim's shared-memory P^T), and dQ
        # comes from the separate dQ kernel (the fused one would store dS K-major and hold K^T
        # beside K, V, Q, dO, Q^T and dO^T: no room).
        checks += [
            (not with_dq, "a float32 backward computes dQ in the separate dQ kernel (a bwd_dq entry), not the main one"),
            (not config.split_head_dim, "split_head_dim is not built for float32"),
            (not config.dv_after_ds, "dv_after_ds is not built for float32 (dO goes back once dP^T is done)"),
            # dO^T's ring advances with dO's state (bwd_sm90._produce_query_head).
            (config.num_stages_do == config.num_stages, "num_stages_do must equal num_stages for float32"),
        ]
    if split:
        checks += _split_gradients(dtype_name, head_dim, grad_columns)
    elif grad_columns is not None:
        checks.append((False, "gradient chunks are built for split operands"))
    if config.split_head_dim:
        checks += [
            (config.block_n == 64,
             lambda: f"block_n ({config.block_n}) must be 64 with split_head_dim: S^T is one 64-row WGMMA tile "
                     "that the warpgroups share along its queries"),
            (config.block_m % (16 * nwg) == 0,
             lambda: f"block_m ({config.block_m}) must split into multiples of 16 queries over the {nwg} "
                     "warpgroups (split_head_dim)"),
            (head_dim % (16 * nwg) == 0,
             lambda: f"head_dim ({head_dim}) must split into multiples of 16 columns of dK / dV over the {nwg} "
                     "warpgroups (split_head_dim)"),
            (not config.dv_after_ds, "dv_after_ds does not apply with split_head_dim (P^T goes through shared memory)"),
            (not config.dq_swap_ab, "dq_swap_ab is not built with split_head_dim"),
            (not config.grads_transposed, "split_head_dim and grads_transposed exclude each other"),
        ]
    elif config.grads_transposed:
        checks += [
            (dtype_name in DTYPES, lambda: f"grads_transposed is built for 16-bit dtypes, got {dtype_name!r}"),
            (config.block_m == 64,
             lambda: f"block_m ({config.block_m}) must be 64 with grads_transposed: S's rows are one 64-row WGMMA "
                     "tile that the warpgroups share along its keys"),
            (config.block_n % (16 * nwg) == 0,
             lambda: f"block_n ({config.block_n}) must split into multiples of 16 keys over the {nwg} warpgroups "
                     "(grads_transposed)"),
            (head_dim % 64 == 0,
             lambda: f"head_dim ({head_dim}) must be a multiple of 64 with grads_transposed: dK^T and dV^T are "
                     "64-row WGMMA tiles along D"),
            (not config.dv_after_ds, "dv_after_ds does not apply with grads_transposed (P goes through shared memory)"),
            (not config.dq_swap_ab, "dq_swap_ab is not built with grads_transposed"),
        ]
    else:
        checks.append((config.block_n == 64 * nwg,
                       lambda: f"block_n ({config.block_n}) must equal 64 x num_mma_warpgroups ({nwg}): each "
                               "warpgroup's S^T is one 64-row WGMMA tile, the A operand of dV / dK"))
    # bwd_prepare_ahead's passes are whole rows in 64 threads x 8 elements; written and
    # measured for D <= 128.
    checks.append((not config.fused_preprocess or (head_dim <= 128 and 512 % head_dim == 0),
                   lambda: f"fused_preprocess takes head dims that divide 512, up to 128, got {head_dim}"))
    checks.append((not config.fused_postprocess or (with_dq and config.preprocess_in_main and dtype_name in DTYPES
                                                    and backward_postprocess(dtype_name, head_dim,
                                                                             dq_fragment_tile(config)) is None),
                   "fused_postprocess is built for one-launch grids (config.one_launch_config): 16-bit, with dQ and "
                   "fused_preprocess, not deterministic, a head dim the postprocess takes"))
    if with_dq:
        checks.append((config.dq_stages * nwg <= MAX_DQ_TILE_CHUNKS,
                       f"dq_stages x num_mma_warpgroups must be at most {MAX_DQ_TILE_CHUNKS} "
                       "(two named barriers per staged chunk, 16 in all)"))
        if config.dq_swap_ab:
            checks += [
                (config.dq_atom_m == 1, "dq_swap_ab needs dq_atom_m 1"),
                (head_dim == 64 * nwg,
                 lambda: f"dq_swap_ab needs head_dim ({head_dim}) = 64 x num_mma_warpgroups ({nwg}): each "
                         "warpgroup computes 64 rows of dQ^T"),
            ]
        else:
            checks += [
                (config.block_m == 64 * config.dq_atom_m,
                 lambda: f"block_m ({config.block_m}) must equal 64 x dq_atom_m ({config.dq_atom_m})"),
                (nwg % config.dq_atom_m == 0,
                 lambda: f"dq_atom_m ({config.dq_atom_m}) must divide num_mma_warpgroups ({nwg})"),
                ((head_dim * config.dq_atom_m) % (16 * nwg) == 0,
                 lambda: f"head_dim ({head_dim}) does not split into multiples of 16 over the dQ GEMM's "
                         f"{nwg // config.dq_atom_m} warpgroups (8-column slices fault at run time: "
                         "perf/NOTES.md, thirteenth session)"),
            ]
    return _first(checks)


def _split_gradients(dtype_name: str, head_dim: int, grad_columns) -> list:
    """Split operands' gradients: every column in one launch up to SPLIT_BACKWARD_MAX_HEAD_DIM,
    above it the scaled halves' chunks of GRAD_CHUNK (gradient_chunks)."""
    if grad_columns is None:
        return [(head_dim <= SPLIT_BACKWARD_MAX_HEAD_DIM,
                 lambda: f"head_dim ({head_dim}) must be at most {SPLIT_BACKWARD_MAX_HEAD_DIM} for a {dtype_name} "
                         "backward's gradients in one launch (its tiles hold both parts; the scaled halves' wider "
                         "ones come in gradient chunks)")]
    first, columns = grad_columns
    return [
        (dtype_name == SCALED_HALVES, lambda: f"gradient chunks are built for {SCALED_HALVES!r}, got {dtype_name!r}"),
        (columns == GRAD_CHUNK and first % columns == 0 and head_dim % columns == 0 and first < head_dim,
         lambda: f"grad_columns {grad_columns} must be a chunk of {GRAD_CHUNK} columns of the {head_dim}-wide tile "
                 "(gradient_chunks)"),
    ]


def dq_fragment_tile(config) -> tuple:
    """What the order of the main kernel's dQ fragments in dq_accum depends on: (block_m,
    dq_atom_m, num_mma_warpgroups, dq_swap_ab); the postprocess binary is keyed by it."""
    return (config.block_m, config.dq_atom_m, config.num_mma_warpgroups, config.dq_swap_ab)


def backward_postprocess(dtype_name: str, head_dim: int, fragment_tile) -> str | None:
    """kernels/bwd_postprocess.py, BackwardPostprocess: the main kernel's consumer threads,
    POSTPROCESS_VALUES elements of a row each (whole rows of them store: 192 of 256 at D = 192)."""
    threads = THREADS_PER_WARPGROUP * fragment_tile[2]
    return _first([
        (dtype_name in DTYPES, lambda: f"dtype must be one of {DTYPES}, got {dtype_name!r}"),
        (head_dim % POSTPROCESS_VALUES == 0 and head_dim // POSTPROCESS_VALUES <= threads,
         lambda: f"head_dim ({head_dim}) not supported by the dQ postprocess: a row of {POSTPROCESS_VALUES}-element "
                 f"stores must fit its {threads} threads"),
    ])


def separate_dq(dtype_name: str, head_dim: int, config, grad_columns: tuple | None = None) -> str | None:
    """kernels/bwd_dq_sm90.py, FlashBackwardDqSm90, with a SeparateDqConfig; grad_columns:
    (first column, columns) of dQ that it computes (gradient_chunks), None: all of them."""
    # (16-bit: head dims the long sequences it serves were measured at; float32's backward
    # always takes it, at every native tile.)
    multiple = 16 if dtype_name in FLOAT32_DTYPES else 64
    split = dtype_name in SPLIT_DTYPES
    return _first(_common(dtype_name, head_dim, multiple=multiple, dtypes=BACKWARD_DTYPES)
                  + (_split_gradients(dtype_name, head_dim, grad_columns) if split
                     else [(grad_columns is None, "gradient chunks are built for split operands")]) + [
        (config.block_n % 16 == 0 and 16 <= config.block_n <= 128,
         _key(config, "block_n", "a multiple of 16 in [16, 128]")),
        (1 <= config.num_stages <= 4, _key(config, "num_stages", "in [1, 4]")),
        # bwd_dq_sm90.REGISTER_SPLIT has a register split for 2 consumer warpgroups (and 1,
        # which float32x3 takes above D = 64).
        (config.num_mma_warpgroups in ((1, 2) if split else (2,)),
         _key(config, "num_mma_warpgroups", "1 or 2 (float32x3)" if split else "2")),
        _block_m_per_warpgroup(config),
    ])


def for_entry(direction: str, dtype_name: str, head_dim: int, config, value_head_dim: int | None = None
              ) -> str | None:
    """The rules of every kernel a config entry of `direction` builds: fwd the forward and bwd
    the main kernel with a value tile of their own where value_head_dim is given; bwd the
    preprocess, the main kernel and the postprocess (the separate-dQ path's dK/dV-only main
    kernel takes a config derived from it with the dQ fields reset); bwd_dq the dQ kernel.
    Forward and 16-bit backward entries may name a value tile of their own."""
    if value_head_dim is not None and not (direction == "fwd" or (direction == "bwd" and dtype_name in DTYPES)):
        return (f"value_head_dim: only forward and 16-bit backward entries have a value tile of their own (got a "
                f"{dtype_name} {direction} entry)")
    if direction == "fwd":
        return forward(dtype_name, head_dim, config, value_head_dim)
    if direction == "bwd" and dtype_name in FLOAT32_INPUTS:
        # float32: preprocess, the dK/dV-only main kernel, and the dQ kernel of the bwd_dq entry.
        # (Every chunk of the gradients has the first one's width.)
        return backward_preprocess(dtype_name, head_dim) or backward(
            dtype_name, head_dim, config, with_dq=False, grad_columns=gradient_chunks(dtype_name, head_dim)[0])
    if direction == "bwd":
        return (backward_preprocess(dtype_name, head_dim)
                or backward(dtype_name, head_dim, config, value_head_dim=value_head_dim)
                or backward_postprocess(dtype_name, head_dim, dq_fragment_tile(config)))
    if direction == "bwd_dq":
        return separate_dq(dtype_name, head_dim, config, gradient_chunks(dtype_name, head_dim)[0])
    raise ValueError(f"unknown direction {direction!r}")
