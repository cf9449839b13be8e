"""Attention over a KV cache (inference): flash-attn's `flash_attn_with_kvcache`.

q (B, Sq, N, D) attends to a contiguous cache k_cache, v_cache (B_cache, S_max, Nkv, D):
sequence b reads cache entry cache_batch_idx[b] (default b), its first cache_seqlens[b] slots.
Or to a paged cache (num_pages, page_size, Nkv, D) with block_table (B, max_pages) int32:
sequence b's slot j lies in page block_table[b, j // page_size], row j % page_size (vLLM's
layout). A contiguous cache is the paged case with one page of S_max slots per entry, which is
how the append kernel sees both (the table: cache_batch_idx as a column). v_cache (and v, and
the output) may have a head dim Dv of their own (DeepSeek's (192, 128)).
With k and v (B, Sq_new, Nkv, D) given, their rows are first written into the cache in place at
slots cache_seqlens[b] ... + Sq_new - 1 (kernels/cache_append.py), and attention reads
cache_seqlens[b] + Sq_new slots. Causal masks and windows are aligned bottom-right (the
queries are the last Sq positions), as flash-attn aligns them.

The attention runs the forward kernel with the queries as a dense batch and the keys from the
cache (problem.cached_keys, kernels/sequences.py): the cache is one packed key tensor
(B_cache * S_max, Nkv, D), sequence b's keys start at cache_batch_idx[b] * S_max, and
seqused_k gives its length: no copy of the cache or of q, no host sync. A paged cache's pages are
one packed key tensor (num_pages * page_size, Nkv, D) that the forward reads through the block
table (kernels/key_pages.py: TMA boxes of gcd(page_size, block_n) rows, each inside a page).

The cache is the caller's data. What the host knows is checked before anything is written
(shapes, dtypes, devices, an int cache_seqlens against the slots a sequence has). Values in
device tensors (cache_seqlens, cache_batch_idx, block_table) are the caller's contract:
cache_seqlens[b] + Sq_new <= S_max (paged: max_pages * page_size), 0 <= cache_batch_idx[b] <
B_cache, distinct entries when appending, and a paged sequence's pages in use within the
cache and not written by another sequence. validate=True (or CUTE_FLASH_VALIDATE=1) checks
them first, at the cost of a device sync. Without it, a new row whose slot falls outside the
cache (or outside the sequence's pages) is not written (nor anything else), and attention
reads stay inside the cache (results for such sequences are wrong, never out of bounds).

A decode step (Sq = 1, no window, no sink) packs each group's query heads into one sequence's
rows, and so does a step of up to GROUPED_ROWS_MAX_SQ positions with grouped heads, or with a
sink (problem.grouped_rows: each row takes its query head's sink); both split long caches
across CTAs when there are few (sequence, key/value head) units (split-KV inside the forward,
problem.split_keys, the sink added by the merge; num_splits; _decode_step, _grouped_step).

Slots past a sequence's length never reach its output, whatever they hold: the kernel masks
their scores and zeroes their V rows in the one key block that reaches them (kernels/fwd_sm90.py).
float32 caches take the packed float32 forward instead (_float32_step).

Not yet: grouped rows and split-KV beyond GROUPED_ROWS_MAX_SQ positions, split-KV for float32
caches, gradients (inference only).
"""

import numbers
import warnings
from functools import partial
from typing import NamedTuple

import torch

from cute_flash import compat, kvcache_plan
from cute_flash.head_dims import with_aligned_rows
from cute_flash.validation import (
    DENSE_DTYPES,
    SUPPORTED_HEAD_DIMS,
    check_int32_vector,
    check_variant,
    resolve_scale,
)
from cute_flash.kernels.problem import GROUPED_ROWS_MAX_SQ, AttentionProblem
from cute_flash.varlen import _validating


def _check_tensor(name, t, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in DENSE_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def check_kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, num_splits):
    """The checks the host can make without a sync; returns the number of new rows."""
    _check_tensor("q", q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, q.device)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must have one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for the head dim, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, _, heads, head_dim = q.shape
    _, _, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache's head dim ({cache_dim}) must be q's ({head_dim})")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"the cache's {kv_heads} key/value heads must divide q's {heads} heads")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q has head dim {head_dim}; supported head dims: 1 to {SUPPORTED_HEAD_DIMS[-1]}")
    value_dim = v_cache.shape[3]
    if value_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"v_cache has head dim {value_dim}; supported head dims: 1 to {SUPPORTED_HEAD_DIMS[-1]}")
    if block_table is not None:
        _check_page_table(block_table, batch, k_cache, q.device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table: the block table names each "
                             "sequence's pages")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new rows to append) or both be None")
    new = 0
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            _check_tensor(name, t, q.device)
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
            if t.shape[0] != batch or t.shape[2:] != cache.shape[2:]:
                raise ValueError(f"{name} must have shape ({batch}, S_new, {kv_heads}, {cache.shape[3]}), "
                                 f"got {tuple(t.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have as many new rows, got {tuple(k.shape)} and {tuple(v.shape)}")
        new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("appending k and v needs cache_seqlens (where each sequence's new rows go)")
    slots = sequence_slots(k_cache, block_table)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= slots - new:
            raise ValueError(f"cache_seqlens = {cache_seqlens} with {new} new rows does not fit a sequence's "
                             f"{slots} slots")
    elif cache_seqlens is not None:
        check_int32_vector("cache_seqlens", cache_seqlens, batch, q.device)
    if cache_batch_idx is None:
        if block_table is None and batch > k_cache.shape[0]:
            raise ValueError(f"q's batch of {batch} needs cache_batch_idx: the cache has {k_cache.shape[0]} entries")
    else:
        check_int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic), got {num_splits!r}")
    return new


