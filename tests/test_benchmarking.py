"""CPU-side parts of the measuring helpers."""

import torch

from cute_flash.benchmarking import relative_error, run_poisoned


def test_run_poisoned_leaves_unwritten_elements_nan():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))

    def writes_first_head_only(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, scale):
        out[:, 0] = v[:, 0] * scale
        lse[:, 0] = 1.0

    out, lse = run_poisoned(writes_first_head_only, q, k, v, 0.5)
    assert torch.equal(out[:, 0], v[:, 0] * 0.5) and torch.isnan(out[:, 1]).all()
    assert (lse[:, 0] == 1.0).all() and torch.isnan(lse[:, 1]).all() and lse.dtype == torch.float32
    assert relative_error(out, v) == float("inf")  # a NaN where the reference is finite never passes
