"""The TMA-fed shared-memory rings the Hopper kernels share: one producer thread issues bulk
tensor loads into num_stages buffers, each guarded by an mbarrier pair (full: the bytes have
landed; empty: every consumer warp has released the stage)."""

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync

# The 128-byte swizzle pattern repeats every 1024 bytes, and TMA and WGMMA assume a swizzled
# tile starts on a pattern boundary.
SWIZZLED_TILE_ALIGN = 1024


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


def shared_storage(rings: dict, buffers: dict):
    """The kernel's shared-memory struct: first the mbarrier pairs of each ring (rings: name ->
    (num_stages, bytes per stage), as start_rings takes them) as <name>_barriers, then the
    buffers (name -> (dtype, elements, alignment in bytes)) in the order given."""
    fields = {f"{name}_barriers": cute.struct.MemRange[cutlass.Int64, 2 * stages] for name, (stages, _) in rings.items()}
    for name, (dtype, elements, align) in buffers.items():
        fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, elements], align]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def swizzled_tensor(buffer, layout):
    """The tensor of a shared-memory struct field laid out by a swizzled (composed) layout."""
    return buffer.get_tensor(layout.outer, swizzle=layout.inner)


def start_rings(storage, pipes_type, rings: dict, num_consumer_threads: int):
    """The kernel's rings, one per field of the NamedTuple pipes_type that `rings` names (the
    others keep their defaults: rings of a kernel variant), each on the barriers
    storage.<field>_barriers with rings[field] = (num_stages, tx_count) and the same consumers;
    returns them as a pipes_type once their barriers are initialised."""
    pipes = pipes_type(**{
        name: tma_pipeline(getattr(storage, f"{name}_barriers"), *rings[name], num_consumer_threads)
        for name in pipes_type._fields if name in rings
    })
    # Barrier initialisation must be visible to the async proxy and to every thread before
    # anyone waits on or signals these barriers.
    cute.arch.mbarrier_init_fence()
    cute.arch.barrier()
    return pipes


def tma_tiles(atom, smem, gmem, rank: int = 2):
    """(smem, gmem) partitions of a single-CTA TMA copy whose first `rank` modes are one copy
    (the remaining modes index stages in smem and blocks in gmem)."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, rank), cute.group_modes(gmem, 0, rank)
    )


def store_tile(atom, smem, gmem_tile):
    """One thread: TMA-store the shared-memory tile smem to gmem_tile (clipped at the tensor's
    bounds) and commit it as a bulk group."""
    smem_part, gmem_part = tma_tiles(atom, smem, gmem_tile)
    cute.copy(atom, smem_part, gmem_part)
    cute.arch.cp_async_bulk_commit_group()


@cute.jit
def load_stage(pipe, tma_atom, gmem_tiles, smem_stages, n_block, state):
    """Wait for a free stage, arm its barrier with the byte count, issue the TMA load of
    gmem_tiles[..., n_block] into it; returns the advanced state."""
    pipe.producer_acquire(state)
    cute.copy(tma_atom, gmem_tiles[None, n_block], smem_stages[None, state.index],
              tma_bar_ptr=pipe.producer_get_barrier(state))
    state.advance()
    return state


def load_stage_of_tiles(pipe, tiles, n_block, state):
    """load_stage for several tiles on one barrier: `tiles` a tuple of (tma_atom, gmem_tiles,
    smem_stages), whose bytes the pipe's stage counts together (a float32 K with its K^T)."""
    pipe.producer_acquire(state)
    bar = pipe.producer_get_barrier(state)
    for tma_atom, gmem_tiles, smem_stages in tiles:
        cute.copy(tma_atom, gmem_tiles[None, n_block], smem_stages[None, state.index], tma_bar_ptr=bar)
    state.advance()
    return state
