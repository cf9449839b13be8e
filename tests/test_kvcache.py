"""Attention over a KV cache (cute_flash.kvcache): the host checks on the CPU; on the GPU the
appends (every slot but the targets untouched, also under offsets that break the contract)
and the attention against the float64 reference per sequence."""

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cute_flash
from cute_flash.kvcache import check_kvcache_call
from cute_flash.reference import attention_reference

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
TOLERANCE = {FP16: 3e-3, BF16: 1.2e-2, FP32: 2e-6}


def cache_inputs(batch, seqlen_q, heads, kv_heads, head_dim, cache_batch, cache_len, dtype, device="cuda", new=0,
                 value_head_dim=None):
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    value_dim = value_head_dim or head_dim
    q = make(batch, seqlen_q, heads, head_dim)
    k_cache, v_cache = make(cache_batch, cache_len, kv_heads, head_dim), make(cache_batch, cache_len, kv_heads, value_dim)
    k, v = (make(batch, new, kv_heads, head_dim), make(batch, new, kv_heads, value_dim)) if new else (None, None)
    return q, k_cache, v_cache, k, v


def reference(q, k_cache, v_cache, lengths, entries, **kwargs):
    """Per sequence: q[b] against the first lengths[b] slots of cache entry entries[b]
    (bottom-right alignment); out (B, Sq, N, D) and LSE (B, N, Sq) in float64."""
    outs, lses = [], []
    for b, (n, e) in enumerate(zip(lengths, entries)):
        rows = q[b].transpose(0, 1).double()  # (N, Sq, D)
        if n == 0:
            outs.append(torch.zeros_like(rows))
            lse = torch.full(rows.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
            if kwargs.get("sink") is not None:
                lse[:] = kwargs["sink"].double().view(-1, 1)
            lses.append(lse)
            continue
        keys, values = (c[e, :n].transpose(0, 1).double() for c in (k_cache, v_cache))
        o, lse = attention_reference(rows, keys, values, alignment="bottom_right", **kwargs)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs).transpose(1, 2), torch.stack(lses)


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_against_reference(out, lse, q, k_cache, v_cache, lengths, entries, dtype, **kwargs):
    want, want_lse = reference(q, k_cache, v_cache, lengths, entries, **kwargs)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    if seen.any():  # (no key in any sequence: every LSE -inf)
        assert (lse[seen].double() - want_lse[seen]).abs().max().item() < 2e-3


# ---- host checks (CPU) ----

def test_host_checks_name_the_argument():
    q, k_cache, v_cache, k, v = cache_inputs(2, 1, 4, 2, 64, 3, 16, FP16, device="cpu", new=2)
    seqlens = torch.zeros(2, dtype=torch.int32)
    call = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens, cache_batch_idx=None,
                block_table=None, num_splits=0)
    cases = [
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), ValueError, "block_table must be an int32"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, r"shape \(2, max_pages"),
        (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "max_pages >= 1"),
        (dict(block_table=torch.zeros(4, 2, dtype=torch.int32).t()), ValueError, "block_table must have a contiguous"),
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32), cache_seqlens=15), ValueError,
         "does not fit a sequence.s 16 slots"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32), k_cache=k_cache[:, :12], v_cache=v_cache[:, :12]),
         ValueError, "multiple of 8"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int32), cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
         ValueError, "cannot be combined"),
        (dict(v=None), ValueError, "together"),
        (dict(cache_seqlens=None), ValueError, "needs cache_seqlens"),
        (dict(cache_seqlens=15), ValueError, "does not fit"),  # 15 + 2 new rows > 16 slots
        (dict(cache_seqlens=-1), ValueError, "does not fit"),
        (dict(cache_seqlens=seqlens.long()), TypeError, "cache_seqlens must be int32"),
        (dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_batch_idx must have 2 entries"),
        (dict(k_cache=k_cache[..., :32], v_cache=v_cache[..., :32]), ValueError, "head dim"),
        (dict(v_cache=v_cache[:, :8]), ValueError, "same shape"),
        (dict(k_cache=k_cache.double()), TypeError, "k_cache must be float16, bfloat16 or float32"),
        (dict(k_cache=k_cache.float()), TypeError, "one dtype"),
        (dict(v_cache=v_cache.bfloat16(), k_cache=k_cache.bfloat16()), TypeError, "one dtype"),
        (dict(k=k[:, :, :1], v=v[:, :, :1]), ValueError, "k must have shape"),
        (dict(q=q[:, :, :3]), ValueError, "divide"),
        (dict(q=q[0]), ValueError, "4 dimensions"),
        (dict(k_cache=k_cache.transpose(1, 3).contiguous().transpose(1, 3)), ValueError, "contiguous last"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        # v's head dim may differ from q's and k's, within the supported ones, matched by v.
        (dict(v_cache=torch.zeros(3, 16, 2, 300, dtype=FP16)), ValueError, "v_cache has head dim 300"),
        (dict(v_cache=v_cache[..., :48]), ValueError, r"v must have shape \(2, S_new, 2, 48\)"),
        (dict(v=v[:, :1]), ValueError, "as many new rows"),
    ]
    for change, error, words in cases:
        with pytest.raises(error, match=words):
            check_kvcache_call(**{**call, **change})
    assert check_kvcache_call(**call) == 2
    assert check_kvcache_call(**{**call, "v_cache": v_cache[..., :48], "v": v[..., :48]}) == 2
    assert check_kvcache_call(**{**call, "block_table": torch.zeros(2, 4, dtype=torch.int32)}) == 2
    assert check_kvcache_call(**{**call, "cache_seqlens": 60, "block_table": torch.zeros(2, 4, dtype=torch.int32)}) == 2
    big_batch = cache_inputs(4, 1, 4, 2, 64, 3, 16, FP16, device="cpu")
    with pytest.raises(ValueError, match="needs cache_batch_idx"):
        check_kvcache_call(*big_batch, None, None, None, 0)


def test_every_argument_is_checked_before_the_cache_is_written():
    q, k_cache, v_cache, k, v = cache_inputs(2, 1, 4, 2, 300, 2, 16, FP16, device="cpu", new=1)
    with pytest.raises(ValueError, match="head dim 300"):
        check_kvcache_call(q, k_cache, v_cache, k, v, 3, None, None, 0)
    q, k_cache, v_cache, k, v = cache_inputs(2, 1, 4, 2, 64, 2, 16, FP16, device="cpu", new=1)
    before = k_cache.clone()
    # (On the CPU the append itself would fail too, with another message: the scale's must come first.)
    with pytest.raises(ValueError, match="softmax_scale"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="window_size"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, window_size=(-2, 0))
    assert torch.equal(k_cache, before)


def test_a_cache_whose_pages_do_not_follow_each_other_is_copied_with_a_warning():
    """vLLM's (pages, 2, page_size, Nkv, D) tensor: its k and v halves are strided views whose
    pages cannot be read as one run of rows, so each call copies the cache: said once."""
    import warnings

    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(2, 1, 8, 64, **meta)
    table = torch.empty(2, 2, dtype=torch.int32, device="meta")
    kv = torch.empty(4, 2, 16, 2, 64, **meta)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"k_cache of shape \(4, 16, 2, 64\).*copies all of it"):
        with pytest.raises(ValueError, match="CUDA tensors"):  # the checks passed; the kernels need a GPU
            cute_flash.flash_attn_with_kvcache(q, kv[:, 0], kv[:, 1], cache_seqlens=5, block_table=table,
                                               num_splits=1)
    pages = torch.empty(4, 16, 2, 64, **meta)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="CUDA tensors"):
            cute_flash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=5, block_table=table, num_splits=1)


