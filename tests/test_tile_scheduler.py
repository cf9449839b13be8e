"""kernels/tile_scheduler.py's tile order, its integer arithmetic run on the CPU (the jit
function's Python body on Python ints), and grid_makespan's mirror of it."""

import pytest

from cute_flash import grid_makespan
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.tile_scheduler import L2_SECTION_BYTES, grid_divisors, sections_fast


def coords(tile, blocks, pairs, section_pairs):
    """(block, pair) of a tile in sections of at most section_pairs pairs: the host's divisors
    (grid_divisors, with plain ints as divisors) read by sections_fast's body (the one the DSL
    traces; on ints it computes the same), as the forward and the grouped backward number
    their grids."""
    divisors = grid_divisors(blocks, pairs, 1, section_pairs, fast=lambda d: d)
    return sections_fast.__wrapped__(tile, divisors)


def balanced_order(blocks, pairs, section_pairs):
    """Sections of at most section_pairs pairs, as few as cover the pairs, sizes within one
    (the larger first); block-major inside each."""
    sections = -(-pairs // max(min(section_pairs, pairs), 1))
    order, first = [], 0
    for section in range(sections):
        size = pairs // sections + (section < pairs % sections)
        order += [(block, first + i) for block in range(blocks) for i in range(size)]
        first += size
    return order


@pytest.mark.parametrize("blocks", [1, 2, 5])
@pytest.mark.parametrize("pairs", [1, 2, 7, 10, 16, 17])
@pytest.mark.parametrize("section_pairs", [1, 3, 4, 5, 8, 16, 40])
def test_sections_are_balanced_and_block_major(blocks, pairs, section_pairs):
    got = [tuple(coords(tile, blocks, pairs, section_pairs)) for tile in range(blocks * pairs)]
    assert got == balanced_order(blocks, pairs, section_pairs)


def test_a_short_last_section_is_spread_over_the_others():
    """16 pairs of at most 5: four sections of 4, not 5 + 5 + 5 + 1 (the last pair's longest
    tile would start when little is left to run beside it)."""
    pairs = [coords(tile, 1, 16, 5)[1] for tile in range(16)]
    assert pairs == list(range(16))
    starts = [tile for tile in range(16 * 3) if coords(tile, 3, 16, 5)[0] == 0 and
              (tile == 0 or coords(tile - 1, 3, 16, 5)[0] != 0)]
    assert starts == [0, 12, 24, 36]


def test_grid_makespan_walks_the_kernels_order():
    """The model's causal order (tile_key_blocks) is the kernel's: block m_block of pair p
    walks the key blocks of query block blocks - 1 - m_block (longest first)."""
    causal = AttentionProblem.of(causal=True)
    rows, keys, pairs, row_bytes = 640, 10240, 7, 2**10  # 10 MiB per pair: at most 3 per section
    section = L2_SECTION_BYTES // row_bytes // keys
    blocks = rows // 128
    per_block = [min(keys, (m + 1) * 128) // 128 for m in range(blocks)]
    expected = [per_block[blocks - 1 - coords(tile, blocks, pairs, section)[0]] for tile in range(blocks * pairs)]
    assert grid_makespan.tile_key_blocks(causal, 128, 128, pairs, rows, keys, row_bytes) == expected


@pytest.mark.parametrize("blocks", [1, 2, 5, 7])
@pytest.mark.parametrize("pairs", [1, 2, 7, 10, 16, 17, 33])
@pytest.mark.parametrize("section_pairs", [1, 3, 4, 5, 8, 16, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_host_divisors_give_the_kernels_coordinates(monkeypatch, blocks, pairs, section_pairs, causal):
    """TileScheduler.divisors (the host's, here with plain ints as divisors) and tile_coords
    give every tile its (m_block, head, batch): per pair, or in sections block-major and
    balanced (balanced_order), m_block reversed under causal."""
    from cute_flash.kernels import tile_scheduler
    from cute_flash.kernels.tile_scheduler import TileScheduler, sections_fast

    monkeypatch.setattr(tile_scheduler, "sections_fast", sections_fast.__wrapped__)
    heads = 1 if pairs == 1 else next(h for h in (3, 2, 1) if pairs % h == 0)
    scheduler = TileScheduler(128, AttentionProblem.of(causal), pair_row_bytes=1)
    if causal:
        scheduler.section_rows = section_pairs  # with 1 key per pair: section_pairs pairs a section
    divisors = scheduler.divisors(blocks * 128 - 5, heads, pairs // heads, 1, fast=lambda d: d)
    # The reference order written out (not sections_fast itself, which tile_coords calls).
    order = balanced_order(blocks, pairs, section_pairs)
    for tile in range(blocks * pairs):
        block, pair = order[tile] if causal else (tile % blocks, tile // blocks)
        want = (blocks - 1 - block if causal else block, pair % heads, pair // heads)
        assert tuple(scheduler.tile_coords.__wrapped__(scheduler, tile, divisors)) == want


@pytest.mark.parametrize("blocks", [1, 2, 5])
@pytest.mark.parametrize("heads, batch", [(1, 1), (3, 1), (2, 5), (7, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_dq_kernels_divisions_give_the_per_pair_order(blocks, heads, batch, causal):
    """tile_coords_divided (the dQ kernel's, dividing in the kernel) numbers a grid as
    tile_coords does without sections: m_block fastest, reversed under causal, then head, then
    batch."""
    from cute_flash.kernels.tile_scheduler import TileScheduler

    scheduler = TileScheduler(128, AttentionProblem.of(causal))
    divisors = scheduler.divisors(blocks * 128 - 5, heads, batch, 1, fast=lambda d: d)
    for tile in range(blocks * heads * batch):
        got = tuple(scheduler.tile_coords_divided.__wrapped__(scheduler, tile, blocks * 128 - 5, heads))
        assert got == tuple(scheduler.tile_coords.__wrapped__(scheduler, tile, divisors))
        block = tile % blocks
        assert got == (blocks - 1 - block if causal else block, tile // blocks % heads, tile // blocks // heads)
