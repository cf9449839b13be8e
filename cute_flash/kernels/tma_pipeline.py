"""The TMA-fed shared-memory rings the Hopper kernels share: one producer thread issues bulk
tensor loads into num_stages buffers, each guarded by an mbarrier pair (full: the bytes have
landed; empty: every consumer warp has released the stage)."""

import cutlass.cute as cute
from cutlass import pipeline


def tma_pipeline(barriers, num_stages: int, tx_count: int, num_consumer_threads: int):
    """A PipelineTmaAsync over `barriers` (a MemRange of 2 * num_stages Int64): the producer
    is one thread; one arrive per consumer warp (lane 0) releases a stage. Barrier
    initialisation is deferred: the kernel fences and syncs once after creating all rings."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads // cute.arch.WARP_SIZE),
        tx_count=tx_count,
        defer_sync=True,
    )


@cute.jit
def load_stage(pipe, tma_atom, gmem_tiles, smem_stages, n_block, state):
    """Wait for a free stage, arm its barrier with the byte count, issue the TMA load of
    gmem_tiles[..., n_block] into it; returns the advanced state."""
    pipe.producer_acquire(state)
    cute.copy(tma_atom, gmem_tiles[None, n_block], smem_stages[None, state.index],
              tma_bar_ptr=pipe.producer_get_barrier(state))
    state.advance()
    return state
