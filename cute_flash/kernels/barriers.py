"""Named barrier ids (bar.sync / bar.arrive), every kernel's in one place.

A CTA has 16 named barriers; id 0 is the one __syncthreads uses. Each kernel numbers its own
(they do not share a CTA), so the same id may mean different things in different kernels:
what must not happen is two roles of one kernel using one id, which this table makes visible.
"""

from enum import IntEnum

NUM_NAMED_BARRIERS = 16  # per CTA, hardware


class ForwardBarrier(IntEnum):
    """FlashForwardSm90 (fwd_sm90.py)."""

    EPILOGUE = 1  # the consumer warpgroups' O tile is in shared memory before its TMA store
    FIRST_PINGPONG = 2  # one per consumer warpgroup (2, 3, 4): whose turn it is to issue its GEMMs
    # Every consumer warpgroup's zeros are in the last key block's V stage before any P V reads it.
    STALE_KEYS = 5
    # The ones tile of P's row sums (kernels/probability_sums.py) is in shared memory before any P V.
    ONES = 6


class BackwardBarrier(IntEnum):
    """FlashBackwardSm90 (bwd_sm90.py) and the warps it hosts (bwd_prepare_ahead.py,
    dq_accumulate.py)."""

    EPILOGUE = 1  # dK / dV tiles are in shared memory before their TMA stores
    PDS = 2  # dS of every consumer warpgroup is in shared memory (the dQ GEMM reads all of it)
    STALE_KEYS = 3  # the key block's K and V rows past its keys are zeros (kernels/stale_keys.py)
    PREPARE_AHEAD = 4  # the producer warpgroup's preparing warps finished a head's rows
    # The dQ hand-off between consumer warpgroups and the writer warp: an empty and a full
    # barrier per staged chunk, dq_stages x num_mma_warpgroups of each, from this id on
    # (dq_accumulate.DqAccumulator). config.MAX_DQ_TILE_CHUNKS bounds them to ids 5..14.
    DQ_HANDOFF_FIRST = 5
    # fused_postprocess: the writer warp has counted the CTA's dQ sums (and told which heads it
    # completed) before the consumer warpgroups convert them (convert_finished_heads).
    DQ_CONVERT = 15


class DqKernelBarrier(IntEnum):
    """FlashBackwardDqSm90 (bwd_dq_sm90.py)."""

    EPILOGUE = 1  # every consumer warpgroup is past its last S = Q K^T before dQ reuses Q's buffer
    STALE_KEYS = 2  # the first key block's K and V rows past the keys are zeros (kernels/stale_keys.py)
