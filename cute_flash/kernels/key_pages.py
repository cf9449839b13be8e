"""Where a key block's rows lie: the one reader of problem.page_size (a paged KV cache).

A paged cache keeps keys and values in pages of page_size rows, (num_pages, page_size, Nkv, D),
and each sequence owns a list of pages: row b of the page table (B, max_pages) int32 holds
them in order, so its logical key j lies in page table[b, j // page_size], row
j % page_size. The host passes the pages as one packed key tensor (num_pages * page_size, Nkv,
D); a paged sequence's keys start at logical key 0 and number seqused_k[b]
(SequenceLayout.of).

The K and V rings keep their (block_n, D) stages; only how a stage is filled changes. TMA
boxes of box_rows = gcd(page_size, block_n) rows: every box lies inside one page (box_rows
divides page_size and a block starts on a multiple of it), block_n / box_rows boxes fill a
stage, and they all complete on the stage's one barrier (the stage's byte count does not
change). box_rows must be a multiple of 8, the swizzle atom's rows, so that a box is whole
atoms of the stage's swizzled layout (rules.paged_keys).

What a paged load must not do: read the page table outside its (B, max_pages) bounds. Block
rows past a sequence's keys (the key-tail block, masked by its length) look up the last
column of its row instead of columns past it; page numbers are clamped into the cache, so
table entries that break the contract give wrong rows, never an access outside the pages.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


def box_rows(page_size: int, block_n: int) -> int:
    """Rows per TMA box of a key block: block_n in a row-addressed cache, else gcd(page,
    block_n)."""
    return math.gcd(page_size, block_n) if page_size else block_n


class KeyPages:
    def __init__(self, problem: AttentionProblem, block_n: int, head_dim: int):
        self.page_size = problem.page_size
        self.paged = problem.page_size > 0
        self.block_n = block_n
        self.head_dim = head_dim
        self.box_rows = box_rows(problem.page_size, block_n)
        self.boxes_per_block = block_n // self.box_rows

    def box_layout(self, stages_layout):
        """The shared-memory layout one TMA box fills: a stage of the ring (stages_layout:
        (block_n, D, stages)), or its first box_rows rows (same swizzle, same strides)."""
        if const_expr(not self.paged):
            return cute.select(stages_layout, mode=[0, 1])
        return cute.select(cute.flat_divide(stages_layout, (self.box_rows, self.head_dim)), mode=[0, 1])

    def table_row(self, page_table, index):
        """Sequence `index`'s row of the page table (None when not paged)."""
        if const_expr(self.paged):
            return page_table[index, None]
        return None

    def gmem_tiles(self, rows: cute.Tensor) -> cute.Tensor:
        """rows (S, D), a head's keys from the sequence's first one (paged: the whole cache)
        -> (box_rows, D, boxes along S)."""
        return cute.local_tile(rows, (self.box_rows, self.head_dim), (None, 0))

    def smem_boxes(self, stages: cute.Tensor) -> cute.Tensor:
        """A ring (block_n, D, stages) -> (box_rows, D, boxes per block, 1, stages)."""
        return cute.flat_divide(stages, (self.box_rows, self.head_dim))

    @cute.jit
    def load_stage(self, pipe, tma_atom, gmem_boxes, smem_boxes, n_block, state, table_row, num_boxes, **mcast):
        """load_stage (tma_pipeline) for key block n_block of a sequence, by the producer's
        whole warp: its boxes from the pages table_row (the sequence's row of the page table,
        paged only) lists; num_boxes: the boxes in the cache (the clamp on page numbers).
        Returns the advanced state."""
        if const_expr(self.paged):
            # Lane i looks up box i's page (one load for the warp, issued before the wait
            # for a free stage so that its latency hides behind it), then lanes broadcast.
            boxes_per_page = self.page_size // self.box_rows
            box = n_block * self.boxes_per_block + cutlass.min(cute.arch.lane_idx(), self.boxes_per_block - 1)
            column = cutlass.min(box // boxes_per_page, table_row.shape[0] - 1)
            lane_box = table_row[column] * boxes_per_page + box % boxes_per_page
            lane_box = cutlass.min(cutlass.max(lane_box, Int32(0)), num_boxes - 1)
        pipe.producer_acquire(state)
        for i in cutlass.range_constexpr(self.boxes_per_block):
            box = n_block * self.boxes_per_block + i
            if const_expr(self.paged):
                box = cute.arch.shuffle_sync(lane_box, i)
            cute.copy(tma_atom, gmem_boxes[None, box], smem_boxes[None, i, 0, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state), **mcast)
        state.advance()
        return state
