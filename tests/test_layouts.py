"""kernels/layouts.py's row copies (CPU): the passes of a row-by-row copy tile the block's rows.

A pass that reaches past a block addresses rows beyond it, and three kernels stored into their
neighbours' rows that way (perf/NOTES.md: 112-key blocks by 32-row passes, a (2, 96) grouped
tile and a 192-row D = 16 tile by 128-row passes). row_copy_threads picks thread counts whose
passes divide the rows, and row_tiled_copy refuses any other when the kernel is traced."""

import pytest

from cute_flash.kernels.layouts import row_copy_threads, row_tiled_copy


@pytest.mark.parametrize("num_threads", [128, 256, 384])
@pytest.mark.parametrize("cols,values", [(8, 4), (16, 8), (16, 4), (32, 8), (64, 8), (96, 8), (192, 8), (256, 8),
                                         (128, 4), (256, 4)])
@pytest.mark.parametrize("tile_rows", [16, 64, 80, 96, 112, 128, 192])
def test_row_copy_threads_take_whole_rows_whose_passes_tile_the_block(num_threads, cols, values, tile_rows):
    threads = row_copy_threads(num_threads, cols, values, tile_rows)
    per_row = cols // values
    pass_rows = threads // per_row
    assert threads % per_row == 0 and threads <= num_threads
    assert tile_rows % pass_rows == 0
    # The largest such count: twice the rows would overflow the threads or stop dividing.
    assert 2 * threads > num_threads or tile_rows % (2 * pass_rows) != 0


def test_the_d16_store_of_a_192_row_tile_takes_64_row_passes():
    # 384 consumer threads, two a row: 128-row passes did not divide 192 (the sixty-fifth
    # session's bug); 64-row passes do.
    assert row_copy_threads(384, 16, 8, 192) == 128


@pytest.mark.parametrize("num_threads,cols,values,tile_rows", [
    (256, 16, 8, 192),  # 128-row passes over 192 rows
    (256, 64, 8, 112),  # 32-row passes over a 112-key block
    (100, 64, 8, 16),   # 100 threads: not whole rows of 8
])
def test_row_tiled_copy_refuses_passes_that_do_not_tile_the_block(num_threads, cols, values, tile_rows):
    from cutlass import BFloat16

    with pytest.raises(AssertionError, match="do not tile"):
        row_tiled_copy(BFloat16, num_threads, cols, values, tile_rows)


def test_row_copy_builds_its_copy_for_the_threads_it_picks(monkeypatch):
    # row_copy hands row_tiled_copy the count row_copy_threads picked, not every thread: the
    # D = 16 store of a 192-row tile by 384 threads runs on 128 of them.
    from cute_flash.kernels import layouts

    built = []
    monkeypatch.setattr(layouts, "row_tiled_copy", lambda *args: built.append(args) or "copy")
    assert layouts.row_copy("dtype", 384, 16, 8, 192) == (128, "copy")
    assert built == [("dtype", 128, 16, 8, 192)]