def test_validate_names_bad_lengths_before_anything_is_written():
    """validate=True through flash_attn_with_kvcache itself, on the CPU: a length whose new rows
    do not fit is named and the cache is left as it was; good lengths go on to the kernels."""
    q, new = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16), torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    cache = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16)
    before = cache.clone()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 16 with 1 new rows does not fit"):
            cute_flash.flash_attn_with_kvcache(q, cache, cache, new, new, validate=True,
                                               cache_seqlens=torch.tensor([3, 16], dtype=torch.int32))
        assert torch.equal(cache, before)
        with pytest.raises(ValueError, match="CUDA tensors"):
            cute_flash.flash_attn_with_kvcache(q, cache, cache, new, new, validate=True,
                                               cache_seqlens=torch.tensor([3, 6], dtype=torch.int32))
        assert torch.equal(cache, before)  # the device check, too, comes before any write


def test_gradients_are_refused():
    q, k_cache, v_cache, _, _ = cache_inputs(1, 1, 2, 2, 64, 1, 8, FP16, device="cpu")
    with pytest.raises(RuntimeError, match="no gradients"):
        cute_flash.flash_attn_with_kvcache(q.requires_grad_(), k_cache, v_cache, cache_seqlens=4)


def test_paged_values_are_checked_under_validate():
    from cute_flash.kvcache import check_kvcache_values

    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seqlens = torch.tensor([20, 5], dtype=torch.int32)  # pages of 8 slots: 3 and 1 in use (+ new rows)
    check_kvcache_values(seqlens, None, 2, 6, 24, table)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 9 is outside the cache's 6 pages"):
        check_kvcache_values(seqlens, None, 2, 6, 24, torch.tensor([[0, 1, 2], [9, 4, 5]], dtype=torch.int32))
    check_kvcache_values(seqlens, None, 2, 6, 24, torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit a sequence's 24 slots"):
        check_kvcache_values(seqlens + 3, None, 2, 6, 24, table)
    shared = torch.tensor([[0, 1, 2], [2, 4, 5]], dtype=torch.int32)  # page 2 gets rows of both
    with pytest.raises(ValueError, match="page 2 receives new rows of sequences 0 and 1"):
        check_kvcache_values(seqlens, None, 2, 6, 24, shared)
    check_kvcache_values(torch.tensor([20, 0], dtype=torch.int32), None, 0, 6, 24, shared)  # read-only sharing
    # A prefix page read by both while each appends to a page of its own: fine.
    prefix = torch.tensor([[0, 1, 2], [0, 4, 5]], dtype=torch.int32)
    check_kvcache_values(torch.tensor([20, 8], dtype=torch.int32), None, 2, 6, 24, prefix)
    # Sequence 1 appends into page 0, whose 8 cached rows sequence 0 reads (a zero-padded table).
    padded = torch.tensor([[0, 1, 3], [2, 0, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="page 0 receives new rows of sequence 1 but holds cached rows of sequence 0"):
        check_kvcache_values(torch.tensor([8, 8], dtype=torch.int32), None, 2, 6, 24, padded)
    check_kvcache_values(torch.tensor([8, 8], dtype=torch.int32), None, 0, 6, 24, padded)  # nothing appended


# ---- GPU ----

LENGTHS = [1, 300, 0, 1000, 17]  # cache slots in use per sequence (S_max = 1024)
ENTRIES = [3, 0, 5, 1, 2]  # cache_batch_idx (B_cache = 6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (FP16, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_attention_over_the_cache(dtype, head_dim, causal, seqlen_q):
    q, k_cache, v_cache, _, _ = cache_inputs(5, seqlen_q, 8, 2, head_dim, 6, 1024, dtype)
    seqlens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    entries = torch.tensor(ENTRIES, dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                  cache_batch_idx=entries, causal=causal, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (5, 8, seqlen_q)
    check_against_reference(out, lse, q, k_cache, v_cache, LENGTHS, ENTRIES, dtype, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("new", [1, 3])
def test_appends_write_their_slots_and_nothing_else(new):
    dtype = BF16
    q, k_cache, v_cache, k, v = cache_inputs(5, new, 8, 2, 128, 6, 1024, dtype, new=new)
    before = (k_cache.clone(), v_cache.clone())
    lengths = [1, 300, 0, 1000, 17]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    entries = torch.tensor(ENTRIES, dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                  cache_batch_idx=entries, causal=True, return_softmax_lse=True)
    expect = [c.clone() for c in before]
    for b, (n, e) in enumerate(zip(lengths, ENTRIES)):
        expect[0][e, n:n + new] = k[b]
        expect[1][e, n:n + new] = v[b]
    assert torch.equal(k_cache, expect[0]) and torch.equal(v_cache, expect[1])
    check_against_reference(out, lse, q, k_cache, v_cache, [n + new for n in lengths], ENTRIES, dtype, causal=True)


@pytest.mark.gpu
def test_offsets_that_break_the_contract_write_no_other_slot():
    dtype = FP16
    q, k_cache, v_cache, k, v = cache_inputs(4, 3, 4, 4, 64, 3, 64, dtype, new=3)
    before = (k_cache.clone(), v_cache.clone())
    lengths = [62, -5, 10, 0]  # 62 + 3 rows overflow 64 slots; a negative start
    entries = [0, 1, 7, -1]  # entries 7 and -1 lie outside the cache
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    index = torch.tensor(entries, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="does not fit"):
        cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=index,
                                           validate=True)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    out = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=index)
    torch.cuda.synchronize()
    expect = [c.clone() for c in before]
    for b, (n, e) in enumerate(zip(lengths, entries)):
        for i in range(3):
            if 0 <= e < 3 and 0 <= n + i < 64:
                expect[0][e, n + i] = k[b, i]
                expect[1][e, n + i] = v[b, i]
    assert torch.equal(k_cache, expect[0]) and torch.equal(v_cache, expect[1])
    assert out.shape == q.shape


@pytest.mark.gpu
def test_variants_with_an_int_length_and_no_batch_index():
    dtype = BF16
    q, k_cache, v_cache, k, v = cache_inputs(3, 4, 8, 4, 128, 3, 700, dtype, new=4)
    sink = torch.randn(8, device="cuda")
    kwargs = dict(causal=True, window_size=(100, 0), softcap=10.0)
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=600, learnable_sink=sink,
                                                  return_softmax_lse=True, **kwargs)
    check_against_reference(out, lse, q, k_cache, v_cache, [604] * 3, [0, 1, 2], dtype, sink=sink, **kwargs)


@pytest.mark.gpu
def test_a_head_dim_that_is_not_a_multiple_of_8():
    dtype = FP16
    q, k_cache, v_cache, k, v = cache_inputs(2, 2, 4, 2, 72 - 2, 2, 300, dtype, new=2)
    seqlens = torch.tensor([5, 250], dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
                                                  return_softmax_lse=True)
    check_against_reference(out, lse, q, k_cache, v_cache, [7, 252], [0, 1], dtype, causal=True)


# v with a head dim of its own (DeepSeek's (192, 128); unaligned widths; Dv > D), through each
# route of a step: (dtype, D, Dv, Sq = new rows, heads, kv heads, page size, num_splits).
VALUE_DIM_CASES = [
    (BF16, 192, 128, 1, 8, 2, 0, 0),  # the decode step (a group's heads as rows, a view)
    (BF16, 192, 128, 1, 8, 2, 64, 3),  # split decode over pages, merged at Dv
    (BF16, 192, 128, 4, 8, 2, 0, 1),  # grouped rows (q and O copied), unsplit
    (BF16, 192, 128, 33, 8, 2, 16, 0),  # the dense queries (a prefill chunk) over pages
    (FP16, 70, 50, 3, 4, 4, 16, 0),  # both widths padded, on separate copies
    (FP16, 64, 96, 1, 8, 8, 0, 0),  # Dv > D, one query head per key/value head
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, value_dim, new, heads, kv_heads, page_size, splits", VALUE_DIM_CASES)
def test_a_value_head_dim_of_its_own(dtype, head_dim, value_dim, new, heads, kv_heads, page_size, splits):
    """Appends of k and v rows of their own widths (every other slot untouched) and attention
    against the reference, out (B, Sq, N, Dv)."""
    cache_len = 512
    q, k_cache, v_cache, k, v = cache_inputs(4, new, heads, kv_heads, head_dim, 4, cache_len, dtype, new=new,
                                             value_head_dim=value_dim)
    lengths = [0, 1, 300, cache_len - new]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    caches, table = (k_cache.clone(), v_cache.clone()), None
    if page_size:
        *caches, table = paged_caches(k_cache, v_cache, page_size, 3, seed=2)
    out, lse = cute_flash.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens, block_table=table,
                                                  causal=True, num_splits=splits, return_softmax_lse=True)
    for b, n in enumerate(lengths):  # the reference's cache, appended by hand
        k_cache[b, n:n + new], v_cache[b, n:n + new] = k[b], v[b]
    expect = (k_cache, v_cache) if not page_size else [paged_cache(c, page_size, 3, seed=2)[0] for c in (k_cache, v_cache)]
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])
    assert out.shape == (4, new, heads, value_dim)
    check_against_reference(out, lse, q, k_cache, v_cache, [n + new for n in lengths], range(4), dtype, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (FP16, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_step_with_grouped_heads(dtype, head_dim, causal):
    batch, heads, kv_heads, cache_batch, cache_len = 16, 16, 4, 20, 512
    q, k_cache, v_cache, k, v = cache_inputs(batch, 1, heads, kv_heads, head_dim, cache_batch, cache_len, dtype, new=1)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, cache_len, (batch,), generator=generator).tolist()
    lengths[:3] = [0, 1, cache_len - 1]
    entries = torch.randperm(cache_batch, generator=generator)[:batch].tolist()
    seqlens, index = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (lengths, entries))
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                  cache_batch_idx=index, causal=causal, softcap=5.0,
                                                  return_softmax_lse=True)
    check_against_reference(out, lse, q, k_cache, v_cache, [n + 1 for n in lengths], entries, dtype, causal=causal,
                            softcap=5.0)


