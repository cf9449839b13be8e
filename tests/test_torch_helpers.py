"""cute_flash.torch_helpers on CPU tensors: which layouts TMA can read without a copy (the check
runs for every input and gradient buffer of every call, and has a fast path)."""

import torch

from cute_flash.torch_helpers import as_tma_operand, batch_of_one, tma_compatible, tma_operands


def test_dense_tensors_and_strided_views():
    base = torch.randn(2, 8, 3, 64).to(torch.float16)  # (B, S, N, D)
    assert tma_compatible(base.contiguous())
    assert tma_compatible(base.transpose(1, 2))  # (B, N, S, D) view: 16-byte strides
    assert not tma_compatible(base[..., 1:])  # base address 2 bytes past an aligned one
    assert not tma_compatible(base.transpose(2, 3))  # last dim not contiguous


def test_rows_narrower_than_16_bytes():
    narrow = torch.randn(3, 4).to(torch.float16)  # 8-byte rows: outer stride not 16-byte aligned
    assert narrow.is_contiguous() and not tma_compatible(narrow)
    assert tma_compatible(narrow[:1])  # a single row: no outer stride to align


def test_copies_only_what_tma_cannot_read():
    t = torch.randn(2, 4, 16, 64).to(torch.bfloat16)
    assert as_tma_operand(t) is t
    shifted = torch.randn(2 * 4 * 16 * 64 + 1).to(torch.bfloat16)[1:].view(2, 4, 16, 64)
    copy = as_tma_operand(shifted)
    assert copy is not shifted and tma_compatible(copy) and torch.equal(copy, shifted)


def test_tma_operands_copies_exactly_the_marked_tensors():
    a, b = torch.randn(4, 8), torch.randn(8, 4).t()
    same = [a, b]
    assert tma_operands(same, (False, False)) is same
    copied = tma_operands([a, b], (False, True))
    assert copied[0] is a and copied[1] is not b
    assert copied[1].is_contiguous() and torch.equal(copied[1], b)


def test_empty_with_head_dim_keeps_the_memory_order_of_the_outer_dims():
    from cute_flash.torch_helpers import empty_with_head_dim

    bsnd = torch.randn(2, 5, 3, 64).transpose(1, 2)  # (B, N, S, D) view of (B, S, N, D) memory
    out = empty_with_head_dim(bsnd, 32)
    assert out.shape == (2, 3, 5, 32) and out.transpose(1, 2).is_contiguous()
    dense = torch.randn(2, 3, 5, 64)
    assert empty_with_head_dim(dense, 96).is_contiguous() and empty_with_head_dim(dense, 96).shape == (2, 3, 5, 96)
    assert empty_with_head_dim(dense, 64).shape == dense.shape


def test_batch_of_one_is_the_kernels_view_of_packed_rows():
    base = torch.arange(2 * 7 * 3 * 40, dtype=torch.float32).view(2, 7, 3, 40)
    packed = (
        base[0, :, :, :16],  # rows narrower than their stride
        base[1].transpose(0, 1).contiguous().transpose(0, 1),  # heads outermost
        base.view(14, 3, 40)[5:9],  # a storage offset
        base.view(14, 3, 40)[:0],  # no rows
    )
    for t in packed:
        got, want = batch_of_one(t), t.unsqueeze(0).transpose(1, 2)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset() and torch.equal(got, want)
