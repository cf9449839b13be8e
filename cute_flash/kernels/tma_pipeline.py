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


class MulticastRing:
    """A ring whose stages the CTAs of a (1-D) cluster fill together: each CTA's producer loads
    its part of a stage by TMA multicast into every CTA's copy of it, so a stage may be
    refilled only once the consumers of every CTA have released it. The consumers keep their
    local ring (release arrives stay in the CTA); the producers shake hands instead, per stage
    on a peer barrier of cluster_size arrivals in each CTA: after its own consumers released a
    stage (the local producer_acquire), a producer arrives on that stage's peer barrier in
    every CTA of the cluster, then waits for its own to complete. Keeping the cluster out of
    the consumers matters: remote arrives from their release made ptxas move the rings'
    stage indices out of uniform registers and rebuild every WGMMA descriptor per
    instruction (+96 instructions in the forward's loop).

    No arrive can target an exited CTA: a producer's last wait needs every peer's arrival for
    that use, and every multicast lands in a stage its target's consumers still wait for."""

    def __init__(self, ring, peer_barriers, cluster_size: int):
        self.ring = ring
        self.peers = peer_barriers  # pointer to num_stages Int64
        self.cluster_size = cluster_size

    # A DSL value (the kernel's loops carry it): the ring's values, then the peer pointer.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.ring) + cutlass.extract_mlir_values(self.peers)

    def __new_from_mlir_values__(self, values):
        n = len(cutlass.extract_mlir_values(self.ring))
        return MulticastRing(cutlass.new_from_mlir_values(self.ring, values[:n]),
                             cutlass.new_from_mlir_values(self.peers, values[n:]), self.cluster_size)

    @cute.jit
    def init_peer_barriers(self, num_stages: cutlass.Constexpr[int]):
        if cute.arch.thread_idx()[0] == 0:
            for stage in cutlass.range_constexpr(num_stages):
                cute.arch.mbarrier_init(self.peers + stage, self.cluster_size)

    @cute.jit
    def producer_acquire(self, state):
        self.ring.producer_acquire(state)
        barrier = self.peers + state.index
        if cute.arch.lane_idx() == 0:
            for rank in cutlass.range_constexpr(self.cluster_size):
                cute.arch.mbarrier_arrive(barrier, cutlass.Int32(rank))
        # Use u of a stage completes its peer barrier's phase u (the producer state's phase is 1 at u = 0).
        cute.arch.mbarrier_wait(barrier, state.phase ^ 1)

    def producer_get_barrier(self, state):
        return self.ring.producer_get_barrier(state)

    def consumer_wait(self, state):
        self.ring.consumer_wait(state)

    def consumer_release(self, state):
        self.ring.consumer_release(state)


def shared_storage(rings: dict, buffers: dict, multicast_rings=()):
    """The kernel's shared-memory struct: first the mbarrier pairs of each ring (rings: name ->
    (num_stages, bytes per stage), as start_rings takes them) as <name>_barriers, and the peer
    barriers of the rings named in multicast_rings (MulticastRing) as <name>_peer_barriers,
    then the buffers (name -> (dtype, elements, alignment in bytes)) in the order given."""
    fields = {f"{name}_barriers": cute.struct.MemRange[cutlass.Int64, 2 * stages] for name, (stages, _) in rings.items()}
    for name in multicast_rings:
        fields[f"{name}_peer_barriers"] = cute.struct.MemRange[cutlass.Int64, rings[name][0]]
    for name, (dtype, elements, align) in buffers.items():
        fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, elements], align]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def swizzled_tensor(buffer, layout):
    """The tensor of a shared-memory struct field laid out by a swizzled (composed) layout."""
    return buffer.get_tensor(layout.outer, swizzle=layout.inner)


def start_rings(storage, pipes_type, rings: dict, num_consumer_threads: int, multicast: int = 1):
    """The kernel's rings, one per field of the NamedTuple pipes_type that `rings` names (the
    others keep their defaults: rings of a kernel variant), each on the barriers
    storage.<field>_barriers with rings[field] = (num_stages, tx_count) and the same consumers;
    returns them as a pipes_type once their barriers are initialised. multicast > 1: the rings
    with storage.<field>_peer_barriers are MulticastRings of a cluster of that many CTAs."""
    pipes = {}
    for name in pipes_type._fields:
        if name not in rings:
            continue
        pipes[name] = tma_pipeline(getattr(storage, f"{name}_barriers"), *rings[name], num_consumer_threads)
        if multicast > 1 and hasattr(storage, f"{name}_peer_barriers"):
            pipes[name] = MulticastRing(pipes[name], getattr(storage, f"{name}_peer_barriers").data_ptr(), multicast)
            pipes[name].init_peer_barriers(rings[name][0])
    # Barrier initialisation must be visible to the async proxy and to every thread before
    # anyone waits on or signals these barriers; with multicast rings, to the cluster's other
    # CTAs too (they load into this CTA's stages and arrive on its peer barriers).
    cute.arch.mbarrier_init_fence()
    if multicast > 1:
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
    else:
        cute.arch.barrier()
    return pipes_type(**pipes)


def tma_tiles(atom, smem, gmem, rank: int = 2, cluster_size: int = 1):
    """(smem, gmem) partitions of a TMA copy whose first `rank` modes are one copy (the
    remaining modes index stages in smem and blocks in gmem). cluster_size > 1: a multicast
    atom's, this CTA's part of each copy (the atom splits the box among the cluster's CTAs;
    MulticastRing)."""
    cta, ctas = 0, cute.make_layout(1)
    if cluster_size > 1:
        cta, ctas = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()), cute.make_layout(cluster_size)
    return cpasync.tma_partition(atom, cta, ctas, cute.group_modes(smem, 0, rank), cute.group_modes(gmem, 0, rank))


def multicast_to_cluster(cluster_size: int) -> dict:
    """The keyword arguments of a TMA copy that multicasts to every CTA of a (1-D) cluster of
    cluster_size (none for a single CTA)."""
    return dict(mcast_mask=cutlass.Int16((1 << cluster_size) - 1)) if cluster_size > 1 else {}


def store_tile(atom, smem, gmem_tile):
    """One thread: TMA-store the shared-memory tile smem to gmem_tile (clipped at the tensor's
    bounds) and commit it as a bulk group."""
    smem_part, gmem_part = tma_tiles(atom, smem, gmem_tile)
    cute.copy(atom, smem_part, gmem_part)
    cute.arch.cp_async_bulk_commit_group()


@cute.jit
def load_stage(pipe, tma_atom, gmem_tiles, smem_stages, n_block, state, **mcast):
    """Wait for a free stage, arm its barrier with the byte count, issue the TMA load of
    gmem_tiles[..., n_block] into it (mcast: a multicast load's mcast_mask); returns the
    advanced state."""
    pipe.producer_acquire(state)
    cute.copy(tma_atom, gmem_tiles[None, n_block], smem_stages[None, state.index],
              tma_bar_ptr=pipe.producer_get_barrier(state), **mcast)
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