def _check_page_table(block_table, batch, k_cache, device):
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != batch or block_table.shape[1] == 0:
        described = (f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor)
                     else type(block_table).__name__)
        raise ValueError(f"block_table must be an int32 tensor of shape ({batch}, max_pages >= 1), got {described}")
    if block_table.device != device:
        raise ValueError(f"block_table must be on q's device ({device}), got {block_table.device}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must have a contiguous last dimension, got strides {block_table.stride()}")
    page_size = k_cache.shape[1]
    if page_size % PAGE_ROWS:
        raise ValueError(f"a paged cache's page size (k_cache.shape[1] = {page_size}) must be a multiple of "
                         f"{PAGE_ROWS}")


# A page's rows: whole 8-row atoms of the forward's swizzled K/V tiles (kernels/rules.paged_keys).
PAGE_ROWS = 8


def sequence_slots(k_cache, block_table):
    """The slots one sequence can hold: S_max, or max_pages * page_size."""
    if block_table is None:
        return k_cache.shape[1]
    return block_table.shape[1] * k_cache.shape[1]


def check_kvcache_values(seqlens, batch_idx, new, cache_batch, cache_len, block_table=None):
    """The contract on cache_seqlens, cache_batch_idx and block_table (a device sync): what
    validate=True adds. cache_len: the slots a sequence can hold (sequence_slots); block_table
    given: cache_batch is the number of pages, and batch_idx is not read."""
    lengths = seqlens.tolist()
    for b, s in enumerate(lengths):
        if not 0 <= s <= cache_len - new:
            raise ValueError(f"cache_seqlens[{b}] = {s} with {new} new rows does not fit a sequence's {cache_len} "
                             f"slots")
    if block_table is not None:
        page_size = cache_len // block_table.shape[1]
        written, cached = {}, {}  # page: the sequence writing it; page: the sequences whose cached rows it holds
        for b, (s, pages) in enumerate(zip(lengths, block_table.tolist())):
            used = -(-(s + new) // page_size)
            # Columns [0, cached_end) hold the sequence's cached rows, [first_new, used) receive new ones.
            cached_end, first_new = -(-s // page_size), s // page_size
            for column, page in enumerate(pages[:used]):
                if not 0 <= page < cache_batch:
                    raise ValueError(f"block_table[{b}, {column}] = {page} is outside the cache's {cache_batch} pages")
                if column < cached_end:
                    cached.setdefault(page, set()).add(b)
                if new and column >= first_new:
                    if written.setdefault(page, b) != b:
                        raise ValueError(f"page {page} receives new rows of sequences {written[page]} and {b}")
        # Pages shared read-only (a common prefix) are fine; one that another sequence appends to
        # would be read overwritten, and its rows lost (copy a shared page before appending to it).
        for page, b in written.items():
            readers = cached.get(page, set()) - {b}
            if readers:
                raise ValueError(f"page {page} receives new rows of sequence {b} but holds cached rows of sequence "
                                 f"{min(readers)}, which they would overwrite (copy a shared page before appending "
                                 "to it)")
        return
    entries = batch_idx.tolist()
    for b, e in enumerate(entries):
        if not 0 <= e < cache_batch:
            raise ValueError(f"cache_batch_idx[{b}] = {e} is outside the cache's {cache_batch} entries")
    if new and len(set(entries)) != len(entries):
        raise ValueError("cache_batch_idx repeats an entry: two sequences would append to the same slots")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            learnable_sink=None, num_splits=0, return_softmax_lse=False, validate=False,
                            page_table=None, pack_gqa=None):
    """flash-attn's KV-cache attention (see the module's docstring): returns out (B, Sq, N, Dv)
    and with return_softmax_lse=True the LSE (B, N, Sq) float32. cache_seqlens: an int or a
    (B,) int32 tensor (None: every slot of the cache, nothing appended). block_table (or
    flash-attn-3's name page_table): (B, max_pages) int32 for a paged cache (num_pages,
    page_size, Nkv, D). v_cache (and v) may have a head dim Dv of their own (the general path;
    the eager plans take Dv = D only). flash-attn's conventions (cute_flash.compat): everything
    after v by keyword, None window sides, 16-bit sinks, pack_gqa left to cute_flash (a decode
    step packs a group's query heads itself)."""
    window_size = compat.window(window_size)
    learnable_sink = compat.sink(learnable_sink)
    block_table = compat.block_table(block_table, page_table)
    if getattr(q, "is_cuda", False) and not torch.compiler.is_compiling() and not _validating(validate) and not (
            torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, learnable_sink))):
        # Eager calls: the plan of the call's signature (cute_flash.kvcache_plan), when the
        # kernels can read the tensors as they are.
        args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                window_size, softcap, learnable_sink, num_splits, return_softmax_lse)
        try:
            key = kvcache_plan.signature(*args)
            hash(key)
        except (AttributeError, TypeError):
            key = None  # not tensors where tensors belong: the checks below say what is wrong
        plan = kvcache_plan.plan_for(key, args) if key is not None else None
        if plan is not None:
            out, lse = plan.run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                learnable_sink)
            return (out, lse) if return_softmax_lse else out
    new = check_kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, num_splits)
    batch, seqlen_q, heads, head_dim = q.shape
    cache_batch, page_size, kv_heads, _ = k_cache.shape
    cache_len = sequence_slots(k_cache, block_table)  # the slots of one sequence
    check_variant(causal, window_size, "bottom_right", softcap, learnable_sink, heads, q.device)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, learnable_sink)):
        raise RuntimeError("flash_attn_with_kvcache computes no gradients (inference): call it under "
                           "torch.no_grad(), or use cute_flash.flash_attention_varlen for training")
    scale = resolve_scale(softmax_scale, head_dim)  # every argument is checked before the cache is written
    device = q.device
    if cache_seqlens is None:
        cache_seqlens = cache_len
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _filled(batch, int(cache_seqlens), device)
    default_entries = cache_batch_idx is None
    if default_entries and block_table is None:
        cache_batch_idx = _arange(batch, 1, device)[:batch]  # (its last entry, batch, is no sequence's)
    if _validating(validate):
        check_kvcache_values(cache_seqlens, cache_batch_idx, new, cache_batch, cache_len, block_table)
    # Eager calls launch directly: the custom ops' dispatch costs ~70-140 us of host time each
    # (perf/NOTES.md), more than a decode step's kernels; traced calls go through the ops.
    eager = not torch.compiler.is_compiling()
    if new:
        # The append kernel sees a contiguous cache as pages of S_max slots, one per entry.
        pages = block_table if block_table is not None else cache_batch_idx.unsqueeze(1)
        append = append_rows if eager else torch.ops.cute_flash.kvcache_append
        append(k_cache, v_cache, k, v, cache_seqlens, pages)
    if q.numel() == 0:
        out = q.new_zeros((*q.shape[:3], v_cache.shape[3]))
        lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=torch.float32, device=device)
        return (out, lse) if return_softmax_lse else out
    if block_table is not None:
        cu_k = _arange(batch, 0, device)  # not read: a paged sequence's keys start at its first page
    elif default_entries:
        cu_k = _arange(batch, cache_len, device)  # its last entry batch * S_max is never read
    else:
        cu_k = torch.cat((cache_batch_idx * cache_len, cache_batch_idx.new_zeros(1)))  # the last: never read
    used = (cache_seqlens + new).clamp_(0, cache_len)
    if q.dtype == torch.float32:
        out, lse = _float32_step(q, k_cache, v_cache, cu_k, cache_batch_idx, block_table, used, scale, causal,
                                 window_size, softcap, learnable_sink, eager and q.is_cuda)
        return (out, lse) if return_softmax_lse else out
    value_dim = v_cache.shape[3]
    keys, values = (_cache_rows(c, name) for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    # As flash_attention: zero columns up to a row TMA can describe (for k and v a copy of the cache).
    q, keys, values = (with_aligned_rows(t) for t in (q, keys, values))
    keys = KeyRows(keys, values, cu_k, used, cache_len, block_table, page_size if block_table is not None else 0)
    attend = partial(_attend, scale=scale, softcap=softcap, direct=eager)
    route = step_route(q.shape, kv_heads, cache_len, window_size, learnable_sink, num_splits, device,
                       eager and q.is_cuda and torch.cuda.is_current_stream_capturing())
    if route.decode and route.splits == 1:
        out, lse = _decode_step(q, kv_heads, keys, attend)
    elif route.decode or route.grouped:
        out, lse = _grouped_step(q, kv_heads, route.splits, keys, attend, causal, window_size, learnable_sink)
    else:
        # The kernel's (B, N, Sq, D) views of q and of a (B, Sq, N, Dv) output: no copies.
        out = torch.empty((*q.shape[:3], values.shape[2]), dtype=q.dtype, device=q.device)
        _, lse = attend(q.transpose(1, 2), keys, causal, window_size, learnable_sink, out=out.transpose(1, 2))
    out = out[..., :value_dim]
    return (out, lse) if return_softmax_lse else out


def _float32_step(q, k_cache, v_cache, cu_k, cache_batch_idx, block_table, used, scale, causal, window_size,
                  softcap, sink, direct):
    """A step over a float32 cache: the packed float32 forward (the scaled halves,
    cute_flash.float32), sequence b's queries as its rows, (out (B, Sq, N, Dv), lse (B, N,
    Sq)). A decode step (Sq = 1, no window, no sink) sees every key in use: a group's query
    heads become its rows, so one CTA reads a key/value head's keys once for the group.

    That forward's operand pass scales each head by the largest |x| it reads, and a cache's
    slots not in use may hold anything (stale, never written: NaN): eager steps read the
    cache in place (cu_k: each sequence's first row; or its pages through the block table)
    with those maxima taken over the slots in use only (float32.tops_over_rows_in_use, each
    entry's or page's first `lengths` slots; the kernel masks the other slots' scores and
    zeroes their values, kernels/fwd_sm90.py); traced steps gather each sequence's slots
    (cache_batch_idx: a contiguous cache's entries; or its pages) as rows of their own, read
    up to its length (flash_attention_varlen's seqused_k: the maxima over those rows, the other
    slots masked and zeroed as above). One walk of the keys per (sequence, head): num_splits
    has no effect here."""
    from cute_flash import float32, launch_fwd
    from cute_flash.head_dims import aligned_head_dim
    from cute_flash.validation import check_kernel_device
    from cute_flash.varlen import flash_attention_varlen, packed_problem

    batch, seqlen_q, heads, head_dim = q.shape
    kv_heads, value_dim = k_cache.shape[2], v_cache.shape[3]
    rows_per_sequence = seqlen_q
    if seqlen_q == 1 and tuple(window_size) == (-1, -1) and sink is None:
        rows_per_sequence = heads // kv_heads
        queries = q.view(batch, kv_heads, rows_per_sequence, head_dim).transpose(1, 2)
        queries = queries.reshape(batch * rows_per_sequence, kv_heads, head_dim)
        causal = False  # (the one query sits at the last position)
    else:
        queries = q.reshape(batch * seqlen_q, heads, head_dim)
    cu_q = _arange(batch, rows_per_sequence, q.device)
    if direct:
        keys, values = (_cache_rows(c, name) for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")))
        entries, slots = k_cache.shape[:2]  # (pages, page_size) of a paged cache
        if block_table is None:
            page_size, max_keys = 0, slots
            rows = cache_batch_idx.long().clamp(0, entries - 1)  # (clamped: a broken contract)
            lengths = used.new_zeros(entries).scatter_reduce_(0, rows, used, "amax")
        else:
            # Sequence b's page j holds used[b] - j * page_size of its slots in use (0 to page_size).
            page_size, max_keys = slots, sequence_slots(k_cache, block_table)
            starts = torch.arange(0, max_keys, page_size, dtype=used.dtype, device=q.device)
            in_page = (used.unsqueeze(1) - starts).clamp_(0, page_size)
            pages = block_table.clamp(0, entries - 1).long()
            lengths = used.new_zeros(entries).scatter_reduce_(0, pages.flatten(), in_page.flatten(), "amax")
            cu_k = cu_q  # not read: a paged sequence's keys start at its first page
        in_use = (torch.arange(slots, device=q.device) < lengths.unsqueeze(1)).unsqueeze(2)  # (entries, slots, 1)
        tops = (None, *float32.tops_over_rows_in_use((k_cache, v_cache), in_use))
        # float32 pads all three to the wider head dim (the operand pass takes one: cute_flash.api).
        width = max(aligned_head_dim(head_dim), aligned_head_dim(value_dim))
        queries, keys, values = (with_aligned_rows(t, width) for t in (queries, keys, values))
        check_kernel_device(q)
        problem = packed_problem(queries, keys, causal, window_size[0], window_size[1], True, softcap, sink, used,
                                 page_size)
        out, lse = launch_fwd.forward_packed(queries, keys, values, cu_q, cu_k, used, rows_per_sequence, max_keys,
                                             problem, scale, sink, page_table=block_table, operand_tops=tops)
        out = out[..., :value_dim]
    else:
        if block_table is not None:
            pages = block_table.clamp(0, k_cache.shape[0] - 1).long()
            keys, values = (c[pages].flatten(1, 2) for c in (k_cache, v_cache))  # (B, max_pages * page_size, ..)
        else:
            entries = cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)
            keys, values = (c.index_select(0, entries) for c in (k_cache, v_cache))
        slots = keys.shape[1]
        keys, values = (t.flatten(0, 1) for t in (keys, values))
        out, lse = flash_attention_varlen(
            queries, keys, values, cu_q, _arange(batch, slots, q.device), rows_per_sequence, slots, causal=causal,
            softmax_scale=scale, return_lse=True, window_size=window_size, alignment="bottom_right", softcap=softcap,
            sink=sink, seqused_k=used)
    # Rows back to (B, Sq, N, Dv) and the LSE to (B, N, Sq), from (b, g) rows of kv heads
    # after a decode step's grouping.
    out_heads = out.shape[1]
    out = out.view(batch, rows_per_sequence, out_heads, -1)
    lse = lse.view(out_heads, batch, rows_per_sequence).permute(1, 0, 2)
    if out_heads != heads:
        out = out.transpose(1, 2).reshape(batch, 1, heads, -1)
        lse = lse.reshape(batch, heads, 1)
    return out, lse.contiguous()


def _cache_rows(cache, name):
    """A cache (entries or pages, slots, Nkv, D) as packed key rows (entries * slots, Nkv, D): a
    view where its slots run on from entry to entry, else a copy of the whole cache, made on
    every call, which a warning names (a (pages, 2, page_size, Nkv, D) tensor's k and v halves,
    say: pass k and v caches of their own)."""
    rows = cache.shape[0] * cache.shape[1]
    try:
        return cache.view(rows, *cache.shape[2:])
    except RuntimeError:
        warnings.warn(f"{name} of shape {tuple(cache.shape)} and strides {cache.stride()} cannot be read as rows in "
                      f"place: every call copies all of it ({cache.numel() * cache.element_size() / 2**20:.0f} MiB). "
                      "Pass a cache whose entries (pages) follow each other in memory, e.g. k and v caches of their "
                      "own", stacklevel=3)
        return cache.reshape(rows, *cache.shape[2:])


class KeyRows(NamedTuple):
    """Where each sequence's keys lie: the cache as packed keys and values (total, Nkv, D), a
    sequence's first row cu_k[b] (contiguous caches) or its pages (page_table row b,
    page_size > 0), used[b] keys, at most max_keys."""
    keys: torch.Tensor
    values: torch.Tensor
    cu_k: torch.Tensor
    used: torch.Tensor
    max_keys: int
    page_table: torch.Tensor | None
    page_size: int


def cache_problem(query_heads: int, kv_heads: int, page_size: int, causal, window_size, softcap, sink, splits=1,
                  grouped_rows=False):
    """The AttentionProblem of the kernel's queries (B, query_heads, rows, D) against a cache
    (bottom-right aligned; paged when page_size > 0), its keys walked in `splits` parts
    (split-KV) when splits > 1, a group's query heads at every position as the rows with
    grouped_rows (then query_heads = kv_heads)."""
    return AttentionProblem.of(causal, window_size, "bottom_right", softcap, sink is not None, query_heads != kv_heads,
                               keys_used=True, cached_keys=True, page_size=page_size, split_keys=splits > 1,
                               grouped_rows=grouped_rows)


def _attend(queries, keys: KeyRows, causal, window_size, sink, scale, softcap, direct, out=None, splits=1,
            positions=0):
    """The forward of queries (B, H, Sq, D) (a dense batch; any strides TMA reads) against
    sequence b's keys (KeyRows), bottom-right aligned: (out (B, H, Sq, D), lse (B, H, Sq)),
    out written into `out` when given. With splits > 1 each sequence's keys are walked in that
    many parts (a sink left to the merge): out (B * splits, H, Sq, D), lse (B * splits, H, Sq),
    part s of sequence b at b * splits + s. With positions > 0 the queries are (B, Nkv, group * Sq, D),
    a group's query heads at Sq = positions query positions (_grouped_step), and the LSE comes
    as (B (* splits), N, Sq) (launch_fwd.forward_cached). Launched directly when `direct`
    (eager), else through the op (traced)."""
    if direct:
        from cute_flash import launch_fwd
        from cute_flash.validation import check_kernel_device

        check_kernel_device(queries)
        problem = cache_problem(queries.shape[1], keys.keys.shape[1], keys.page_size, causal, window_size, softcap,
                                sink, splits, positions > 0)
        return launch_fwd.forward_cached(queries, keys.keys, keys.values, keys.cu_k, keys.used, keys.page_table,
                                         keys.max_keys, problem, scale, sink, out, splits, positions)
    result, lse = torch.ops.cute_flash.kvcache_attention(
        queries, keys.keys, keys.values, keys.cu_k, keys.used, keys.page_table, keys.max_keys, keys.page_size,
        bool(causal), scale, int(window_size[0]), int(window_size[1]), float(softcap), sink, splits, positions)
    if out is None:
        return result, lse
    out.copy_(result)
    return out, lse


@torch.library.custom_op("cute_flash::kvcache_attention", mutates_args=())
def kvcache_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      seqused_k: torch.Tensor, page_table: torch.Tensor | None, max_keys: int, page_size: int,
                      causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                      sink: torch.Tensor | None, splits: int = 1,
                      positions: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """_attend's work as an op (traced calls): queries (B, H, Sq, D) against the cache (keys,
    values (total, Nkv, D); KeyRows) -> out (B * splits, H, Sq, D), lse (B * splits, H, Sq)
    float32 (splits > 1: split-KV parts; positions > 0: grouped rows, see _attend)."""
    rows = KeyRows(keys, values, cu_seqlens_k, seqused_k, max_keys, page_table, page_size)
    return _attend(queries, rows, causal, (window_left, window_right), sink, softmax_scale, softcap, True,
                   splits=splits, positions=positions)


@kvcache_attention.register_fake
def _kvcache_attention_fake(queries, keys, values, cu_seqlens_k, seqused_k, page_table, max_keys, page_size, causal,
                            softmax_scale, window_left, window_right, softcap, sink, splits=1, positions=0):
    batch, heads, seqlen_q, _ = queries.shape
    entries = batch * splits if splits > 1 else batch
    lse_shape = (entries, heads * seqlen_q // positions, positions) if positions else (entries, heads, seqlen_q)
    return (queries.new_empty((entries, heads, seqlen_q, values.shape[-1])),
            queries.new_empty(lse_shape, dtype=torch.float32))


_constants = {}
_pinned = {}  # constants a CUDA graph captured: the graph reads them in every replay
MAX_CONSTANTS = 1024


def _constant(key, device, make):
    """The int32 tensor make() builds (never written), made once per key: the offsets and
    lengths a decode step would otherwise rebuild each call. Under CUDA graph capture: the
    one an eager call made (kept from then on, the graph reading it), else one made for the
    capture and not kept (a tensor made under capture gets its values in the graph's replays
    only); the warm-up call before a capture makes the eager ones, so a replay runs no kernel
    to rebuild them."""
    tensor = _pinned.get(key)
    if tensor is not None:
        return tensor
    if torch.compiler.is_compiling():
        return make()
    tensor = _constants.get(key)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if tensor is None:
            return make()
        _pinned[key] = tensor
        return tensor
    if tensor is None:
        if len(_constants) >= MAX_CONSTANTS:
            _constants.clear()
        tensor = _constants[key] = make()
    return tensor


def _arange(count, step, device):
    """(count + 1,) int32 [0, step, 2 step, ...] (step 0: zeros) on device (_constant)."""
    return _constant(("arange", count, step, device), device,
                     lambda: torch.arange(count + 1, dtype=torch.int32, device=device) * step)


def _filled(count, value, device):
    """(count,) int32 of `value` on device (_constant)."""
    return _constant(("full", count, value, device), device,
                     lambda: torch.full((count,), value, dtype=torch.int32, device=device))


# Split-KV: a decode step with fewer (sequence, key/value head) units than SMs / 4 walks each
# sequence's key blocks in parts, one CTA each (problem.split_keys: nearly equal runs of the
# blocks in use, decided in the kernel from the sequence's length), and merges the parts'
# (O, LSE) afterwards (one launch, kernels/split_merge.py); num_splits > 1 asks for it anywhere
# (at most MAX_SPLITS). Chosen automatically from SPLIT_MIN_CACHE slots: an eager step's split
# costs ~30 us more host time (two more tensors, the merge's launch), which pays only where
# the unsplit step's kernel runs longer (B = 1: ~50 us at 4k slots, ~100 at 8k); a step
# captured into a CUDA graph has no host time, so it splits from SPLIT_MIN_CACHE_CAPTURED
# (perf/NOTES.md, seventeenth session).
SPLIT_MIN_CACHE = 8192
SPLIT_MIN_CACHE_CAPTURED = 2048
SPLIT_MIN_KEYS = 128  # one key block of the decode forward
# From a quarter wave of units on a step splits only into as many parts as fill the SMs once
# (two or more: at most half a wave of units), each keeping this many keys at least: at
# B = 8 with 8 key/value heads (64 units, half of an H200's SMs idle unsplit) 2 parts ran
# 1.06-1.08x the unsplit step at 32k-128k slots, 0.98x at 4k (perf/NOTES.md, thirty-third
# session; an H100, with less bandwidth for those 64 SMs to fill, read 0.98-1.00x with the
# earlier decode tile, twentieth session).
WIDE_SPLIT_MIN_KEYS = 16384
MAX_SPLITS = 256


def decode_splits(num_splits, units, cache_len, device, captured=False) -> int:
    """How many parts a decode step's keys are split into: num_splits when given (1: no
    split; at most MAX_SPLITS), else, when units < SMs / 4 and the cache is long enough, as
    many as fill the SMs once; from SMs / 4 units on, as many as fill them once where that
    leaves each part WIDE_SPLIT_MIN_KEYS. captured: the step is being captured into a CUDA
    graph."""
    if num_splits > 0:
        return max(1, min(num_splits, cache_len, MAX_SPLITS))
    from cute_flash.torch_helpers import device_traits

    _, sms = device_traits(device)
    if 4 * units >= sms:
        wave = sms // units
        return wave if wave > 1 and cache_len // wave >= WIDE_SPLIT_MIN_KEYS else 1
    if cache_len < (SPLIT_MIN_CACHE_CAPTURED if captured else SPLIT_MIN_CACHE):
        return 1
    # One wave: the decode forward holds an SM per CTA (its shared memory), and a part more
    # per unit would start a second wave of a few CTAs (B = 1, 8 units: 16 parts 2238 GB/s,
    # 24 parts 2051, at 32k slots in graph replays).
    return max(1, min(sms // units, cache_len // SPLIT_MIN_KEYS, MAX_SPLITS))


def walked_keys(cache_len: int, window_size, seqlen_q: int) -> int:
    """The most keys a step of seqlen_q positions walks per sequence: the cache's, or a left
    window's span (decode_splits' key range)."""
    return cache_len if window_size[0] < 0 else min(cache_len, window_size[0] + seqlen_q)


# A step that does not split its keys takes grouped rows (q copied into the rows' order, O
# copied back) from this many (sequence, key/value head) units on; below, one query head per
# CTA walks the (short) cache in group x more CTAs (perf/NOTES.md, twentieth session: B = 1,
# 64/8 heads, 4k slots, with a sink 0.054 ms per head vs 0.104 as grouped rows), as the dense
# path's api.PACKED_DECODE_MIN_UNITS. (The decode step's packing is a view without copies:
# level with one head per CTA there, 0.049 / 0.049 ms, so it packs at any batch.)
PACKED_STEP_MIN_UNITS = 64


class StepRoute(NamedTuple):
    """How a step runs (step_route): decode (Sq = 1, no window or sink: a group's query heads
    as its sequence's rows, _decode_step), grouped (several positions as grouped rows,
    _grouped_step) or neither (the dense queries); its keys in `splits` parts (decode or
    grouped steps only; a split decode step runs as grouped rows of one position)."""
    decode: bool
    grouped: bool
    splits: int


def step_route(q_shape, kv_heads: int, cache_len: int, window_size, sink, num_splits, device,
               captured: bool) -> StepRoute:
    """The route of a step of q (B, Sq, N, D) on `device` over a cache of cache_len slots per
    sequence, for the general path (flash_attn_with_kvcache) and the eager plans
    (kvcache_plan) alike. captured: the step is being captured into a CUDA graph
    (decode_splits). Left to choose (num_splits = 0), a step whose keys it does not split
    takes grouped rows (copies of q and O) only from PACKED_STEP_MIN_UNITS (sequence,
    key/value head) units on; a num_splits given keeps them. The decode step's view
    (no copies) packs at any batch."""
    batch, seqlen_q, heads, _ = q_shape
    decode = seqlen_q == 1 and tuple(window_size) == (-1, -1) and sink is None
    # With a sink (one per query head) a step's rows take their query heads' sinks as grouped
    # rows (kernels/fwd_sm90.py), also at Sq = 1 and with one query head per key/value head.
    grouped = not decode and seqlen_q <= GROUPED_ROWS_MAX_SQ and (heads > kv_heads or sink is not None)
    splits = 1
    if decode or grouped:
        splits = decode_splits(num_splits, batch * kv_heads, walked_keys(cache_len, window_size, seqlen_q), device,
                               captured)
        if num_splits == 0 and splits == 1 and grouped and batch * kv_heads < PACKED_STEP_MIN_UNITS:
            grouped = False  # one query head per CTA, no copies: more CTAs walk the short cache
    return StepRoute(decode, grouped, splits)


def _decode_step(q, kv_heads, keys: KeyRows, attend):
    """A decode step (Sq = 1, no window, no sink) without split: causal (bottom-right) with
    one query row sees every key in use, so no mask is needed, and a group's query heads
    become its sequence's rows: q (B, 1, N, D) viewed as (B, Nkv, group, D), so one CTA reads
    a (sequence, key/value head)'s keys once for the whole group, and O and the LSE come out
    in the caller's order."""
    batch, _, heads, head_dim = q.shape
    out, lse = attend(q.reshape(batch, kv_heads, heads // kv_heads, head_dim), keys, False, (-1, -1), None)
    return out.view(batch, 1, heads, out.shape[-1]), lse.view(batch, heads, 1)


def _grouped_step(q, kv_heads, splits, keys: KeyRows, attend, causal, window_size, sink=None):
    """A step of Sq <= GROUPED_ROWS_MAX_SQ positions with grouped heads (or a split decode
    step): a key/value head's group of query heads at every position are one sequence's rows,
    group-major (head_mapping.py), so one CTA reads the keys once for the group; q (B, Sq, N,
    D) becomes (B, Nkv, group * Sq, D) (a view at Sq = 1, else one copy). With splits > 1 the
    forward walks each sequence's keys in that many parts (problem.split_keys), merged by
    their LSE in float32 (kernels/split_merge.py; a part without keys has weight 0), in a
    fixed order: deterministic for a fixed split count. Without split the rows' O is copied
    back to the caller's layout; the LSE comes out in it. A sink (N,) joins each row's
    denominator (its query head's), in the merge with splits."""
    batch, seqlen_q, heads, head_dim = q.shape
    group = heads // kv_heads
    rows = (q.reshape(batch, seqlen_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
            .reshape(batch, kv_heads, group * seqlen_q, head_dim))
    if seqlen_q == 1 and tuple(window_size) == (-1, -1):
        causal = False  # one position sees every key in use: no mask (the decode step's kernel)
    out, lse = attend(rows, keys, causal, window_size, sink, splits=splits, positions=seqlen_q)
    if splits > 1:
        merge = torch.ops.cute_flash.kvcache_merge_splits if torch.compiler.is_compiling() else merge_splits
        return merge(out, lse, batch, sink)
    value_dim = out.shape[-1]
    out = (out.view(batch, kv_heads, group, seqlen_q, value_dim).permute(0, 3, 1, 2, 4)
           .reshape(batch, seqlen_q, heads, value_dim))
    return out, lse


@torch.library.custom_op("cute_flash::kvcache_merge_splits", mutates_args=())
def kvcache_merge_splits(partial: torch.Tensor, partial_lse: torch.Tensor, batch: int,
                         sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A split step's output from its parts' (kernels/split_merge.py): partial (B * splits,
    Nkv, group * Sq, D) and partial_lse (B * splits, N, Sq) float32, part s of sequence b at
    b * splits + s -> out (B, Sq, N, D) and its LSE (B, N, Sq) float32."""
    return merge_splits(partial, partial_lse, batch, sink)


@kvcache_merge_splits.register_fake
def _kvcache_merge_splits_fake(partial, partial_lse, batch, sink=None):
    _, heads, seqlen_q = partial_lse.shape
    return (partial.new_empty((batch, seqlen_q, heads, partial.shape[-1])),
            partial_lse.new_empty((batch, heads, seqlen_q)))


def merge_splits(partial, partial_lse, batch, sink=None):
    """kvcache_merge_splits' work, launched directly (the eager path); sink: the (N,) float32
    logits that join the merged denominator, or None."""
    from cute_flash.compile_kvcache import get_split_merge
    from cute_flash.torch_helpers import TORCH_DTYPE_NAMES, device_scope, device_traits

    _, heads, seqlen_q = partial_lse.shape
    head_dim = partial.shape[-1]
    out = partial.new_empty((batch, seqlen_q, heads, head_dim))
    lse = partial_lse.new_empty((batch, heads, seqlen_q))
    arch, _ = device_traits(partial.device)
    with device_scope(partial.device):
        merge = get_split_merge(TORCH_DTYPE_NAMES[partial.dtype], head_dim, arch, sink is not None)
        merge(partial, partial_lse, sink, out, lse)
    return out, lse


@torch.library.custom_op("cute_flash::kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor, page_table: torch.Tensor) -> None:
    """Write k (B, S_new, Nkv, D) and v (B, S_new, Nkv, Dv) into the caches (num_pages,
    page_size, Nkv, D / Dv): row i of
    sequence b at its slot j = cache_seqlens[b] + i, in page page_table[b, j // page_size], row
    j % page_size (a contiguous cache: page_size = S_max, page_table = cache_batch_idx as a
    (B, 1) column). Slots outside the sequence's pages or the cache are skipped."""
    append_rows(k_cache, v_cache, k, v, cache_seqlens, page_table)


def append_rows(k_cache, v_cache, k, v, cache_seqlens, page_table):
    """kvcache_append's work, launched directly (the eager path): one launch for both caches."""
    from cute_flash.compile_kvcache import get_cache_append
    from cute_flash.torch_helpers import TORCH_DTYPE_NAMES, device_scope, device_traits
    from cute_flash.validation import check_kernel_device

    if k.numel() == 0:
        return
    check_kernel_device(k)
    arch, _ = device_traits(k.device)
    kernel = get_cache_append(TORCH_DTYPE_NAMES[k.dtype], k.shape[-1], arch, v.shape[-1])
    with device_scope(k.device):
        kernel(k, v, k_cache, v_cache, cache_seqlens, page_table)


@kvcache_append.register_fake
def _kvcache_append_fake(k_cache, v_cache, k, v, cache_seqlens, page_table):
    return None