def test_the_append_op_has_a_fake():
    meta = dict(device="meta", dtype=torch.float16)
    cache, rows = torch.empty(3, 16, 2, 64, **meta), torch.empty(2, 1, 2, 64, **meta)
    seqlens = torch.empty(2, dtype=torch.int32, device="meta")
    pages = torch.empty(2, 4, dtype=torch.int32, device="meta")
    assert torch.ops.cute_flash.kvcache_append(cache, cache, rows, rows, seqlens, pages) is None
    value_cache, value_rows = torch.empty(3, 16, 2, 48, **meta), torch.empty(2, 1, 2, 48, **meta)
    assert torch.ops.cute_flash.kvcache_append(cache, value_cache, rows, value_rows, seqlens, pages) is None


def test_the_merge_holds_every_split_count_the_host_asks_for():
    pytest.importorskip("cutlass")
    from cute_flash.kernels import split_merge
    from cute_flash.kvcache import MAX_SPLITS, decode_splits

    assert split_merge.MAX_SPLITS == MAX_SPLITS  # the merge's shared-memory row of weights
    assert decode_splits(10 ** 6, 1, 1 << 20, torch.device("cpu")) == MAX_SPLITS


@pytest.mark.parametrize("units, cache_len, captured, splits", [
    (8, 4096, True, 16),  # B = 1, 8 key/value heads, captured: fill the SMs (132 // 8)
    (8, 4096, False, 1),  # ... eager below SPLIT_MIN_CACHE: the host time of a split costs more
    (8, 1 << 17, False, 16),
    (64, 1 << 15, False, 2),  # half a wave of units, long caches: parts that fill the SMs once
    (64, 1 << 17, True, 2),
    (64, 1 << 14, False, 1),  # ... parts below WIDE_SPLIT_MIN_KEYS
    (40, 1 << 17, False, 3),
    (67, 1 << 17, False, 1),  # more than half a wave: one part already fills the SMs
    (132, 1 << 17, False, 1),
])
def test_automatic_split_counts(monkeypatch, units, cache_len, captured, splits):
    from cute_flash import kvcache, torch_helpers

    monkeypatch.setattr(torch_helpers, "device_traits", lambda device: ("sm_90a", 132))
    assert kvcache.decode_splits(0, units, cache_len, torch.device("cpu"), captured) == splits


