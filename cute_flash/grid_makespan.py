"""How long a forward grid runs on a GPU's SMs, modelled from its tiles: what config.grid_fitted
weighs to choose between an entry's tile and the two-warpgroup tile it falls back to.

The forward launches one CTA per tile (one per SM at a time for the tiles it weighs, D = 64's
and D = 128's: their registers), and the hardware starts the next tile, in tile number order,
on the first SM that frees (kernels/tile_scheduler.py: causal grids longest first, in sections
of (head, batch) pairs). The model replays that order: each SM takes the next tile when its last
one ends, and the grid takes as long as its busiest SM. A tile costs a fixed start and end, in proportion to its
rows (Q's load, the pipeline's fill, O's store), plus its key blocks at its tile's speed per
score.

Why a model and not a threshold on tiles per SM: a grid finishes in rounds of tiles, and how
the last round fills decides between a taller tile (fewer, longer tiles, faster per score) and
a shorter one. At D = 128 on an H200 the 192-row tile ran 1.34x as fast as the 128-row one on
(1, 4, 6144) (one round against two) and 0.976x on (1, 28, 8192) (9.1 tiles per SM), both
with full masks; causal grids, whose tiles differ in length, round otherwise again. The
forty-ninth session's threshold (8 tiles per SM) ran the slower tile on 24 of 48 measured grids
(most of them picked where the two rules disagree), this model on one (0.8 % lost; perf/NOTES.md,
fiftieth session). At D = 64 the two-warpgroup tile runs up to 1.2x faster on small grids
(fifty-first session).
"""

import functools
import heapq

from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.rules import L2_SECTION_BYTES
from cute_flash.kernels.sections import section_sizes

# A tile's fixed start and end (Q's load, the pipeline's fill, O's normalisation and store), in
# keys per query row of the tile: it costs as much as each of its rows computing this many more
# scores, so a taller tile pays more. Fitted with the entries' speed_over_fitted to 55 grids of
# bf16 D = 128 (192 x 80 tiles against 128 x 128, 1.06) and 33 of D = 64 (192 x 128 against
# 128 x 128, 1.24), full and causal, 1 to 31 tiles per SM (H200, same-run ratios; perf/NOTES.md,
# fiftieth and fifty-first sessions): the choice costs at most 0.6 % on one D = 128 grid and
# nothing at D = 64. A fixed cost per tile regardless of its rows (three 128 x 128 blocks, the
# fiftieth session's form) picked the slower tile at D = 64 on the short sequences, where the
# 192-row tile's start and end weigh most (S = 1024 causal: 7-8 % lost).
TILE_FIXED_KEYS = 256

# From this many of the shorter tile's tiles per SM on, the last round's rounding is below the
# taller tile's measured speed gain, and the model is not run (its cost grows with the grid).
ROUNDS_WITHOUT_MODEL = 64


@functools.lru_cache(maxsize=4096)
def grid_time(problem: AttentionProblem, block_m: int, block_n: int, speed: float, pairs: int, rows: int,
              seqlen_k: int, pair_row_bytes: int, num_sms: int) -> float:
    """The modelled time, in scores of the reference tile, of a forward grid of `pairs`
    (batch, head) units of `rows` query rows over seqlen_k keys on tiles of block_m x block_n
    that compute `speed` times the reference tile's scores per unit time; pair_row_bytes: the
    bytes per key of K and V (the causal grids' sections)."""
    fixed = TILE_FIXED_KEYS * block_m
    per_block = block_m * block_n / speed
    return _makespan([fixed + per_block * blocks for blocks in tile_key_blocks(
        problem, block_m, block_n, pairs, rows, seqlen_k, pair_row_bytes)], num_sms)


def tile_key_blocks(problem: AttentionProblem, block_m: int, block_n: int, pairs: int, rows: int, seqlen_k: int,
                    pair_row_bytes: int) -> list:
    """The key blocks each tile of the grid walks, in tile number order (TileScheduler)."""
    group = max(problem.row_heads, 1)
    seqlen_q = -(-rows // group)  # query positions (row_heads: G rows per position)
    blocks = -(-rows // block_m)
    per_block = [_key_blocks(problem, m, block_m, block_n, group, seqlen_q, seqlen_k) for m in range(blocks)]
    if not problem.causal:
        return per_block * pairs  # m_block fastest, every pair alike
    # Longest first (the last query block first), block-major within sections of pairs
    # (kernels/sections.py).
    most = 1 if problem.packed or not pair_row_bytes else L2_SECTION_BYTES // pair_row_bytes // max(seqlen_k, 1)
    small, larger, sections = section_sizes(pairs, most)
    order = []
    for section in range(sections):
        in_section = small + (section < larger)
        for m in reversed(range(blocks)):
            order += [per_block[m]] * in_section
    return order


def _key_blocks(problem: AttentionProblem, m_block: int, block_m: int, block_n: int, group: int, seqlen_q: int,
                seqlen_k: int) -> int:
    """The key blocks query block m_block walks (kernels/block_ranges.BlockRanges.key_blocks, its
    rows read as positions: G rows per position with row_heads), its padding rows past Sq
    included as the kernel includes them."""
    first = m_block * block_m // group
    end = -(-(m_block + 1) * block_m // group)
    offset = seqlen_k - seqlen_q if problem.bottom_right else 0
    keys = seqlen_k
    if problem.right is not None:
        keys = max(min(seqlen_k, end + offset + problem.right), 0)
    start = 0
    if problem.left is not None:
        start = max(first + offset - problem.left, 0) // block_n
    return max(-(-keys // block_n) - start, 1)  # a tile whose rows see no key walks one block


def _makespan(costs: list, num_sms: int) -> float:
    """Each of num_sms SMs takes the next cost when its last one ends; the last to end."""
    if len(costs) <= num_sms:
        return max(costs, default=0.0)
    ends = costs[:num_sms]
    heapq.heapify(ends)
    for cost in costs[num_sms:]:
        heapq.heapreplace(ends, ends[0] + cost)
    return max(ends)
