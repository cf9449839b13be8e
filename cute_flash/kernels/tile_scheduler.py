"""Which output tile a CTA computes (which key blocks a tile needs: block_ranges.py).

Tiles are numbered m_block-fastest: consecutive tiles share a (head, batch), so the K/V of
one head is read from L2 by all of its query tiles while it is hot. Under causal masking the
tiles near the end of the sequence do the most work; they get the lowest numbers (longest
processing time first) so the short ones fill the tail.

A packed batch (problem.packed) is numbered without the empty tiles a grid over the longest
sequence would have: per head, the block numbers of SequenceLayout.locate (at most one
per sequence left over: its CTA finds no rows and exits).

A causal dense grid orders longest first across a section of (head, batch) pairs rather
than within each pair: tiles block-major inside a section, sections one after another. Per
pair, the grid's last pairs started their longest tiles when little else was left to run
beside them: at (1, 4, 8192) with 128-row tiles (256 tiles of 1 to 64 key blocks on 132 SMs)
the makespan was ~1.5x the longest tile (perf/NOTES.md, thirtieth session). A section is as
many pairs as have the rows their tiles share (the forward's: K and V) within
L2_SECTION_BYTES (at least one), so the tiles in flight still share a few heads' rows in L2;
the sections' sizes are balanced (kernels/sections.py).
The backward keeps its per-pair order (the same sections there measured no faster, and
slower at 32 MiB: perf/NOTES.md, thirty-first session), but for grouped causal grids, whose
CTAs walk a whole group's query heads: sections of a fixed number of pairs
(config.section_pairs, on grid_divisors).

One CTA per tile (grid.x = number of tiles, limit 2^31 - 1, so any B * N fits).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.rules import L2_SECTION_BYTES  # a module global here: experiments patch it
from cute_flash.kernels.sections import section_sizes
from cute_flash.kernels.sequences import SequenceLayout


class TileDivisors(NamedTuple):
    """A dense grid's divisors of its tile numbers, made on the host once per launch
    (grid_divisors: the forward's TileScheduler.divisors, the grouped causal backward's
    __call__) as fast divisors (a multiply-high and a shift each): computed per CTA they were
    software divisions of ~20 dependent instructions each, seven of them on a causal grid
    before the producer could issue Q's load (perf/NOTES.md, fifty-first session). The
    section fields are None where the grid has no sections."""
    blocks: object  # tiles per (head, batch): the forward's query blocks, the backward's key blocks
    num_blocks: object  # the same as an Int32 (m_block reversed for causal grids)
    heads: object  # heads per (cluster of heads, batch)
    # Sections (grid_divisors, sections_fast): the smaller sections hold small_pairs pairs
    # each, the larger (the first ones) one more; the tiles and pairs of the larger ones.
    small_pairs: object  # Int32
    large_tiles: object  # Int32
    large_pairs: object  # Int32
    large: object  # pairs of a larger section (small_pairs + 1)
    large_span: object  # its tiles: large x blocks
    small: object  # pairs of a smaller section
    small_span: object  # its tiles


class TileScheduler:
    def __init__(self, block_m: int, problem: AttentionProblem, pair_row_bytes: int = 0, cluster_heads: int = 1):
        """pair_row_bytes: bytes per row of what the tiles of one (head, batch) pair share (the
        forward: K and V per key); given, a causal dense grid is ordered in sections of pairs
        (see the module's docstring). cluster_heads > 1 (a dense grid): consecutive tile
        numbers, a cluster's CTAs, take the same query block of that many consecutive heads
        (the rest of the numbering as for num_heads / cluster_heads heads)."""
        self.block_m = block_m
        self.cluster_heads = cluster_heads
        # Longest first: with a causal mask the last query blocks see the most keys.
        self.reverse_m_blocks = problem.causal
        # Rows whose shared bytes fit in the L2 budget: a section holds that many rows' worth of pairs.
        self.section_rows = (L2_SECTION_BYTES // pair_row_bytes
                             if pair_row_bytes and problem.causal and not problem.packed else 0)
        self.packed = problem.packed
        self.sequences = SequenceLayout(problem)

    def grid(self, query_rows, num_heads, batch):
        """query_rows: the rows of a (head, batch) (HeadMapping.query_rows), or a packed batch's
        (total_q positions x G with row_heads; batch: its number of sequences)."""
        if const_expr(self.packed):
            heads = self.sequences.heads
            positions = query_rows // heads.row_count(1)
            return (self.sequences.block_numbers(positions, heads.positions_per_tile(self.block_m), batch) * num_heads,
                    1, 1)
        return (cute.ceil_div(query_rows, self.block_m) * num_heads * batch, 1, 1)

    @cute.jit
    def packed_tile(self, tile: Int32, mQ: cute.Tensor, mK: cute.Tensor, gmem):
        """(m_block, head, Sequence) of a packed grid's tile number (mQ, mK: the kernel's (S, D, N,
        B) views; gmem: its tensors, SequenceLayout.locate). The m_block may lie outside its
        sequence (SequenceLayout.has_rows)."""
        # A tile's query positions: block_m, or block_m / G of a group's rows with row_heads.
        positions = self.sequences.heads.positions_per_tile(self.block_m)
        numbers = self.sequences.block_numbers(self.sequences.heads.positions(mQ), positions,
                                               gmem.cu_seqlens_q.shape[0] - 1)
        seq, m_block, rows = self.sequences.locate(tile % numbers, positions, False, mQ, mK, gmem)
        if const_expr(self.reverse_m_blocks):
            m_block = (rows + positions - 1) // positions - 1 - m_block
        return m_block, tile // numbers, seq

    def divisors(self, seqlen_q, num_heads, batch, seqlen_k, fast=cute.fast_divmod_create_divisor_v2):
        """The TileDivisors of a dense grid (host side, in the kernel's __call__; seqlen_q, as
        for grid; seqlen_k: the keys per (head, batch), for the sections). fast: what makes a
        divisor (the identity runs the arithmetic on Python ints)."""
        blocks = (seqlen_q + self.block_m - 1) // self.block_m
        section_pairs = self.section_rows // cutlass.max(seqlen_k, 1) if const_expr(self.section_rows) else None
        return grid_divisors(blocks, num_heads // self.cluster_heads, batch, section_pairs, fast)

    @cute.jit
    def tile_coords(self, tile: Int32, divisors: TileDivisors):
        """(m_block, head, batch) of a dense grid's tile number, from the host's divisors
        (TileScheduler.divisors): per-pair order, or sections (sections_fast) on causal grids
        with a pair_row_bytes; m_block reversed under causal."""
        rank = 0
        if const_expr(self.cluster_heads > 1):
            rank = tile % self.cluster_heads
            tile = tile // self.cluster_heads
        if const_expr(self.section_rows):
            m_block, head_batch = sections_fast(tile, divisors)
        else:
            head_batch, m_block = divmod(tile, divisors.blocks)
        if cutlass.const_expr(self.reverse_m_blocks):
            m_block = divisors.num_blocks - 1 - m_block
        batch, head = divmod(head_batch, divisors.heads)
        return m_block, head * self.cluster_heads + rank, batch

    @cute.jit
    def tile_coords_divided(self, tile: Int32, seqlen_q: Int32, num_heads: Int32):
        """tile_coords by integer division in the kernel, for grids in per-pair order (no
        sections, no clusters): the dQ kernel's. Its producer runs on 24 registers, and beside
        the host's divisors ptxas spilled one of them around the register handover (float32x3h
        D = 64: 1 STL / 2 LDL, tests/test_sass_bwd.py; perf/NOTES.md, fifty-second session)."""
        num_m_blocks = (seqlen_q + self.block_m - 1) // self.block_m
        m_block = tile % num_m_blocks
        head_batch = tile // num_m_blocks
        if cutlass.const_expr(self.reverse_m_blocks):
            m_block = num_m_blocks - 1 - m_block
        return m_block, head_batch % num_heads, head_batch // num_heads


def grid_divisors(blocks, heads, batch, section_pairs, fast=cute.fast_divmod_create_divisor_v2):
    """TileDivisors (host side) of a grid of `blocks` tiles per (head, batch) pair, numbered
    block-fastest per pair, or (section_pairs: at most that many pairs a section, None: no
    sections) block-major inside sections of pairs (kernels/sections.py), read by
    sections_fast. The forward's (TileScheduler.divisors) and the grouped causal backward's
    (key blocks of its 3-D grid's launch order)."""
    # (At least 1 each: a divisor of 0 cannot be made, and the forward's host runs this for
    # every launch, an empty grid's too.)
    blocks, heads = cutlass.max(blocks, 1), cutlass.max(heads, 1)
    sections = (None,) * 7
    if const_expr(section_pairs is not None):
        small, larger, _ = section_sizes(heads * batch, section_pairs, cutlass.min, cutlass.max)
        large_pairs = larger * (small + 1)
        sections = (small, large_pairs * blocks, large_pairs, fast(small + 1),
                    fast((small + 1) * blocks), fast(small), fast(small * blocks))
    return TileDivisors(fast(blocks), blocks, fast(heads), *sections)


@cute.jit
def sections_fast(tile: Int32, divisors: TileDivisors):
    """(block, pair) of tile number `tile` in a grid of sections (grid_divisors), on the
    host's divisors. Both kinds of section are divided and the one the tile lies in is
    selected, without a branch: a branch, or software divisions for each kind (before the
    host made the divisors), spilled the every-variant D = 64 forward at 160 registers and
    lengthened the causal loops by 2 instructions (tests/test_sass.py)."""
    in_large = cutlass.min(cutlass.max(divisors.large_tiles - tile, 0), 1)
    first_large, within_large = divmod(tile, divisors.large_span)
    block_large, pair_large = divmod(within_large, divisors.large)
    first_small, within_small = divmod(cutlass.max(tile - divisors.large_tiles, 0), divisors.small_span)
    block_small, pair_small = divmod(within_small, divisors.small)
    block = block_small + in_large * (block_large - block_small)
    pair_in_large = first_large * (divisors.small_pairs + 1) + pair_large
    pair_in_small = divisors.large_pairs + first_small * divisors.small_pairs + pair_small
    return block, pair_in_small + in_large * (pair_in_large - pair_in_small)