def test_the_split_ops_have_fakes():
    """Traced split steps: the forward's parts (B * splits entries) and the merge's outputs."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    # 3 sequences, 2 key/value heads, a group of 4 at 2 positions as 8 rows (grouped rows).
    queries, keys = torch.empty(3, 2, 8, 128, **meta), torch.empty(96, 2, 128, **meta)
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = torch.ops.cute_flash.kvcache_attention(queries, keys, keys, offsets, offsets[:3], None, 32, 0, True,
                                                      0.1, -1, -1, 0.0, None, 5, 2)
    assert out.shape == (15, 2, 8, 128) and lse.shape == (15, 8, 2) and lse.dtype == torch.float32
    merged, merged_lse = torch.ops.cute_flash.kvcache_merge_splits(out, lse, 3)
    assert merged.shape == (3, 2, 8, 128) and merged_lse.shape == (3, 8, 2)
    out, lse = torch.ops.cute_flash.kvcache_attention(queries, keys, keys, offsets, offsets[:3], None, 32, 0, False,
                                                      0.1, -1, -1, 0.0, None)
    assert out.shape == (3, 2, 8, 128) and lse.shape == (3, 2, 8)
    # Values of a head dim of their own: O (and the merged O) at theirs.
    values = torch.empty(96, 2, 64, **meta)
    out, lse = torch.ops.cute_flash.kvcache_attention(queries, keys, values, offsets, offsets[:3], None, 32, 0, True,
                                                      0.1, -1, -1, 0.0, None, 5, 2)
    assert out.shape == (15, 2, 8, 64)
    merged, _ = torch.ops.cute_flash.kvcache_merge_splits(out, lse, 3)
    assert merged.shape == (3, 2, 8, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [2, 8])  # grouped, and one query head per key/value head
def test_split_kv_merges_to_the_reference_and_is_deterministic(kv_heads):
    from cute_flash.kvcache import SPLIT_MIN_CACHE, decode_splits

    dtype, cache_len = BF16, 8192
    q, k_cache, v_cache, _, _ = cache_inputs(3, 1, 8, kv_heads, 128, 3, cache_len, dtype)
    lengths = [8192, 0, 2049]  # 64 key blocks; none (every part empty); 17 blocks, the last with one key
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    assert decode_splits(0, 3 * kv_heads, 1 << 17, q.device) > 1  # few units, a long cache: split automatically
    assert decode_splits(0, 3 * kv_heads, SPLIT_MIN_CACHE // 2, q.device) == 1  # a short one: the merge costs more
    assert decode_splits(0, 132, 1 << 17, q.device) == 1  # enough units
    results = {}
    for splits in (1, 3, 4):
        out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                      num_splits=splits, return_softmax_lse=True)
        check_against_reference(out, lse, q, k_cache, v_cache, lengths, [0, 1, 2], dtype, causal=True)
        again = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                   num_splits=splits, return_softmax_lse=True)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
        results[splits] = out
    assert not torch.equal(results[1], results[4])  # the split path really ran (merged in another order)


def eager_and_compiled_steps(q, k_cache, v_cache, k, v, seqlens, table=None):
    """The same appending causal step on two copies of a cache, eager and under torch.compile
    (fullgraph: the ops path): (eager out, compiled out, [eager's caches, compiled's caches])."""
    torch._dynamo.reset()
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]

    def step(kc, vc):
        return cute_flash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                  causal=True)

    eager = step(*caches[0])
    return eager, torch.compile(step, fullgraph=True)(*caches[1]), caches


@pytest.mark.gpu
@pytest.mark.parametrize("value_dim", [None, 96], ids=["dv-eq-d", "dv-96"])
def test_compiled_decode_steps_equal_eager_ones(value_dim):
    """Under torch.compile the calls go through the ops (cute_flash::kvcache_append with its
    mutation, the packed forward): the same cache and output as eager calls, bitwise (also
    with v of a head dim of its own: the ops' fakes give O that width)."""
    q, k_cache, v_cache, k, v = cache_inputs(4, 1, 8, 2, 128, 4, 256, BF16, new=1, value_head_dim=value_dim)
    seqlens = torch.tensor([0, 5, 100, 254], dtype=torch.int32, device="cuda")
    eager, compiled, caches = eager_and_compiled_steps(q, k_cache, v_cache, k, v, seqlens)
    assert torch.equal(compiled, eager)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert not torch.equal(caches[0][0], k_cache)  # the appends happened


@pytest.mark.gpu
@pytest.mark.parametrize("new, page_size", [(1, 0), (3, 0), (3, 16)], ids=["decode", "chunk", "paged-chunk"])
def test_compiled_float32_steps_equal_eager_ones(new, page_size):
    """A float32 step traced by torch.compile gathers the slots in use (kvcache._float32_step)
    where the eager one reads the cache in place with maxima over those slots: the same
    cache, and the same output to float32's rounding; free slots hold NaN."""
    q, k_cache, v_cache, k, v = cache_inputs(4, new, 8, 2, 128, 4, 256, FP32, new=new)
    lengths = [0, 5, 100, 256 - new]
    for b, n in enumerate(lengths):
        k_cache[b, n + new:], v_cache[b, n + new:] = float("nan"), float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    table = None
    if page_size:
        k_cache, v_cache, table = paged_caches(k_cache, v_cache, page_size, 3, seed=4)
    eager, compiled, caches = eager_and_compiled_steps(q, k_cache, v_cache, k, v, seqlens, table)
    assert torch.isfinite(eager).all() and rel_err(compiled, eager.double()) < 1e-6
    for got, want in zip(caches[1], caches[0]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    if page_size:
        order = table.long().flatten()  # sequence b's pages in order: its contiguous cache
        caches[0] = tuple(c[order].view(4, 256, *c.shape[2:]) for c in caches[0])
    want, _ = reference(q, *caches[0], [n + new for n in lengths], range(4), causal=True)
    assert rel_err(eager, want) < TOLERANCE[FP32]


def paged_cache(contiguous, page_size, spare_pages, seed):
    """The contiguous cache (B, S_max, Nkv, D) cut into pages of page_size rows, scattered in
    a random order (drawn from `seed`) among spare_pages more (random rows: what no sequence
    owns); returns (pages (num_pages, page_size, Nkv, D), block_table (B, S_max / page_size)
    int32)."""
    generator = torch.Generator().manual_seed(seed)
    batch, cache_len = contiguous.shape[:2]
    per_sequence = cache_len // page_size
    num_pages = batch * per_sequence + spare_pages
    order = torch.randperm(num_pages, generator=generator)[:batch * per_sequence].to(contiguous.device)
    pages = torch.randn(num_pages, page_size, *contiguous.shape[2:], generator=generator).to(contiguous)
    pages[order] = contiguous.reshape(batch * per_sequence, page_size, *contiguous.shape[2:])
    return pages, order.view(batch, per_sequence).to(torch.int32)


def paged_caches(k_cache, v_cache, page_size, spare_pages, seed):
    """paged_cache of k and v with one page order: (k_pages, v_pages, block_table)."""
    (k_pages, table), (v_pages, _) = (paged_cache(c, page_size, spare_pages, seed) for c in (k_cache, v_cache))
    return k_pages, v_pages, table


# (page size, dtype, head dim, key/value heads of 8, Sq = new rows, variant): each page size
# against a block_n of 128 (several pages per key block, one page of three boxes, half a block,
# one block, two blocks); every native head dim and a padded one; MQA, GQA and MHA; appends
# of 1 to 16 rows; a window with softcap and a sink.
PAGED_CASES = [
    (16, BF16, 128, 2, 1, dict(causal=True)),
    (48, FP16, 64, 2, 5, dict(causal=True)),
    (64, BF16, 128, 2, 3, dict()),
    (128, FP16, 64, 8, 1, dict(causal=True)),
    (256, BF16, 128, 2, 5, dict(causal=True)),
    (16, FP16, 16, 1, 16, dict(causal=True)),
    (32, BF16, 32, 8, 1, dict(causal=True)),
    (64, FP16, 96, 4, 2, dict(causal=True)),
    (64, BF16, 192, 1, 8, dict(causal=True)),
    (128, FP16, 256, 2, 1, dict(causal=True)),
    (24, BF16, 40, 2, 4, dict(causal=True)),
    (48, BF16, 128, 2, 4, dict(causal=True, window_size=(100, 0), softcap=10.0, sink=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, dtype, head_dim, kv_heads, new, variant", PAGED_CASES)
def test_a_paged_cache_equals_the_contiguous_one(page_size, dtype, head_dim, kv_heads, new, variant):
    """Appends into pages (every other page untouched) and attention through the block table:
    the same bits as the contiguous cache holding the same rows (the kernels read the same
    keys in the same blocks), and the reference."""
    cache_len = 768
    q, k_cache, v_cache, k, v = cache_inputs(4, new, 8, kv_heads, head_dim, 4, cache_len, dtype, new=new)
    k_pages, v_pages, table = paged_caches(k_cache, v_cache, page_size, 5, seed=1)
    lengths = [0, 1, 500, cache_len - new]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    variant = dict(variant)
    sink = torch.randn(8, device="cuda") if variant.pop("sink", False) else None
    want, want_lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                        learnable_sink=sink, return_softmax_lse=True, **variant)
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens, block_table=table,
                                                  learnable_sink=sink, return_softmax_lse=True, **variant)
    # The appends landed where the contiguous ones did, and no other page changed.
    for pages, cache in ((k_pages, k_cache), (v_pages, v_cache)):
        expect = paged_cache(cache, page_size, 5, seed=1)[0]
        assert torch.equal(pages, expect)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    check_against_reference(out, lse, q, k_cache, v_cache, [n + new for n in lengths], range(4), dtype, sink=sink,
                            **variant)


# Each route of a step over a cache whose slots past the lengths hold NaN (stale or never
# written memory: a real cache's free slots): (dtype, Sq = new rows, heads, kv heads, page size,
# num_splits).
STALE_SLOT_CASES = [
    (BF16, 1, 8, 2, 0, 1),  # the decode step
    (BF16, 1, 8, 2, 64, 4),  # split decode over pages
    (FP16, 4, 8, 2, 16, 1),  # grouped rows over pages
    (BF16, 33, 8, 8, 0, 1),  # the dense queries
    (FP32, 1, 8, 2, 0, 1),  # float32: the gathered slots in use
    (FP32, 5, 8, 2, 16, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, new, heads, kv_heads, page_size, splits", STALE_SLOT_CASES)
def test_slots_past_the_lengths_are_never_read(dtype, new, heads, kv_heads, page_size, splits):
    """A cache's slots past cache_seqlens + the new rows hold NaN: the output is the
    reference's over the slots in use (a masked key's P is 0, but 0 x NaN is NaN: its row must
    not reach P V)."""
    cache_len = 512
    q, k_cache, v_cache, k, v = cache_inputs(4, new, heads, kv_heads, 128, 4, cache_len, dtype, new=new)
    lengths = [0, 1, 200, cache_len - new - 3]
    for b, n in enumerate(lengths):
        k_cache[b, n + new:] = float("nan")
        v_cache[b, n + new:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    table = None
    kc, vc = k_cache.clone(), v_cache.clone()
    if page_size:
        kc, vc, table = paged_caches(kc, vc, page_size, 3, seed=2)
    out, lse = cute_flash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                  causal=True, num_splits=splits, return_softmax_lse=True)
    for b, n in enumerate(lengths):
        k_cache[b, n:n + new], v_cache[b, n:n + new] = k[b], v[b]
    check_against_reference(out, lse, q, k_cache, v_cache, [n + new for n in lengths], range(4), dtype, causal=True)


# float32 caches (kvcache._float32_step): (D, Dv, Sq = new rows, heads, kv heads, page size,
# variant): contiguous (cache_batch_idx) and paged, decode and prefill chunks, MQA / GQA / MHA,
# head dims from 16 to 256 and a value head dim of its own, windows, softcap and sinks.
FLOAT32_CASES = [
    (128, 128, 1, 8, 2, 0, dict(causal=True)),
    (64, 64, 5, 8, 8, 16, dict(causal=True)),
    (256, 256, 1, 4, 1, 64, dict()),
    (192, 128, 33, 8, 2, 0, dict(causal=True)),
    (40, 40, 3, 6, 2, 48, dict(causal=True, window_size=(100, 0), softcap=10.0, sink=True)),
    (16, 16, 16, 4, 4, 0, dict(causal=True, sink=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, value_dim, new, heads, kv_heads, page_size, variant", FLOAT32_CASES)
def test_float32_caches(head_dim, value_dim, new, heads, kv_heads, page_size, variant):
    """Appends into a float32 cache (every other slot untouched) and attention against the
    float64 reference at float32 accuracy, contiguous (through cache_batch_idx) or paged; the
    slots past the lengths hold NaN."""
    cache_len, entries = 576, [2, 0, 3, 1]  # (a multiple of every page size below)
    q, k_cache, v_cache, k, v = cache_inputs(4, new, heads, kv_heads, head_dim, 4, cache_len, FP32, new=new,
                                             value_head_dim=value_dim)
    lengths = [0, 1, 300, cache_len - new]
    for b, n in zip(entries, lengths):
        k_cache[b, n + new:] = float("nan")
        v_cache[b, n + new:] = float("nan")
    variant = dict(variant)
    sink = torch.randn(heads, device="cuda") if variant.pop("sink", False) else None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    index = torch.tensor(entries, dtype=torch.int32, device="cuda")
    expect = [c.clone() for c in (k_cache, v_cache)]
    for b, (n, e) in enumerate(zip(lengths, entries)):
        expect[0][e, n:n + new], expect[1][e, n:n + new] = k[b], v[b]
    if page_size:
        ordered = [c[index.long()] for c in (k_cache, v_cache)]  # sequence b's entry as page run b
        kc, vc, table = paged_caches(*ordered, page_size, 3, seed=3)
        want_pages = [paged_cache(c[index.long()], page_size, 3, seed=3)[0] for c in expect]
        out, lse = cute_flash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                      learnable_sink=sink, return_softmax_lse=True, **variant)
        for got, want in zip((kc, vc), want_pages):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    else:
        out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                      cache_batch_idx=index, learnable_sink=sink,
                                                      return_softmax_lse=True, **variant)
        for got, want in zip((k_cache, v_cache), expect):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert out.dtype == FP32 and out.shape == (4, new, heads, value_dim) and lse.shape == (4, heads, new)
    check_against_reference(out, lse, q, *expect, [n + new for n in lengths], entries, FP32, sink=sink, **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_split_counts_from_2_to_16(paged):
    """Every split count merges to the reference; a count above a sequence's key blocks leaves
    parts without keys (they weigh nothing)."""
    dtype, cache_len = FP16, 4096
    q, k_cache, v_cache, _, _ = cache_inputs(4, 1, 16, 4, 64, 4, cache_len, dtype)
    lengths = [4096, 1, 0, 3000]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    caches, table = (k_cache, v_cache), None
    if paged:
        *caches, table = paged_caches(*caches, 64, 2, seed=5)
    for splits in (2, 5, 7, 16):
        out, lse = cute_flash.flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens, block_table=table,
                                                      num_splits=splits, return_softmax_lse=True)
        check_against_reference(out, lse, q, k_cache, v_cache, lengths, range(4), dtype)


# (dtype, head dim, page size): key blocks of 80 rows in pages of 128 (boxes of 16), a head dim
# the general path pads (36 -> 40 by copies, on the tile of 64), blocks of 64 at D = 192.
SPLIT_HEAD_DIMS = [(FP16, 256, 128), (BF16, 36, 0), (BF16, 192, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, page_size", SPLIT_HEAD_DIMS)
def test_split_kv_over_other_head_dims(dtype, head_dim, page_size):
    """Split parts over other key-block sizes, a paged cache and a padded head dim: the
    reference, and the same bits as the unsplit step would not give (a real split ran)."""
    cache_len = 2048
    q, k_cache, v_cache, _, _ = cache_inputs(3, 1, 8, 2, head_dim, 3, cache_len, dtype)
    lengths = [2048, 1001, 17]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    caches, table = (k_cache, v_cache), None
    if page_size:
        *caches, table = paged_caches(*caches, page_size, 1, seed=7)
    results = {}
    for splits in (1, 6):
        out, lse = cute_flash.flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens, block_table=table,
                                                      num_splits=splits, return_softmax_lse=True)
        check_against_reference(out, lse, q, k_cache, v_cache, lengths, range(3), dtype)
        results[splits] = out
    assert not torch.equal(results[1], results[6])


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, heads, kv_heads, page_size, variant", [
    (2, 8, 2, 0, dict(causal=True)),
    (5, 8, 1, 16, dict(causal=True)),
    (16, 8, 4, 64, dict(causal=True, window_size=(300, 0), softcap=20.0)),
    (3, 8, 2, 0, dict()),
    (1, 8, 2, 256, dict(causal=True, window_size=(700, 0))),
    (9, 32, 1, 0, dict(causal=True)),  # 288 rows: three tiles of 128, each holding every position
])
def test_grouped_rows_over_a_cache(seqlen_q, heads, kv_heads, page_size, variant):
    """Steps of a few positions with grouped heads (problem.grouped_rows: a group's query heads
    at each position as one tile's rows), whole and split in 1-7 parts, contiguous and paged,
    against the reference; split results deterministic."""
    dtype, cache_len = BF16, 3072
    q, k_cache, v_cache, k, v = cache_inputs(3, seqlen_q, heads, kv_heads, 128, 3, cache_len, dtype, new=seqlen_q)
    lengths = [3072 - seqlen_q, 1000, 0]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    caches, table = (k_cache.clone(), v_cache.clone()), None
    if page_size:
        *caches, table = paged_caches(*caches, page_size, 1, seed=8)
    for b, n in enumerate(lengths):  # the reference's cache, appended by hand
        k_cache[b, n:n + seqlen_q], v_cache[b, n:n + seqlen_q] = k[b], v[b]

    def step(splits):
        return cute_flash.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens, block_table=table,
                                                  num_splits=splits, return_softmax_lse=True, **variant)

    for splits in (1, 4, 7):
        (out, lse), (again, again_lse) = step(splits), step(splits)
        assert torch.equal(out, again) and torch.equal(lse, again_lse)
        check_against_reference(out, lse, q, k_cache, v_cache, [n + seqlen_q for n in lengths], range(3), dtype,
                                **variant)


# (Sq, query heads, key/value heads, page size, variant): sinks on the grouped-rows route, a
# decode step (which otherwise packs without sinks), a window with softcap, MHA (rows of one
# query head each), MQA in pages of 16.
SINK_CASES = [
    (1, 8, 2, 0, dict(causal=True)),
    (4, 8, 2, 64, dict(causal=True, window_size=(300, 0), softcap=20.0)),
    (1, 8, 8, 0, dict(causal=True)),
    (3, 8, 1, 16, dict()),
]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, heads, kv_heads, page_size, variant", SINK_CASES)
def test_sinks_with_grouped_rows_and_split_keys(seqlen_q, heads, kv_heads, page_size, variant):
    """A sink per query head on steps of a few positions: each grouped row takes its query
    head's sink, and split parts leave it to the merge, which adds it once; whole and split in
    3 or 7 parts (a part without keys weighs nothing), through the general path and the eager
    plan (same bits), deterministic, against the reference."""
    from cute_flash import kvcache, kvcache_plan

    dtype, cache_len = BF16, 3072
    q, k_cache, v_cache, k, v = cache_inputs(3, seqlen_q, heads, kv_heads, 128, 3, cache_len, dtype, new=seqlen_q)
    sink = torch.randn(heads, device="cuda") * 3
    lengths = [3072 - seqlen_q, 1000, 0]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    assert kvcache.step_route(q.shape, kv_heads, cache_len, variant.get("window_size", (-1, -1)), sink, 1,
                              q.device, False).grouped
    caches, table = (k_cache.clone(), v_cache.clone()), None
    if page_size:
        *caches, table = paged_caches(*caches, page_size, 1, seed=9)
    for b, n in enumerate(lengths):  # the reference's cache, appended by hand
        k_cache[b, n:n + seqlen_q], v_cache[b, n:n + seqlen_q] = k[b], v[b]

    def step(splits, **kwargs):
        return cute_flash.flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens + seqlen_q, block_table=table,
                                                  learnable_sink=sink, num_splits=splits, return_softmax_lse=True,
                                                  **variant, **kwargs)

    cute_flash.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens, block_table=table)  # the appends
    for splits in (1, 3, 7):
        kvcache_plan._plans.clear()
        (out, lse), (planned, planned_lse) = step(splits, validate=True), step(splits)
        assert torch.equal(out, planned) and torch.equal(lse, planned_lse)
        check_against_reference(out, lse, q, k_cache, v_cache, [n + seqlen_q for n in lengths], range(3), dtype,
                                sink=sink, **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_split_kv_merges_to_the_reference_and_is_deterministic(page_size):
    dtype, cache_len = BF16, 8192
    q, k_cache, v_cache, _, _ = cache_inputs(3, 1, 8, 2, 128, 3, cache_len, dtype)
    k_pages, v_pages, table = paged_caches(k_cache, v_cache, page_size, 3, seed=2)
    lengths = [8192, 0, 2049]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for splits in (1, 3, 5):
        out, lse = cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                                      causal=True, num_splits=splits, return_softmax_lse=True)
        check_against_reference(out, lse, q, k_cache, v_cache, lengths, [0, 1, 2], dtype, causal=True)
        again = cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                                   causal=True, num_splits=splits, return_softmax_lse=True)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.gpu
def test_page_tables_that_break_the_contract_write_no_other_slot():
    """Page numbers outside the cache, slots past a sequence's pages: those rows are skipped,
    nothing else is written, and the attention stays inside the cache (sanitizer:
    perf/sanitize.py --only kvcache)."""
    dtype, page_size = FP16, 16
    q, _, _, k, v = cache_inputs(4, 3, 4, 4, 64, 1, 16, dtype, new=3)
    k_pages, v_pages = (torch.randn(6, page_size, 4, 64, dtype=dtype, device="cuda") for _ in range(2))
    before = (k_pages.clone(), v_pages.clone())
    table = torch.tensor([[0, 1], [2, 99], [-3, 3], [4, 5]], dtype=torch.int32, device="cuda")
    lengths = [30, 15, 10, 40]  # 30 + 3 rows overflow 2 pages; 40 starts past them
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="outside the cache's 6 pages"):
        cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens.clamp(max=20),
                                           block_table=table, validate=True)
    assert torch.equal(k_pages, before[0]) and torch.equal(v_pages, before[1])
    out = cute_flash.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens, block_table=table)
    torch.cuda.synchronize()
    expect = [c.clone() for c in before]
    for b, n in enumerate(lengths):
        for i in range(3):
            slot = n + i
            if slot // page_size < 2:
                page = table[b, slot // page_size].item()
                if 0 <= page < 6:
                    expect[0][page, slot % page_size] = k[b, i]
                    expect[1][page, slot % page_size] = v[b, i]
    assert torch.equal(k_pages, expect[0]) and torch.equal(v_pages, expect[1])
    assert out.shape == q.shape


@pytest.mark.gpu
def test_compiled_paged_decode_steps_equal_eager_ones():
    q, k_cache, v_cache, k, v = cache_inputs(4, 1, 8, 2, 128, 4, 256, BF16, new=1)
    k_pages, v_pages, table = paged_caches(k_cache, v_cache, 64, 2, seed=3)
    seqlens = torch.tensor([0, 5, 100, 254], dtype=torch.int32, device="cuda")
    eager, compiled, caches = eager_and_compiled_steps(q, k_pages, v_pages, k, v, seqlens, table)
    assert torch.equal(compiled, eager)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert not torch.equal(caches[0][0], k_pages)


@pytest.mark.gpu
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(hd=st.integers(0, 1), page_size=st.sampled_from([0, 16, 64, 256]), kv_heads=st.sampled_from([1, 2, 8]),
       seqlen_q=st.sampled_from([1, 2, 5, 16]), append=st.booleans(), causal=st.booleans(),
       splits=st.sampled_from([0, 1, 3]), lengths=st.lists(st.integers(0, 768), min_size=1, max_size=6))
def test_fuzz_caches(hd, page_size, kv_heads, seqlen_q, append, causal, splits, lengths):
    """Random batches over contiguous and paged caches: lengths (empty and full caches),
    appends, GQA / MQA / MHA, decode steps and longer Sq, split counts, against float64."""
    dtype, head_dim = [(BF16, 128), (FP16, 64)][hd]
    cache_len, batch = 768, len(lengths)
    new = seqlen_q if append else 0
    lengths = [min(n, cache_len - new) for n in lengths]
    q, k_cache, v_cache, k, v = cache_inputs(batch, seqlen_q, 8, kv_heads, head_dim, batch, cache_len, dtype,
                                             new=new)
    caches, table = (k_cache.clone(), v_cache.clone()), None
    if page_size:
        *caches, table = paged_caches(*caches, page_size, 1, seed=6)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens, block_table=table,
                                                  causal=causal, num_splits=splits, return_softmax_lse=True)
    for b, n in enumerate(lengths):  # the reference's cache, appended by hand
        if new:
            k_cache[b, n:n + new], v_cache[b, n:n + new] = k[b], v[b]
    check_against_reference(out, lse, q, k_cache, v_cache, [n + new for n in lengths], range(batch), dtype,
                            causal=causal)


