"""Appending new keys (or values) to a KV cache in place, before attention reads it.

The cache is pages of page_size slots, (num_pages, page_size, Nkv, D), and a page table
(B, max_pages) lists each sequence's pages in order: row i of sequence b's new rows goes to
its slot j = cache_seqlens[b] + i, in page page_table[b, j // page_size] at row
j % page_size. A contiguous cache (B_cache, S_max, Nkv, D) is the same with pages of S_max
slots and the table cache_batch_idx as one column. The slots come from device tensors the
host has not read (no sync), so the kernel checks each one against the table's and the
caches' shape and writes nothing where it falls outside: values that break the caller's
contract (cute_flash.kvcache) lose their own rows, never another slot's data, and never touch
memory outside the cache.

One CTA per (new row, sequence) writes that row of both k and v for every head (v may have
a head dim of its own). Its threads copy the row's (head, column) elements with coalesced
scalar accesses, ELEMENTS independent loads per thread in flight before their stores: a
prefill appends thousands of rows (2048 x 4 sequences x 8 heads at D = 128 as one CTA per
(row, head) spent ~0.2 ms, perf/NOTES.md, thirty-third session), a decode step one per
sequence, whose cost is the launch (one for both caches). Tensors in flash-attn's layout, as
the caller holds them: the new rows (B, S_new, Nkv, D), the caches (num_pages, page_size,
Nkv, D), any strides with a unit last one (no alignment assumed).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

THREADS = 128
ELEMENTS = 8  # loads per thread in flight: 8 x 128 elements, a whole row of 8 heads at D = 128


class CacheAppend:
    def __init__(self, dtype, head_dim: int, value_head_dim: int | None = None):
        self.dtype = dtype
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim or head_dim

    @cute.jit
    def __call__(
        self,
        mNewK: cute.Tensor,  # (B, S_new, Nkv, D)
        mNewV: cute.Tensor,  # (B, S_new, Nkv, Dv)
        mCacheK: cute.Tensor,  # (num_pages, page_size, Nkv, D), written in place
        mCacheV: cute.Tensor,  # (num_pages, page_size, Nkv, Dv), written in place
        mSeqlens: cute.Tensor,  # (B,) int32: each sequence's first new slot
        mPages: cute.Tensor,  # (B, max_pages) int32: each sequence's pages
        stream: cuda.CUstream,
    ):
        grid = (mNewK.shape[1], mNewK.shape[0], 1)
        self.kernel(mNewK, mNewV, mCacheK, mCacheV, mSeqlens, mPages).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mNewK: cute.Tensor, mNewV: cute.Tensor, mCacheK: cute.Tensor, mCacheV: cute.Tensor,
               mSeqlens: cute.Tensor, mPages: cute.Tensor):
        row, batch, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        page_size = mCacheK.shape[1]
        slot = mSeqlens[batch] + row
        # slot // page_size < max_pages, without the product (it may not fit 32 bits).
        if slot >= 0 and slot // page_size < mPages.shape[1]:
            page = mPages[batch, slot // page_size]
            if page >= 0 and page < mCacheK.shape[0]:
                self.copy_row(mNewK[batch, row, None, None], mCacheK[page, slot % page_size, None, None],
                              self.head_dim, tid)
                self.copy_row(mNewV[batch, row, None, None], mCacheV[page, slot % page_size, None, None],
                              self.value_head_dim, tid)

    @cute.jit
    def copy_row(self, src: cute.Tensor, dst: cute.Tensor, columns: cutlass.Constexpr[int], tid):
        """dst = src, two (heads, columns) rows: element e = head * columns + column, ELEMENTS
        loads per thread issued before their stores."""
        total = src.shape[0] * columns
        values = cute.make_rmem_tensor(ELEMENTS, self.dtype)
        for chunk in cutlass.range(0, total, THREADS * ELEMENTS, unroll=1):
            for i in cutlass.range_constexpr(ELEMENTS):
                e = chunk + i * THREADS + tid
                if e < total:
                    values[i] = src[e // columns, e % columns]
            for i in cutlass.range_constexpr(ELEMENTS):
                e = chunk + i * THREADS + tid
                if e < total:
                    dst[e // columns, e % columns] = values[i]
