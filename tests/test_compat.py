"""flash-attn's argument conventions on the flash-attn-style entry points (cute_flash.compat),
on the CPU: meta tensors reach the ops' fakes, so shapes and refusals are checked without a
GPU (the GPU tests of test_variants / test_varlen / test_kvcache run the same entry points)."""

import pytest
import torch

import cute_flash
from cute_flash import compat

META16 = dict(device="meta", dtype=torch.bfloat16)


def _dense(batch=2, seqlen_q=5, seqlen_k=7, heads=4, kv_heads=2, head_dim=64):
    """flash-attn's (B, S, H, D) layout."""
    q = torch.empty(batch, seqlen_q, heads, head_dim, **META16)
    k = torch.empty(batch, seqlen_k, kv_heads, head_dim, **META16)
    return q, k, torch.empty_like(k)


def _packed(heads=4, kv_heads=2, head_dim=64):
    q = torch.empty(12, heads, head_dim, **META16)
    k = torch.empty(14, kv_heads, head_dim, **META16)
    offsets_q = torch.empty(3, dtype=torch.int32, device="meta")
    offsets_k = torch.empty(3, dtype=torch.int32, device="meta")
    return q, k, torch.empty_like(k), offsets_q, offsets_k, 7, 7


def test_window_sides_of_none_are_unbounded():
    assert compat.window((None, None)) == (-1, -1)
    assert compat.window([128, None]) == (128, -1)
    assert compat.window((None, 0)) == (-1, 0)
    assert compat.window((3, 4)) == (3, 4)
    # Not a pair: passed on as it is, for check_variant to name.
    assert compat.window(5) == 5
    assert compat.window((1, 2, 3)) == (1, 2, 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sinks_in_flash_attn_4s_dtypes_become_float32_logits(dtype):
    logits = torch.tensor([0.5, -1.25, 3.0], dtype=dtype, requires_grad=True)
    sink = compat.sink(logits)
    assert sink.dtype == torch.float32
    assert torch.equal(sink, logits.detach().float())
    # Differentiable: the gradient comes back in the caller's dtype.
    (sink * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert logits.grad.dtype == dtype
    assert torch.equal(logits.grad, torch.tensor([1.0, 2.0, 3.0], dtype=dtype))


def test_other_sinks_are_passed_on_for_the_checks():
    wrong = torch.zeros(3, dtype=torch.float64)
    assert compat.sink(wrong) is wrong
    assert compat.sink(None) is None
    assert compat.sink([1.0]) == [1.0]


def test_dropout_must_be_zero():
    compat.no_dropout(0.0)
    compat.no_dropout(0)
    with pytest.raises(ValueError, match="no attention dropout"):
        compat.no_dropout(0.1)


def test_page_table_is_block_tables_other_name():
    table = torch.zeros(2, 3, dtype=torch.int32)
    assert compat.block_table(table, None) is table
    assert compat.block_table(None, table) is table
    assert compat.block_table(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        compat.block_table(table, table)


def test_flash_attn_func_takes_flash_attn_4s_arguments():
    q, k, v = _dense()
    sink = torch.empty(4, **META16)
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, window_size=(None, 0), learnable_sink=sink,
                                          return_lse=True, num_splits=1, pack_gqa=True)
    assert out.shape == (2, 5, 4, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    out = cute_flash.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.1, causal=False)
    assert out.shape == (2, 5, 4, 64)


@pytest.mark.parametrize("extra", [(0.1,), (None, None, 0.1)], ids=["flash-attn-2", "flash-attn-4"])
def test_flash_attn_func_refuses_arguments_by_position(extra):
    """flash-attn 2's fourth argument is dropout_p, flash-attn-4's qv: by position, a
    dropout probability would have been taken for the softmax scale."""
    q, k, v = _dense()
    with pytest.raises(TypeError, match="positional"):
        cute_flash.flash_attn_func(q, k, v, *extra)


def test_flash_attn_func_refuses_dropout():
    q, k, v = _dense()
    with pytest.raises(ValueError, match="dropout"):
        cute_flash.flash_attn_func(q, k, v, dropout_p=0.1, causal=True)


def test_flash_attn_varlen_func_takes_flash_attn_4s_arguments():
    q, k, v, offsets_q, offsets_k, max_q, max_k = _packed()
    out = cute_flash.flash_attn_varlen_func(q, k, v, offsets_q, offsets_k, max_q, max_k, causal=True,
                                            window_size=[None, None], learnable_sink=torch.empty(4, **META16),
                                            dropout_p=0.0, num_splits=1, pack_gqa=False)
    assert out.shape == (12, 4, 64) and out.dtype == torch.bfloat16


def test_flash_attn_varlen_func_refuses_arguments_by_position():
    """flash-attn 2 continues with dropout_p, softmax_scale; flash-attn-4 with min_seqlen_k,
    seqused_q, seqused_k."""
    q, k, v, offsets_q, offsets_k, max_q, max_k = _packed()
    with pytest.raises(TypeError, match="positional"):
        cute_flash.flash_attn_varlen_func(q, k, v, offsets_q, offsets_k, max_q, max_k, 0.0, 0.125)
    with pytest.raises(ValueError, match="dropout"):
        cute_flash.flash_attn_varlen_func(q, k, v, offsets_q, offsets_k, max_q, max_k, dropout_p=0.5)


def test_flash_attn_varlen_func_refuses_both_table_names():
    q, k, v, offsets_q, offsets_k, max_q, max_k = _packed()
    table = torch.empty(2, 4, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="not both"):
        cute_flash.flash_attn_varlen_func(q, k, v, offsets_q, offsets_k, max_q, max_k, block_table=table,
                                          page_table=table)


def test_flash_attn_with_kvcache_takes_flash_attn_3s_arguments():
    """The checks pass (None window sides, a bf16 sink, page_table) and the call stops only
    where the kernels need a GPU."""
    q = torch.empty(2, 1, 8, 64, **META16)
    pages = torch.empty(4, 16, 2, 64, **META16)
    table = torch.empty(2, 2, dtype=torch.int32, device="meta")
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA tensors on an NVIDIA Hopper GPU"):
        cute_flash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=5, page_table=table, num_splits=1,
                                           window_size=(None, None), learnable_sink=torch.empty(8, **META16),
                                           pack_gqa=True)
    with torch.no_grad(), pytest.raises(ValueError, match="not both"):
        cute_flash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=5, page_table=table, block_table=table)


