"""Tile configurations: YAML data per GPU, loaded through one dataclass per direction.

A file `configs/<gpu>.yaml` lists entries; each matches (dtype, head_dim, causal, direction)
and names a tile config (TileConfig for `fwd`, BackwardTileConfig for `bwd`,
SeparateDqConfig for `bwd_dq`: when and how the backward computes dQ in its own kernel):

    gpu: NVIDIA H100 80GB HBM3
    entries:
      - match: {dtype: float16, head_dim: 128, causal: false, direction: fwd}
        config: {block_m: 128, block_n: 128, num_stages: 2, num_mma_warpgroups: 2, pingpong: true,
                 rescale_before_pv: false}
        measured: {...}   # optional, written by the tuner; kept on the entry, never used to pick

A config's fields with a default (the forward's rescale_before_pv, the backward's
deterministic) may be left out of an entry: files written before such a field existed load.

An entry may also name the sequence length it was tuned at (`seqlen` in `match`; the tuner
writes it). Selection rule for a call of sequence length S = max(Sq, Sk): among the entries
of its (dtype, head_dim, causal, direction) that name a seqlen, the one nearest to S in
log2 (ties go to the longer); an entry without seqlen is used only when none of that key
names one. So a shape that was not tuned explicitly runs the config tuned nearest to it.

A forward entry's tile is what a call of many rows on a large grid runs; the host derives the
others from it (launch_fwd.kernel_for): fewer consumer warpgroups for few rows (rows_fitted),
two where a model of the grid's rounds of tiles says they finish first (grid_fitted, for
entries with speed_over_fitted), both on its fitted_block_n keys; one for a narrow band
(band_fitted); clusters of query heads only where they apply (heads_clustered).

Head dims: an entry's head_dim is a native tile. A call of another head dim D runs on the
smallest native tile >= D of its (dtype, direction) (tile_head_dim), with its config: the
kernels read D columns through TMA (zero fill past D) and write D columns, so the padding
never reaches memory (cute_flash.head_dims). A forward entry may also name a value tile of its
own (`value_head_dim` in `match`, below head_dim: V and O narrower than Q and K, as DeepSeek's
(192, 128)); a forward call of head dims (D, Dv) runs on the native pair (T, Tv) with T >= D
and Tv >= Dv that has the fewest columns T + Tv, where an entry without value_head_dim is the
pair (T, T) (tile_head_dims). The backward runs a pair on the square tile serving max(D, Dv).

Which file: the device name picks it ("NVIDIA H100 80GB HBM3" -> h100.yaml, "NVIDIA H200"
-> h200.yaml) when that file exists; any other compute-capability 9.x part uses h100.yaml.
Which directory (default_config_dir): CUTE_FLASH_CONFIG_DIR when set; else the package's own
`configs/` (cute_flash/configs/ of an installed wheel, built from the repository's top-level
configs/); else the source checkout's top-level configs/ (editable installs, PYTHONPATH runs).

Every switch a config has is used by a shipped entry (configs/h100.yaml) or by a variant the
host derives from one (the deterministic backward, the separate-dQ path, a forward fitted to
few rows: rows_fitted), or is a tuner dimension; the field comments say which. Code that no shipped config reached (the forward's
persistent grid and non-overlapped main loop, the backward's shared-memory P/dS variant and
per-thread dQ atomics) was deleted: git history has it.
"""

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from cute_flash import grid_makespan
from cute_flash.kernels import rules

logger = logging.getLogger(__name__)