def prewarm():
    """Compile the GPU cases' forward kernels in parallel (python tests/test_kvcache.py --prewarm)."""
    from parallel_compile import compile_in_parallel

    jobs = [(dtype, head_dim, dict(causal=causal, grouped=grouped, page_size=page))
            for dtype, head_dim in ((BF16, 128), (FP16, 64)) for causal in (False, True)
            for grouped in (False, True) for page in (0, 16, 64, 256)]
    jobs += [(dtype, head_dim, dict(grouped=False, softcap=5.0)) for dtype, head_dim in ((BF16, 128), (FP16, 64))]
    jobs += [(FP16, 72, dict(causal=True, grouped=True))]
    # A group's query heads at each position as rows (grouped rows), whole or in split parts;
    # the split decode step is the non-causal one.
    jobs += [(dtype, head_dim, dict(causal=causal, grouped_rows=True, split_keys=split, page_size=page))
             for dtype, head_dim in ((BF16, 128), (FP16, 64)) for causal in (False, True) for split in (False, True)
             for page in (0, 16, 64, 256)]
    jobs += [(dtype, head_dim, dict(grouped_rows=True, split_keys=True, page_size=page))
             for dtype, head_dim, page in SPLIT_HEAD_DIMS]
    jobs += [(BF16, 128, dict(variant, grouped_rows=True, split_keys=split, page_size=page, sink=True))
             for _, _, _, page, variant in SINK_CASES for split in (False, True)]
    for page_size, dtype, head_dim, kv_heads, new, variant in PAGED_CASES:
        variant = dict(variant)
        if new == 1 and "window_size" not in variant:  # a decode step: a group's rows, no mask
            variant = dict(causal=False, grouped=False)
        elif kv_heads != 8 or variant.get("sink"):  # a group's heads at each position as rows
            variant["grouped_rows"] = True
        else:
            variant["grouped"] = kv_heads != 8
        for page in (page_size, 0):
            jobs.append((dtype, head_dim, dict(variant, page_size=page)))
    jobs = list({repr(job): job for job in jobs}.values())
    compile_in_parallel(jobs, _compile)


