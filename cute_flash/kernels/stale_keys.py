"""Key rows past a sequence's end, zeroed in shared memory before a GEMM reads them.

A packed batch's (or a KV cache's) key block that runs past its sequence's keys loads rows
that are not the sequence's: the next sequence's, or a cache's slots not in use (stale, never
written: NaN is possible). Their scores are masked (selected to -inf, NaN or not), but the
GEMMs that multiply a masked entry by such a row, P V and dP = dO V^T by V's, dQ = dS K by
K's, compute 0 x NaN = NaN on the tensor cores. So the kernels zero those rows first, in the
one block per sequence that reaches them (the forward and the dQ kernel walk it first; the
dK / dV kernel owns it). TMA's own zero fill covers only rows past the tensor: dense batches
need none of this.
"""

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.layouts import zero_rows_from


@cute.jit
def zero_rows_past_keys(dtype: cutlass.Constexpr, tiles, keys_in_block, tidx, num_threads: cutlass.Constexpr[int],
                        barrier_id: cutlass.Constexpr[int]):
    """Zero rows keys_in_block.. of each (block_n, cols) shared-memory tile of `tiles` (16-bit
    or float32 elements, 16 bytes per store) by num_threads consumer threads (tidx among
    them); then a proxy fence (WGMMA reads shared memory through the async proxy) and named
    barrier `barrier_id` over those threads, so that no GEMM of any of them starts before
    every zero is in place. The caller has waited for the tiles' loads and calls this where
    the block runs past its keys (keys_in_block < block_n), from every one of the threads
    (the condition is uniform: one block of one sequence)."""
    for tile in tiles:
        zero_rows_from(dtype, tile, keys_in_block, tidx, num_threads, 128 // dtype.width)
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