DEFAULT_GPU_FILE = "h100.yaml"
# Defined with the rule that bounds dq_stages x num_mma_warpgroups; the kernels import it from here.
MAX_DQ_TILE_CHUNKS = rules.MAX_DQ_TILE_CHUNKS
DIRECTIONS = ("fwd", "bwd", "bwd_dq")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class TileConfig:
    """Tiles of the forward kernel (cute_flash/kernels/fwd_sm90.py): one CTA per block_m query
    rows, QK^T of key block j issued before PV of block j-1 (intra-warpgroup overlap), P in
    registers as the A operand of P V."""

    block_m: int  # query rows per CTA: 64 per consumer warpgroup
    block_n: int  # keys per pipeline stage
    num_stages: int  # depth of the K/V shared-memory rings
    # Consumer warpgroups (the producer warpgroup is extra): 3 ships for D <= 96 and for D = 128
    # at S = 8192, 2 for D = 128 at S = 4096 and above D = 128; fewer where a call's rows do not
    # fill them (rows_fitted) or its grid is small (grid_fitted).
    num_mma_warpgroups: int
    # Consumer warpgroups take turns issuing their GEMMs. Every shipped entry has it on; off
    # is a tuner dimension (2-4 % slower in same-run comparisons, perf/NOTES.md, though one
    # tuning run picked it within noise).
    pingpong: bool
    # Where O's rows are rescaled to a block's new row maxima: false right after that block's
    # P V completes; true one block later, while the next S = Q K^T runs and before the P V
    # that adds to O is issued. Set by hand where same-run measurements agreed (perf/NOTES.md,
    # thirty-first and thirty-sixth sessions): on for the 16-bit D = 64 non-causal entries.
    rescale_before_pv: bool = False
    # O rescaled after every key block (flash-attn-4's way), not only where a row of the warp
    # changed its maximum (a vote and a branch). Unconditional, its FMULs are interleaved by
    # ptxas with the softmax's exp2s, which the branch kept them (and the P conversions) after.
    # On for the 16-bit D = 64 causal entries (perf/NOTES.md, fifty-third session).
    rescale_every_block: bool = False
    # Query heads per thread-block cluster (1 or 2). With 2, the CTAs of one query block of two
    # neighbouring query heads that read the same K/V head (grouped-query attention) walk the
    # same key blocks, and each loads half of every K and V stage by TMA multicast into both:
    # half the L2-to-SM traffic of K and V. Dense GQA batches whose group is even only
    # (rules.cluster_heads); elsewhere the host runs the entry with 1.
    cluster_heads: int = 1
    # The key block of the tiles rows_fitted derives from this entry (fewer consumer
    # warpgroups, for calls with fewer rows: decode steps, short prefills, narrow bands); 0:
    # block_n. Three warpgroups get 160 registers per thread, which hold the scores of 80 keys
    # at D = 128, where one or two get 240, room for 128 (the key block those calls were
    # measured on).
    fitted_block_n: int = 0
    # How many times faster per score this entry's tile runs than the two-warpgroup tile
    # rows_fitted derives from it (on fitted_block_n keys), on grids large enough that their
    # last round does not count: grid_fitted runs whichever of the two cute_flash.grid_makespan's
    # model finishes first on the call's grid. 0: always the entry's tile. A grid finishes in
    # rounds of tiles, and its last round can cost a taller tile more than its speed gains:
    # D = 128's 192-row tiles ran 1.34x as fast as 128-row ones on one grid and 0.976x on
    # another (H200, perf/NOTES.md, fiftieth session).
    speed_over_fitted: float = 0.0
    # The key block of calls with a softcap (0: block_n), on as many consumer warpgroups. A
    # bf16 softcap sums the rounded probabilities on the tensor cores only where a consumer
    # thread has registers left beside its S, P and O fragments (kernels/probability_sums.py):
    # D = 96's 192 x 112 tile has not, 192 x 96 has, and ran 1.22 / 1.25 (causal / full) of
    # the time without a softcap against 192 x 112's 1.33, while without a softcap it is 1 %
    # slower (H200, perf/NOTES.md, sixty-fifth session). softcap_fitted applies it.
    softcap_block_n: int = 0


# Clusters of query heads (TileConfig.cluster_heads) run where the grid has at least this many
# tiles per SM. Issue 23's prefill (2048 queries over 32k keys, 32 / 8 heads, bf16 D = 128,
# H200, same run): 3-4 % faster at B = 4 (15.5 tiles per SM), 0.5-1 % slower at B = 2 (7.8) and
# 1.5-5 % slower at B = 1 (3.9) in the flushed benchmark (perf/NOTES.md, thirty-fifth session).
CLUSTER_MIN_WAVES = 8


def takes_clusters(config: TileConfig, problem) -> bool:
    """Whether `problem`'s kernels can run the entry's clusters of query heads
    (rules.cluster_heads); the host runs every other problem with cluster_heads 1."""
    return config.cluster_heads > 1 and rules.cluster_heads(problem, config.cluster_heads) is None


def without_clusters(config: TileConfig) -> TileConfig:
    """The entry with one query head per cluster (what a problem without clusters runs)."""
    return dataclasses.replace(config, cluster_heads=1)