def _compile(job):
    import time

    from cute_flash import launch_fwd
    from cute_flash.head_dims import aligned_head_dim
    from cute_flash.kernels.problem import AttentionProblem

    dtype, head_dim, variant = job
    start = time.time()
    problem = AttentionProblem.of(alignment="bottom_right", keys_used=True, cached_keys=True, **variant)
    launch_fwd.kernel_for(dtype, aligned_head_dim(head_dim), problem, torch.device("cuda"), (8, 8192))
    return time.time() - start


if __name__ == "__main__" and "--prewarm" in sys.argv:
    prewarm()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["decode", "decode-split", "decode-entries", "paged-split", "prefill-append",
                                  "int-length-lse", "grouped-append", "grouped-split", "grouped-window"])
def test_the_eager_plan_equals_the_general_path(case):
    """Eager calls run a plan per call signature (cute_flash.kvcache_plan: strided views, no
    checks after the first call); validate=True takes the general path. Same bits, caches
    included."""
    from cute_flash import kvcache_plan

    dtype, cache_len = BF16, 4096
    # (A prefill of more positions than grouped rows take: those run the general path.)
    seqlen_q, new = {"prefill-append": (20, 20), "int-length-lse": (1, 0), "grouped-append": (4, 4),
                     "grouped-split": (3, 3), "grouped-window": (1, 1)}.get(case, (1, 1))
    q, k_cache, v_cache, k, v = cache_inputs(3, seqlen_q, 16, 4, 128, 4, cache_len, dtype, new=new)
    lengths = torch.tensor([0, 3000, cache_len - 20], dtype=torch.int32, device="cuda")
    # num_splits=1: grouped rows without split at this small batch (auto would run one query
    # head per CTA below kvcache.PACKED_STEP_MIN_UNITS units).
    kwargs = dict(causal=True, return_softmax_lse=True, k=k, v=v, cache_seqlens=lengths, num_splits=1)
    if case in ("decode-split", "grouped-split"):
        kwargs["num_splits"] = 3
    if case == "grouped-window":  # one position with a window: grouped rows, masked
        kwargs["window_size"] = (500, 0)
    if case == "decode-entries":
        kwargs["cache_batch_idx"] = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")
    if case == "int-length-lse":
        kwargs.update(cache_seqlens=1000, k=None, v=None)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    if case == "paged-split":
        paged = [paged_caches(kc, vc, 64, 3, seed=4) for kc, vc in caches]
        caches = [(k_pages, v_pages) for k_pages, v_pages, _ in paged]
        table = paged[0][2][:3]  # entry 3: no sequence's
        kwargs.update(block_table=table, num_splits=4)
    kvcache_plan._plans.clear()
    general = cute_flash.flash_attn_with_kvcache(q, *caches[0], validate=True, **kwargs)
    planned = cute_flash.flash_attn_with_kvcache(q, *caches[1], **kwargs)
    assert any(plan is not None for plan in kvcache_plan._plans.values()), "the call did not take the plan"
    assert torch.equal(general[0], planned[0]) and torch.equal(general[1], planned[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    # Without appends, twice: the second call is a known signature's plan.
    reads = [cute_flash.flash_attn_with_kvcache(q, *caches[1], **{**kwargs, "k": None, "v": None}) for _ in range(2)]
    assert torch.equal(reads[0][0], reads[1][0]) and torch.equal(reads[0][1], reads[1][1])


@pytest.mark.gpu
def test_a_captured_decode_step_replays_as_the_eager_one():
    """A decode step captured into a CUDA graph (the serving loop's way to drop host time)
    replays with the graph's own constants: it splits the keys as an eager call with the same
    split count does (kvcache.decode_splits under capture), bitwise, and the eager plans made
    before and after the capture stay right."""
    from cute_flash.kvcache import decode_splits

    dtype = BF16
    q, k_cache, v_cache, k, v = cache_inputs(1, 1, 16, 4, 128, 1, 4096, dtype, new=1)
    seqlens = torch.tensor([3000], dtype=torch.int32, device="cuda")
    splits = decode_splits(0, 4, 4096, q.device, captured=True)
    assert splits > 1 and decode_splits(0, 4, 4096, q.device) == 1
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]

    def step(kc, vc, **kwargs):
        return cute_flash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                                  return_softmax_lse=True, **kwargs)

    eager_before = step(*caches[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*caches[1])  # warm-up: the eager plan
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*caches[1])
    # The graph reads the offsets the warm-up made (kvcache._constant): they outlive the
    # constants cache's eviction and whatever reuses freed memory.
    from cute_flash import kvcache, kvcache_plan

    kvcache._constants.clear()
    kvcache_plan._plans.clear()
    torch.cuda.empty_cache()
    scratch = torch.full((1 << 20,), -7, dtype=torch.int32, device="cuda")
    graph.replay()
    want = step(*caches[0], num_splits=splits)
    assert torch.equal(captured[0], want[0]) and torch.equal(captured[1], want[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(step(*caches[0])[0], eager_before[0])  # the eager plan after the capture
    del scratch
