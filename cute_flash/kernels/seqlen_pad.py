"""Row padding of the backward's per-row fp32 buffers (LSE * log2(e), delta, dQ accumulator).

Kept apart from the kernels (no DSL import) because the torch side sizes those buffers.
"""

# A multiple of every backward block_m and of the pre/postprocess tiles: TMA loads of a
# block's LSE / delta slice and the dQ additions never leave the buffer.
SEQLEN_Q_PAD = 128


def padded_seqlen_q(seqlen_q: int) -> int:
    """Sq rounded up to SEQLEN_Q_PAD."""
    return (seqlen_q + SEQLEN_Q_PAD - 1) // SEQLEN_Q_PAD * SEQLEN_Q_PAD
