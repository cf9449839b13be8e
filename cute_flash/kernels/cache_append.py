"""Appending new keys (or values) to a KV cache in place, before attention reads it.

Row i of sequence b's new rows goes to cache slot (cache_batch_idx[b], cache_seqlens[b] + i).
The slots come from device tensors the host has not read (no sync), so the kernel checks
each one against the cache's shape and writes nothing where it falls outside: values that
break the caller's contract (cute_flash.kvcache) lose their own rows, never another slot's
data, and never touch memory outside the cache.

One CTA per (new row, head, sequence); its threads copy the row's head_dim elements with
coalesced scalar accesses (an append is a few rows per sequence: its cost is the launch).
Tensors are (B, N, S, D) views as the attention kernels take them: the new rows
(B, Nkv, S_new, D), the cache (B_cache, Nkv, S_max, D).
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

THREADS = 128


class CacheAppend:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mNew: cute.Tensor,  # (B, Nkv, S_new, D)
        mCache: cute.Tensor,  # (B_cache, Nkv, S_max, D), written in place
        mSeqlens: cute.Tensor,  # (B,) int32: each sequence's first new slot
        mBatchIdx: cute.Tensor,  # (B,) int32: each sequence's cache entry
        stream: cuda.CUstream,
    ):
        grid = (mNew.shape[2], mNew.shape[1], mNew.shape[0])
        self.kernel(mNew, mCache, mSeqlens, mBatchIdx).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mNew: cute.Tensor, mCache: cute.Tensor, mSeqlens: cute.Tensor, mBatchIdx: cute.Tensor):
        row, head, batch = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        entry = mBatchIdx[batch]
        slot = mSeqlens[batch] + row
        if entry >= 0 and entry < mCache.shape[0] and slot >= 0 and slot < mCache.shape[2]:
            for d in cutlass.range(tid, self.head_dim, THREADS, unroll=1):
                mCache[entry, head, slot, d] = mNew[batch, head, row, d]