def heads_clustered(config: TileConfig, problem, batch: int, heads: int, kv_heads: int, seqlen_q: int,
                    num_sms: int) -> TileConfig:
    """The forward config a call of `batch` x `heads` query heads on `kv_heads` K/V heads and
    seqlen_q query rows runs: the entry's cluster_heads where the problem allows them
    (rules.cluster_heads), the group divides into clusters and the grid has CLUSTER_MIN_WAVES
    tiles per SM; else cluster_heads 1."""
    if config.cluster_heads == 1:
        return config
    fits = (takes_clusters(config, problem) and 0 < kv_heads < heads
            and (heads // kv_heads) % config.cluster_heads == 0
            and _grid_tiles(config, batch, heads, seqlen_q) >= CLUSTER_MIN_WAVES * num_sms)
    return config if fits else without_clusters(config)


def grid_fitted(config: TileConfig, problem, batch: int, heads: int, rows: int, seqlen_k: int,
                pair_row_bytes: int, num_sms: int) -> TileConfig:
    """The forward config of a grid of `batch` x `heads` (batch, head) units of `rows` query
    rows over seqlen_k keys (0, 0: unknown, run as a small grid; a packed batch counts its
    longest sequence alone, a lower bound): the entry, or rows_fitted's two-warpgroup tile where
    cute_flash.grid_makespan models that one to finish first (entries with
    speed_over_fitted). pair_row_bytes: K's and V's bytes per key."""
    fitted = rows_fitted(config, 128)
    if not config.speed_over_fitted or fitted is config:
        return config
    units = batch * heads
    if not units * rows:
        return fitted  # an unknown grid: the tile of small ones
    if _grid_tiles(fitted, batch, heads, rows) >= grid_makespan.ROUNDS_WITHOUT_MODEL * num_sms:
        return config
    entry_time = grid_makespan.grid_time(problem, config.block_m, config.block_n, config.speed_over_fitted, units,
                                         rows, seqlen_k, pair_row_bytes, num_sms)
    fitted_time = grid_makespan.grid_time(problem, fitted.block_m, fitted.block_n, 1.0, units, rows, seqlen_k,
                                          pair_row_bytes, num_sms)
    return config if entry_time <= fitted_time else fitted


def _grid_tiles(config: TileConfig, batch: int, heads: int, rows: int) -> int:
    """The forward tiles of `batch` x `heads` (batch, head) units of `rows` query rows each."""
    return batch * heads * -(-rows // config.block_m)


def softcap_fitted(config: TileConfig, problem) -> TileConfig:
    """The forward config of `problem`: with a softcap, the entry on its softcap_block_n keys
    (its tiles of fewer warpgroups, rows_fitted's, keep the entry's key block); else the
    entry."""
    if not (problem.softcap and config.softcap_block_n):
        return config
    return dataclasses.replace(config, block_n=config.softcap_block_n, softcap_block_n=0,
                               fitted_block_n=config.fitted_block_n or config.block_n)


def rows_fitted(config: TileConfig, rows: int) -> TileConfig:
    """The forward config a call runs whose query tiles have `rows` rows at most (the rows of
    one (batch, head): Sq, a decode step's group of query heads, a packed batch's longest
    sequence): no more consumer warpgroups than those rows fill (64 each), without ping-pong
    below two. A warpgroup past the rows computes padding only, and with ping-pong the real
    rows' GEMMs wait for its turn: a decode step (32 / 8 heads: 4 rows) took 1.37x the time
    of one warpgroup's at B = 1 over 4k keys (perf/NOTES.md, thirty-third session)."""
    warpgroups = max(1, min(config.num_mma_warpgroups, -(-rows // 64)))
    if warpgroups == config.num_mma_warpgroups:
        return config
    return dataclasses.replace(config, block_m=64 * warpgroups, num_mma_warpgroups=warpgroups,
                               pingpong=config.pingpong and warpgroups > 1,
                               block_n=config.fitted_block_n or config.block_n, fitted_block_n=0, speed_over_fitted=0.0)


# A band of at most this many keys per row (left + right + 1: a narrow window) runs on tiles
# of one warpgroup (64 query rows), where two such CTAs share an SM (K / V rows of at most
# NARROW_BAND_ROW_BYTES). A tile's keys span its positions plus the band, so fewer positions
# per tile compute fewer masked scores, and the two CTAs overlap each other's per-tile fixed
# cost, which weighs when a tile walks two or three key blocks. Measured at one clock (H200,
# bf16 D = 64, perf/NOTES.md, thirty-ninth session) against the shipped 192-row tiles: 32
# heads, 127-key window 1.25x; gpt-oss's group of 8 as rows, 127 keys 1.045x, 255 keys
# 1.035x, 1023 keys 0.95x. At D = 128 (one CTA per SM) 0.73x.
NARROW_BAND_KEYS = 256
NARROW_BAND_ROW_BYTES = 128


def band_fitted(config: TileConfig, problem, row_bytes: int) -> TileConfig:
    """The forward config of a problem whose band is narrow (NARROW_BAND_KEYS) on K / V rows
    of `row_bytes` (the wider tile head dim x the element size): one consumer warpgroup
    (rows_fitted's 64-row tile); every other problem runs `config`."""
    left, right = problem.left, problem.right
    if left is None or right is None or left + right + 1 > NARROW_BAND_KEYS or row_bytes > NARROW_BAND_ROW_BYTES:
        return config
    return rows_fitted(config, 64)


@dataclass(frozen=True)
class BackwardTileConfig:
    """Tiles of the backward kernel: one CTA per block_n keys, walking block_m query rows at
    a time (meaning of each field: cute_flash/kernels/bwd_sm90.py)."""

    block_m: int  # query rows per inner step: 64 x dq_atom_m (80, 96, 112 with dq_swap_ab)
    block_n: int  # keys per CTA: 64 x num_mma_warpgroups
    num_stages: int  # depth of the Q ring
    # Depth of the dO ring: num_stages, or fewer where both rings at num_stages do not fit
    # (grads_transposed at D = 192: Q two deep, dO one, as flash-attn-4's D = 192 step).
    num_stages_do: int
    # Shared-memory buffers for dS: 1 or num_stages. 2 ships for 16-bit D = 16 to 128.
    num_stages_pds: int
    num_mma_warpgroups: int  # consumer warpgroups, 64 key rows each
    # Consumer warpgroups stacked along query rows in the dQ GEMM: 2 ships for D=64, 1 for D=128.
    dq_atom_m: int
    # dQ additions in a fixed order of key blocks (semaphore per query block): bitwise
    # reproducible dQ, somewhat slower. False in every shipped entry; the host runs the entry
    # with True under torch.use_deterministic_algorithms (launch_bwd).
    deterministic: bool = False
    # dQ^T = K^T dS^T instead of dQ = dS K: the warpgroups split the head dim, so block_m
    # needs no multiple of 64 (e.g. 80, FA3's non-causal D=128 step). Ships in the fp16 D=128
    # entries (80-row step).
    dq_swap_ab: bool = False
    # Issue dV += P^T dO only after dS is formed (P^T converted to 16 bits then), instead of
    # before. Less overlap of the dS math with that GEMM, but P^T's 16-bit copy is never live
    # beside S^T and dP^T in fp32: ~20 registers fewer at block_m 80. Ships in every fp16 entry
    # and the bf16 D=64 ones; the bf16 D=128 entries have it off.
    dv_after_ds: bool = False
    # Shared-memory dQ tiles of the writer warp. With 2 the consumers stage the next query
    # block's dQ while the writer's bulk reduction of the previous one still reads its tile
    # (they waited for that read at the tile hand-off: the reductions queue behind L2).
    # 1 ships everywhere: D = 16 to 64 take a second dS buffer instead (fortieth session).
    dq_stages: int = 1
    # The main kernel's idle producer warps do the preprocess (delta, LSE * log2(e), zeroed
    # dQ accumulator) of the heads launched a few heads after their own, so that only the
    # first heads need the separate, memory-bound preprocess. Ignored in deterministic mode
    # and with the separate dQ kernel. Ships in the D=128 non-causal entries.
    fused_preprocess: bool = False
    # The consumer warpgroups split the head dim of dK and dV (and the queries of S^T and
    # dP^T) instead of owning 64 keys each: block_n = 64, P^T and dS^T go through shared
    # memory. For D > 128, where one warpgroup's dK and dV of 64 keys x D (D floats per
    # thread) leave no registers for the step. Ships in the D = 192 and 256 entries.
    split_head_dim: bool = False
    # The consumer warpgroups split the CTA's keys (block_n / num_mma_warpgroups each, e.g. 48
    # of 96) and hold dK^T and dV^T (D x their keys): S and dP are computed with the queries
    # as rows (block_m = 64), P and dS go through shared memory. More keys per CTA than
    # split_head_dim's 64 at the same registers, so fewer partial dQ tiles are added into
    # the fp32 accumulator (flash-attn-4's D = 192 step: its dQ reductions bound the L2).
    grads_transposed: bool = False
    # The step's exp2s (P^T) pinned above the wait for dP^T (a branch ends the basic block),
    # so that they run while dP^T is on the tensor cores: 3 % faster at D = 128's 80-row step,
    # where dP^T's GEMM and the exp2s take about as long. With False ptxas sinks most of them
    # below the wait, among the dS math (flash-attn-4's D = 64 step): where dP^T's GEMM is short
    # beside the exp2s. False ships only in the 16-bit D = 32 causal entries (pinned_exp_columns
    # pins part of them in the other D <= 64 ones and at D = 96 but bf16 non-causal).
    exps_above_dp_wait: bool = True
    # A causal dense grid's key blocks numbered longest first across sections of this many
    # (head, batch) pairs (kernels/sections.py, tile_scheduler.sections_fast), instead of per pair (1).
    # Not in deterministic mode nor with the prepare-ahead, whose launch orders carry meaning.
    section_pairs: int = 1
    # With exps_above_dp_wait, only the exp2s of a thread's first this many query columns are
    # pinned above dP^T's wait (0: all); ptxas places the rest among the dS math below it.
    # Pinned, the SFU takes the exp2s back to back and the warp issues nothing in between
    # (ncu, fp16 D = 64: 64 MUFU in a row, each waiting on the previous); dP^T's GEMM there
    # lasts about half of them. Not with a softcap (its exp2s feed P^T's copy for dV). Only
    # the register-A step has them (not split_head_dim / grads_transposed): block_m / 4 columns;
    # block_m / 4 or more pins all, like 0.
    pinned_exp_columns: int = 0
    # The main kernel's last CTA of each query head converts the head's dQ (dq_accum x the
    # scale, to 16 bits) after its own epilogue, so that no postprocess is launched. Never in
    # the YAML: the host derives it for grids run as one launch (one_launch_config), where the
    # launches, not the GPU, bound a small backward; the kernel converts only when the launch
    # asks (launch_bwd.BackwardPlan.converts_dq).
    fused_postprocess: bool = False

    @property
    def preprocess_in_main(self) -> bool:
        """Whether the main kernel (with dQ) does the preprocess of later heads: the one
        rule that the kernel and the launch (launch_bwd.prepare_ahead_plan) both follow."""
        return self.fused_preprocess and not self.deterministic


# A backward grid runs as one launch (one_launch_config) where every CTA can wait for its own
# head's preparation: in one wave (at most one CTA per SM) always; beyond it, each wave
# boundary leaves the CTAs of the head that straddles it waiting, idle, until the head's last
# CTA is dispatched, about as long as a CTA of the first wave runs (key blocks x head dim).
# So up to ONE_LAUNCH_WAVES waves, and waves x key blocks per head x the tile's head dim (the
# grid's GPU time, in units) at most ONE_LAUNCH_WAVE_WORK: the small calls that are bound by
# the host, which one launch less serves. Measured (bf16 causal, perf/NOTES.md, sixty-third
# session; us per call between events against three launches; waves x blocks x D):
# (1, 16, 2048, 16 | 64) (2 x 16 x 16 | 64) 2-27 us less; (8, 16, 512, 64 | 128) and
# (16, 16, 256, 64) (4 x 4 x 64 | 128, 4 x 2 x 64) 9-18 us less; (4, 16, 1024, 64) (4 x 8 x 64)
# 22 less; above the bound (4, 16, 1024, 128) 6.6 more and (1, 16, 2048, 128) 3.6 more on a
# fast host (22-28 less on slow ones); (4, 32, 1024, 64) and (8, 16, 1024, 128) (8 waves)
# 5-30 more.
ONE_LAUNCH_WAVES = 4
ONE_LAUNCH_WAVE_WORK = 32 * 64


def runs_as_one_launch(units: int, key_blocks: int, tile: int, num_sms: int) -> bool:
    """Whether a backward grid of `units` (batch, key/value head) units of key_blocks CTAs each,
    on a tile of head dim `tile`, may run as one launch (see ONE_LAUNCH_WAVES)."""
    ctas = units * key_blocks
    return ctas <= num_sms or (ctas <= ONE_LAUNCH_WAVES * num_sms
                               and ctas * key_blocks * tile <= ONE_LAUNCH_WAVE_WORK * num_sms)


def one_launch_config(config: "BackwardTileConfig", dtype_name: str, problem, tile: int, head_dim: int,
                      value_head_dim: int, units: int, key_blocks: int, num_sms: int) -> "BackwardTileConfig":
    """The backward config of a grid of `units` units of key_blocks CTAs: where it runs as one
    launch (runs_as_one_launch), the entry with fused_preprocess and fused_postprocess, so that
    the main kernel prepares every head (and may convert its dQ) and no preprocess is launched
    (launch_bwd.BackwardPlan.one_launch: a small backward's host time is mostly launches);
    `config` otherwise, and where the rules do not take fused_preprocess
    (head dims that do not divide 512, a value tile of its own, packed, float32,
    deterministic) or with a softcap (whose lean step keeps the preparing warps out)."""
    if (not runs_as_one_launch(units, key_blocks, tile, num_sms) or config.deterministic
            or dtype_name not in rules.DTYPES or problem.packed or problem.softcap or tile != head_dim
            or value_head_dim != head_dim):
        return config
    # (Section order is not kept where the main kernel prepares heads: the per-pair key.)
    fused = dataclasses.replace(config, fused_preprocess=True, section_pairs=1, fused_postprocess=True)
    return fused if rules.backward(dtype_name, tile, fused) is None else config


@dataclass(frozen=True)
class SeparateDqConfig:
    """When the backward computes dQ in its own kernel (cute_flash/kernels/bwd_dq_sm90.py)
    instead of accumulating it in an fp32 buffer of 2 x Q's size, and that kernel's tiles.

    The separate kernel recomputes S and dP (7 GEMMs per tile pair instead of 5), so it is
    for long sequences, where the accumulator is the backward's one large allocation."""

    min_seqlen_q: int  # Sq from which the separate dQ kernel runs (0: never)
    block_m: int  # query rows per CTA: 64 per consumer warpgroup
    block_n: int  # keys per pipeline stage
    num_stages: int  # depth of the K/V shared-memory rings
    num_mma_warpgroups: int  # consumer warpgroups (2: the one split the kernel has)

    def applies(self, seqlen_q: int) -> bool:
        return 0 < self.min_seqlen_q <= seqlen_q


CONFIG_CLASSES = {"fwd": TileConfig, "bwd": BackwardTileConfig, "bwd_dq": SeparateDqConfig}


def _check_field_types(config, where: str) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        want = bool if f.type in (bool, "bool") else float if f.type in (float, "float") else int
        # bool is an int subclass: keep true/false out of the integer fields and vice versa
        # (a float field takes a YAML integer too: `1` for 1.0).
        if type(value) is not want and not (want is float and type(value) is int):
            raise ConfigError(f"{where}: key '{f.name}' must be {want.__name__}, got {value!r}")


def validate(direction: str, dtype: str, head_dim: int, config, where: str = "config",
             value_head_dim: int | None = None) -> None:
    """ConfigError unless `config` (of CONFIG_CLASSES[direction]) is usable for (dtype,
    head_dim, value_head_dim): its fields have their types, the policy fields their ranges,
    and every kernel the entry builds can implement it (the kernels' own rules,
    cute_flash.kernels.rules)."""
    _check_field_types(config, where)
    if direction == "bwd_dq" and config.min_seqlen_q < 0:
        raise ConfigError(f"{where}: key 'min_seqlen_q' must be >= 0, got {config.min_seqlen_q!r}")
    reason = rules.for_entry(direction, dtype, head_dim, config, value_head_dim)
    if reason is not None:
        raise ConfigError(f"{where}: {reason}")


@dataclass(frozen=True)
class ConfigEntry:
    dtype: str
    head_dim: int
    causal: bool
    direction: str
    config: object  # TileConfig for fwd, BackwardTileConfig for bwd, SeparateDqConfig for bwd_dq
    # What the tuner measured for this entry (its `measured` mapping), carried so that a
    # tuning run rewriting the file keeps it for the entries it does not tune.
    measured: dict | None = dataclasses.field(default=None, compare=False)
    seqlen: int | None = None  # the sequence length the entry was tuned at (None: any)
    value_head_dim: int | None = None  # a forward value tile of its own (None: head_dim)

    def key(self):
        return (self.dtype, self.head_dim, self.causal, self.direction, self.value_head_dim)


def _nearest(entries, seqlen):
    """The entry for a call of length `seqlen` (None: unknown) by the module's rule."""
    named = [e for e in entries if e.seqlen is not None]
    if not named:
        return entries[0]
    if seqlen is None or seqlen < 1:
        seqlen = max(e.seqlen for e in named)
    return min(named, key=lambda e: (abs(math.log2(e.seqlen) - math.log2(seqlen)), -e.seqlen))


@dataclass(frozen=True)
class ConfigTable:
    path: Path
    gpu: str
    entries: tuple

    def lookup(self, dtype: str, head_dim: int, causal: bool, direction: str, required: bool = True,
               seqlen: int | None = None, value_head_dim: int | None = None):
        """The config for a call of sequence length `seqlen` (the nearest tuned entry, see the
        module docstring) on the tile (head_dim, value_head_dim: None or head_dim for a square
        one); a missing key is an error, or None when not `required`."""
        entry = self.lookup_entry(dtype, head_dim, causal, direction, required, seqlen, value_head_dim)
        return None if entry is None else entry.config

    def lookup_entry(self, dtype: str, head_dim: int, causal: bool, direction: str, required: bool = True,
                     seqlen: int | None = None, value_head_dim: int | None = None):
        """The ConfigEntry that `lookup` takes its config from (None when missing and not
        `required`)."""
        value = None if value_head_dim == head_dim else value_head_dim
        matching = [e for e in self.entries if e.key() == (dtype, head_dim, causal, direction, value)]
        if matching:
            return _nearest(matching, seqlen)
        if not required:
            return None
        raise ConfigError(
            f"{self.path}: no entry for dtype={dtype}, head_dim={head_dim}, causal={causal}, "
            f"direction={direction}" + (f", value_head_dim={value}" if value is not None else "")
        )

    def tile_head_dim(self, dtype: str, head_dim: int, direction: str) -> int | None:
        """The smallest native head dim (one that square entries of this dtype and direction
        name) at least head_dim, or None when there is none."""
        native = [e.head_dim for e in self.entries
                  if e.dtype == dtype and e.direction == direction and e.value_head_dim is None]
        fitting = [d for d in native if d >= head_dim]
        return min(fitting) if fitting else None

    def tile_head_dims(self, dtype: str, head_dim: int, value_head_dim: int, direction: str) -> tuple | None:
        """The native pair (T, Tv) serving head dims (head_dim, value_head_dim) by the module's
        rule (the fewest columns T + Tv, then the narrower T), or None when none does."""
        native = {(e.head_dim, e.value_head_dim or e.head_dim) for e in self.entries
                  if e.dtype == dtype and e.direction == direction}
        fitting = [(t, tv) for t, tv in native if t >= head_dim and tv >= value_head_dim]
        return min(fitting, key=lambda pair: (pair[0] + pair[1], pair[0])) if fitting else None


_MATCH_KEYS = {"dtype": str, "head_dim": int, "causal": bool, "direction": str}
_OPTIONAL_MATCH_KEYS = {"seqlen": int, "value_head_dim": int}


def _check_keys(where: str, mapping, required: dict, optional=()) -> None:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    unknown = sorted(set(mapping) - set(required) - set(optional))
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (allowed: {', '.join(list(required) + list(optional))})")
    missing = [k for k in required if k not in mapping]
    if missing:
        raise ConfigError(f"{where}: missing key '{missing[0]}'")


def _parse_entry(path: Path, index: int, raw) -> ConfigEntry:
    where = f"{path}: entries[{index}]"
    _check_keys(where, raw, {"match": None, "config": None}, optional=("measured",))
    match = raw["match"]
    _check_keys(f"{where}.match", match, _MATCH_KEYS, optional=tuple(_OPTIONAL_MATCH_KEYS))
    for key, want in {**_MATCH_KEYS, **_OPTIONAL_MATCH_KEYS}.items():
        if key in match and type(match[key]) is not want:
            raise ConfigError(f"{where}.match: key '{key}' must be {want.__name__}, got {match[key]!r}")
    if "seqlen" in match and match["seqlen"] < 1:
        raise ConfigError(f"{where}.match: key 'seqlen' must be >= 1, got {match['seqlen']}")
    # float32 has forward entries only: the direction's rule (validate below) says so for the others.
    if match["dtype"] not in rules.FORWARD_DTYPES:
        raise ConfigError(f"{where}.match: key 'dtype' must be one of {rules.FORWARD_DTYPES}, got {match['dtype']!r}")
    if match["direction"] not in DIRECTIONS:
        raise ConfigError(
            f"{where}.match: key 'direction' must be one of {DIRECTIONS}, got {match['direction']!r}"
        )
    config_class = CONFIG_CLASSES[match["direction"]]
    # Fields with a default may be left out (files written before the field existed).
    required = {f.name: None for f in dataclasses.fields(config_class) if f.default is dataclasses.MISSING}
    optional = {f.name: None for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING}
    _check_keys(f"{where}.config", raw["config"], required, optional)
    config = config_class(**raw["config"])
    value = match.get("value_head_dim")
    validate(match["direction"], match["dtype"], match["head_dim"], config, f"{where}.config", value)
    return ConfigEntry(match["dtype"], match["head_dim"], match["causal"], match["direction"], config,
                       raw.get("measured"), match.get("seqlen"), None if value == match["head_dim"] else value)


def load_config_file(path) -> ConfigTable:
    path = Path(path)
    try:
        # The C loader when PyYAML has it: ~2 ms instead of ~16 ms for the shipped file, paid by
        # the first call of every process.
        raw = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    _check_keys(str(path), raw, {"gpu": None, "entries": None}, optional=("tuned",))
    if not isinstance(raw["entries"], list):
        raise ConfigError(f"{path}: key 'entries' must be a list")
    entries = tuple(_parse_entry(path, i, e) for i, e in enumerate(raw["entries"]))
    seen = set()
    for entry in entries:
        if (entry.key(), entry.seqlen) in seen:
            raise ConfigError(f"{path}: duplicate entry for {entry.key()}"
                              + (f" at seqlen {entry.seqlen}" if entry.seqlen is not None else ""))
        seen.add((entry.key(), entry.seqlen))
    return ConfigTable(path, str(raw["gpu"]), entries)


def default_config_dir() -> Path:
    """CUTE_FLASH_CONFIG_DIR, else the packaged configs (a wheel install), else the source
    checkout's top-level configs/ (the directory the wheel's copy is built from)."""
    override = os.environ.get("CUTE_FLASH_CONFIG_DIR")
    if override:
        return Path(override)
    package = Path(__file__).resolve().parent
    packaged = package / "configs"
    return packaged if packaged.is_dir() else package.parent / "configs"


def config_path_for_device(device_name: str, capability: tuple, config_dir=None) -> Path:
    """configs/<gpu>.yaml for a device: 'NVIDIA H200' -> h200.yaml when that file exists;
    other compute capability 9.x parts fall back to h100.yaml."""
    config_dir = Path(config_dir) if config_dir is not None else default_config_dir()
    if capability[0] != 9:
        raise ConfigError(
            f"no tile configs for {device_name} (compute capability {capability[0]}.{capability[1]}): "
            "cute_flash supports Hopper (9.x) only"
        )
    match = re.search(r"\b([A-Z]\d{2,4})\b", device_name.upper())
    if match:
        candidate = config_dir / f"{match.group(1).lower()}.yaml"
        if candidate.exists():
            return candidate
    return config_dir / DEFAULT_GPU_FILE


_tables = {}
_device_tables = {}
# get_config's answers, by (device index, key, required, S): the backward asks twice per call.
_lookups = {}
_tiles = {}
_MAX_LOOKUPS = 4096  # ever-changing shapes must not grow it without bound


def table_for_path(path) -> ConfigTable:
    path = Path(path)
    table = _tables.get(path)
    if table is None:
        table = _tables[path] = load_config_file(path)
    return table


def _device_table(device) -> ConfigTable:
    index = getattr(device, "index", None)
    table = _device_tables.get(index)
    if table is None:
        import torch

        name = torch.cuda.get_device_name(device)
        capability = torch.cuda.get_device_capability(device)
        table = _device_tables[index] = table_for_path(config_path_for_device(name, capability))
    return table


def tile_head_dim(dtype: str, head_dim: int, direction: str, device) -> int:
    """The native head dim whose kernels serve head_dim on `device` (see the module
    docstring); a ConfigError when no entry's is large enough. Cached per device."""
    key = (getattr(device, "index", None), dtype, head_dim, direction)
    tile = _tiles.get(key)
    if tile is None:
        table = _device_table(device)
        tile = table.tile_head_dim(dtype, head_dim, direction)
        if tile is None:
            raise ConfigError(f"{table.path}: no {direction} entry for dtype={dtype} with head_dim >= {head_dim}")
        _tiles[key] = tile
    return tile


def tile_head_dims(dtype: str, head_dim: int, value_head_dim: int, direction: str, device) -> tuple:
    """The native pair of tiles (T, Tv) whose kernels serve head dims (head_dim,
    value_head_dim) on `device` (see the module docstring); a ConfigError when none does.
    Cached per device."""
    key = (getattr(device, "index", None), dtype, head_dim, value_head_dim, direction)
    tiles = _tiles.get(key)
    if tiles is None:
        table = _device_table(device)
        tiles = table.tile_head_dims(dtype, head_dim, value_head_dim, direction)
        if tiles is None:
            raise ConfigError(f"{table.path}: no {direction} entry for dtype={dtype} with head_dim >= {head_dim} "
                              f"and value head dim >= {value_head_dim}")
        _tiles[key] = tiles
    return tiles


def get_config(dtype: str, head_dim: int, causal: bool, direction: str, device, required: bool = True,
               seqlens: tuple | None = None, value_head_dim: int | None = None):
    """The config of `direction` (see CONFIG_CLASSES) for a call on `device` (a torch.device)
    with sequence lengths `seqlens` = (Sq, Sk) (None: unknown), by the module's selection
    rule (S = max(Sq, Sk)), on the native tile head_dim (with value_head_dim: the native pair
    of tiles); tables and answers are cached per device."""
    index = getattr(device, "index", None)
    seqlen = max(seqlens) if seqlens is not None else None
    if value_head_dim == head_dim:
        value_head_dim = None
    lookup_key = (index, dtype, head_dim, causal, direction, required, seqlen, value_head_dim)
    if lookup_key in _lookups:
        return _lookups[lookup_key]
    table = _device_table(device)
    entry = table.lookup_entry(dtype, head_dim, causal, direction, required, seqlen, value_head_dim)
    config = None if entry is None else entry.config
    if entry is None:
        logger.info("%s: no %s entry for dtype=%s head_dim=%d causal=%s (S=%s)", table.path, direction, dtype,
                    head_dim, causal, seqlen)
    else:
        logger.info("%s: dtype=%s head_dim=%d causal=%s %s S=%s -> entry %d (tuned at seqlen %s): %s", table.path,
                    dtype, head_dim, causal, direction, seqlen, table.entries.index(entry), entry.seqlen, config)
    if len(_lookups) >= _MAX_LOOKUPS:
        _lookups.clear()
    _lookups[lookup_key] = config
    return config