def test_flash_attn_with_kvcache_refuses_arguments_by_position():
    """After k and v, flash-attn 2 takes rotary_cos, rotary_sin, cache_seqlens; flash-attn 3
    qv first."""
    q = torch.empty(2, 1, 8, 64, **META16)
    cache = torch.empty(2, 16, 2, 64, **META16)
    with torch.no_grad(), pytest.raises(TypeError, match="positional"):
        cute_flash.flash_attn_with_kvcache(q, cache, cache, None, None, None, None, 5)


def test_strided_sinks_and_offsets_are_refused_by_name():
    """The kernels read 1-D tensors with stride 1: a strided view is refused by its name."""
    q, k, v = _dense()
    strided_sink = torch.empty(8, dtype=torch.float32, device="meta")[::2]
    with pytest.raises(ValueError, match="sink must be contiguous"):
        cute_flash.flash_attn_func(q, k, v, learnable_sink=strided_sink)
    packed = list(_packed())
    packed[3] = torch.empty(3, 2, dtype=torch.int32, device="meta")[:, 0]
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        cute_flash.flash_attn_varlen_func(*packed)
    # A vector of one entry has no stride to speak of.
    out = cute_flash.flash_attn_func(*_dense(heads=1, kv_heads=1), learnable_sink=torch.empty(1, 2, **META16)[:, 0])
    assert out.shape == (2, 5, 1, 64)


# flash_attn_func's argument errors name flash-attn's (B, S, H, D) dimensions.
BAD_LAYOUT_CALLS = [
    ("q rank 3", lambda q, k, v: (q[0], k, v), ["q must have 4 dimensions (batch, seqlen, heads, head_dim)", "got 3"]),
    ("v rank 5", lambda q, k, v: (q, k, v[None]), ["v must have 4 dimensions", "got 5"]),
    ("k and v heads differ", lambda q, k, v: (q, k, v[:, :, :1]), ["same number of heads (dim 2)", "k=2, v=1"]),
    ("k and v seqlens differ", lambda q, k, v: (q, k, v[:, :3]), ["same sequence length (dim 1)", "k=7, v=3"]),
    ("batch differs", lambda q, k, v: (q[:1], k, v), ["same batch size (dim 0)", "q=1", "k=2"]),
    ("kv heads do not divide", lambda q, k, v: (q[:, :, :3], k, v),
     ["key/value heads (2) must divide the number of query heads (3)"]),
]


@pytest.mark.parametrize("mutate, words", [c[1:] for c in BAD_LAYOUT_CALLS], ids=[c[0] for c in BAD_LAYOUT_CALLS])
def test_flash_attn_func_names_its_layouts_dimensions(mutate, words):
    q, k, v = mutate(*_dense())
    with pytest.raises(ValueError) as info:
        cute_flash.flash_attn_func(q, k, v, causal=True)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
