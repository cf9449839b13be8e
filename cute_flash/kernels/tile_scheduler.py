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
L2_SECTION_BYTES (at least one), so the tiles in flight still share a few heads' rows in L2.
The backward keeps its per-pair order: the same sections there measured no faster, and
slower at 32 MiB (perf/NOTES.md, thirty-first session).

One CTA per tile (grid.x = number of tiles, limit 2^31 - 1, so any B * N fits).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.sequences import SequenceLayout


# K and V bytes a section of a causal grid may span: most of the H100's / H200's 50 MB L2.
L2_SECTION_BYTES = 32 * 2**20


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

    def grid(self, seqlen_q, num_heads, batch):
        """seqlen_q: Sq, or a packed batch's total_q (batch: its number of sequences)."""
        if const_expr(self.packed):
            return (self.sequences.block_numbers(seqlen_q, self.block_m, batch) * num_heads, 1, 1)
        return (cute.ceil_div(seqlen_q, self.block_m) * num_heads * batch, 1, 1)

    @cute.jit
    def packed_tile(self, tile: Int32, mQ: cute.Tensor, mK: cute.Tensor, gmem):
        """(m_block, head, Sequence) of a packed grid's tile number (mQ, mK: the kernel's (S, D, N,
        B) views; gmem: its tensors, SequenceLayout.locate). The m_block may lie outside its
        sequence (SequenceLayout.has_rows)."""
        numbers = self.sequences.block_numbers(mQ.shape[0], self.block_m, gmem.cu_seqlens_q.shape[0] - 1)
        seq, m_block, rows = self.sequences.locate(tile % numbers, self.block_m, False, mQ, mK, gmem)
        if const_expr(self.reverse_m_blocks):
            m_block = (rows + self.block_m - 1) // self.block_m - 1 - m_block
        return m_block, tile // numbers, seq

    @cute.jit
    def tile_coords(self, tile: Int32, seqlen_q: Int32, num_heads: Int32, seqlen_k: Int32 = 1, num_tiles=None):
        """(m_block, head, batch) of a dense grid's tile number (seqlen_q, as for grid;
        seqlen_k: the keys per (head, batch), for the sections; num_tiles: grid()'s count
        where the launched grid is smaller, a persistent one)."""
        rank = 0
        if const_expr(self.cluster_heads > 1):
            rank = tile % self.cluster_heads
            tile = tile // self.cluster_heads
            num_heads = num_heads // self.cluster_heads
        num_m_blocks = (seqlen_q + self.block_m - 1) // self.block_m
        m_block = tile % num_m_blocks
        head_batch = tile // num_m_blocks
        if const_expr(self.section_rows):
            tiles = cute.arch.grid_dim()[0] if const_expr(num_tiles is None) else num_tiles
            pairs = tiles // self.cluster_heads // num_m_blocks
            m_block, head_batch = self.section_coords(tile, num_m_blocks, pairs, seqlen_k)
        if cutlass.const_expr(self.reverse_m_blocks):
            m_block = num_m_blocks - 1 - m_block
        return m_block, head_batch % num_heads * self.cluster_heads + rank, head_batch // num_heads

    @cute.jit
    def section_coords(self, tile: Int32, blocks: Int32, pairs: Int32, rows: Int32):
        """(block, pair) of tile number `tile` (section_coords) with section_rows / rows pairs
        per section (rows: the shared rows of one pair)."""
        return section_coords(tile, blocks, pairs, cutlass.max(self.section_rows // cutlass.max(rows, 1), 1))


@cute.jit
def section_coords(tile: Int32, blocks: Int32, pairs: Int32, section_pairs: Int32):
    """(block, pair) of tile number `tile` in a grid of `pairs` (head, batch) pairs of `blocks`
    tiles each, numbered block-major inside sections of `section_pairs` pairs (the longest
    block of every pair of a section before any pair's second), sections one after another."""
    section_pairs = cutlass.max(cutlass.min(section_pairs, pairs), 1)
    section_tiles = blocks * section_pairs
    section = tile // section_tiles
    within = tile - section * section_tiles
    pairs_here = cutlass.min(pairs - section * section_pairs, section_pairs)  # the last may have fewer
    block = within // pairs_here
    return block, section * section_pairs + within - block * pairs_here


class TileQueue:
    """The tiles of a persistent grid (TileConfig.persistent): each CTA starts with the tile of
    its block index and takes every later one from a global counter (zero at launch), so tiles
    go out in the scheduler's longest-first order to whichever CTA finishes first. A static
    stride loses that balance on causal grids (up to 1.24x the work-bound makespan in a
    simulation of the sectioned order, perf/NOTES.md, forty-third session).

    The producer warp takes the next number as soon as it has issued the current tile's last
    loads, and hands it to the consumer warps through a ring of STAGES shared-memory slots,
    each guarded by an mbarrier pair (full: one producer arrival after the slot is written;
    empty: every consumer thread has read it). The consumers read it after their epilogue.
    A number at or past the tile count ends both loops."""

    STAGES = 2

    def __init__(self, slots, barriers, counter, num_consumer_threads: int):
        """slots: STAGES Int32 in shared memory; barriers: pointer to 2 * STAGES Int64 (full
        then empty); counter: the global int32 tensor whose element 0 counts the tiles taken."""
        self.slots = slots
        self.full = barriers
        self.empty = barriers + self.STAGES
        self.counter = counter
        self.num_consumer_threads = num_consumer_threads

    # A DSL value (the kernel's tile loops carry it): the slots, the barriers, the counter.
    def __extract_mlir_values__(self):
        return [*cutlass.extract_mlir_values(self.slots), *cutlass.extract_mlir_values(self.full),
                *cutlass.extract_mlir_values(self.counter)]

    def __new_from_mlir_values__(self, values):
        parts, rest = [], list(values)
        for part in (self.slots, self.full, self.counter):
            n = len(cutlass.extract_mlir_values(part))
            parts.append(cutlass.new_from_mlir_values(part, rest[:n]))
            rest = rest[n:]
        return TileQueue(*parts, self.num_consumer_threads)

    @cute.jit
    def init_barriers(self):
        """Thread 0, before the kernel's barrier-initialisation fence and sync (start_rings)."""
        if cute.arch.thread_idx()[0] == 0:
            for stage in cutlass.range_constexpr(self.STAGES):
                cute.arch.mbarrier_init(self.full + stage, 1)
                cute.arch.mbarrier_init(self.empty + stage, self.num_consumer_threads)

    @cute.jit
    def fetch(self):
        """The producer warp's next tile number (the same in every lane)."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(self.counter.iterator, Int32(1))
        taken = cute.arch.shuffle_sync(taken, 0)
        return taken + cute.arch.grid_dim()[0]

    @cute.jit
    def publish(self, state, tile):
        """Producer warp: the slot of `state` (a producer PipelineState) takes `tile`."""
        cute.arch.mbarrier_wait(self.empty + state.index, state.phase)
        if cute.arch.lane_idx() == 0:
            self.slots[state.index] = tile
            cute.arch.mbarrier_arrive(self.full + state.index)

    @cute.jit
    def take(self, state):
        """Consumer threads: the tile number in the slot of `state` (a consumer PipelineState)."""
        cute.arch.mbarrier_wait(self.full + state.index, state.phase)
        tile = self.slots[state.index]
        cute.arch.mbarrier_arrive(self.empty + state.index)
        return tile
