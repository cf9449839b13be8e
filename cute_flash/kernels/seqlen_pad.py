"""Row padding of the backward's per-row fp32 buffers (LSE * log2(e), delta, dQ accumulator).

Kept apart from the kernels (no DSL import) because the torch side sizes those buffers.
"""

# The pre/postprocess tile; with the main kernel's block_m (padded_seqlen_q) TMA loads of a
# block's LSE / delta slice and the dQ additions never leave the buffer.
SEQLEN_Q_PAD = 128


def padded_seqlen_q(seqlen_q: int, block_m: int = SEQLEN_Q_PAD) -> int:
    """Sq rounded up to a multiple of SEQLEN_Q_PAD that also covers whole blocks of block_m
    rows (block_m = 80 does not divide 128: the main kernel's last block may reach past
    Sq rounded to 128)."""
    rows = max(seqlen_q, (seqlen_q + block_m - 1) // block_m * block_m)
    return (rows + SEQLEN_Q_PAD - 1) // SEQLEN_Q_PAD * SEQLEN_Q_PAD
