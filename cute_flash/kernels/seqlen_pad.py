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


# A packed batch (kernels/sequences.py) gives each sequence its own region of these buffers:
# sequence b's rows start at row align(cu_seqlens_q[b]) + b * PACKED_ROW_SLACK, align()
# rounding up to PACKED_ROW_ALIGN rows (the TMA loads of a block's LSE / delta slice fault
# unless they start on 16 bytes), and its region holds PACKED_REGION_EXTRA rows more than
# the sequence, more than padded_seqlen_q ever adds (< 2 x 128 for block_m <= 128): the
# blocks of one sequence never reach the next one's rows.
PACKED_ROW_ALIGN = 4
PACKED_REGION_EXTRA = 2 * SEQLEN_Q_PAD
PACKED_ROW_SLACK = PACKED_REGION_EXTRA + PACKED_ROW_ALIGN


def packed_region_start(offset_q, batch):
    """The first row of sequence b's region (its first query row offset_q, aligned, plus b
    slacks). Plain arithmetic: the kernels apply it to DSL integers, launch_bwd to tensors."""
    return (offset_q + PACKED_ROW_ALIGN - 1) // PACKED_ROW_ALIGN * PACKED_ROW_ALIGN + batch * PACKED_ROW_SLACK


def packed_padded_rows(total_q: int, batch: int) -> int:
    """Rows of a packed batch's padded per-row buffers (a multiple of SEQLEN_Q_PAD)."""
    rows = total_q + PACKED_ROW_ALIGN + batch * PACKED_ROW_SLACK
    return (rows + SEQLEN_Q_PAD - 1) // SEQLEN_Q_PAD * SEQLEN_Q_PAD
