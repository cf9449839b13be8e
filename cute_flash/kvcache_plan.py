"""The eager fast path of flash_attn_with_kvcache: what a call signature decides, made once.

A decode step is a few microseconds of GPU time per layer, and on the H100 machine each small
torch op (a view, a reshape, an empty) costs 4-9 us of host time: the general path's ~30 of
them (checks, views for the kernel, the group's row order, the output's) made an eager step
host-bound at 300 us (perf/NOTES.md, sixteenth session). A plan keeps what the call's
signature (shapes, strides, dtypes, devices, pointer alignment, the arguments that are not
tensors) decides: the checks' verdict, the scale, the compiled kernel, the split count, the
constant offsets and the kernel's views as as_strided arguments. A call with a known signature
then runs the appends, one strided view per tensor (q and the output read and written in place;
a split step's parts written to a buffer of their own; grouped rows copy q into their order and
the rows' O back), the kernel, and with splits the merge.

A plan exists only where the kernels can read the tensors as they are (16-byte aligned rows
and pointers, a cache whose (entries, slots) dimensions merge into one token axis); other
calls, traced calls and validate=True take the general path (cute_flash.kvcache), which copies
what TMA cannot read.
"""

import numbers
from dataclasses import dataclass

import torch

from cute_flash.head_dims import ROW_ALIGN
from cute_flash.torch_helpers import TMA_ALIGN_BYTES, cached_plan, current_device_index as _current_device

_plans = {}
MAX_PLANS = 1024


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def signature(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
              window_size, softcap, learnable_sink, num_splits, return_softmax_lse):
    """Everything a plan depends on (raises AttributeError/TypeError on arguments that are not
    what they should be: the general path then names the problem)."""
    seqlens = _meta(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else (type(cache_seqlens), cache_seqlens)
    return (
        _meta(q), _meta(k_cache), _meta(v_cache), _meta(k), _meta(v), seqlens, _meta(cache_batch_idx),
        _meta(block_table), _meta(learnable_sink),
        (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & (TMA_ALIGN_BYTES - 1),
        softmax_scale, causal, window_size, softcap, num_splits, return_softmax_lse, _current_device(),
    )


def plan_for(key, args):
    """The plan of a signature (made on first sight, after the general path's checks, which
    raise on bad arguments), or None where the general path must run. Under CUDA graph
    capture a plan is made for the call and not kept: a constant tensor (offsets, lengths)
    that it had to make is filled by kernels that the capture records instead of running, so
    it holds its values only in that graph's replays (kvcache._constant: those an eager call
    made are used as they are), and a captured step splits its keys by its own rule
    (kvcache.decode_splits)."""
    if torch.cuda.is_current_stream_capturing():
        return _make_plan(*args)
    return cached_plan(_plans, key, lambda: _make_plan(*args), MAX_PLANS)


def _merged_rows(t):
    """(shape, stride) of a (B, S, H, D) tensor as the kernels' packed (1, H, B * S, D) view,
    or None when its (B, S) dimensions do not merge or TMA cannot read its rows."""
    batch, seqlen, heads, head_dim = t.shape
    if batch > 1 and t.stride(0) != seqlen * t.stride(1):
        return None
    element = t.element_size()
    if t.stride(3) != 1 or any((s * element) % TMA_ALIGN_BYTES for s in (t.stride(1), t.stride(2))):
        return None
    return (1, heads, batch * seqlen, head_dim), (batch * seqlen * t.stride(1), t.stride(2), t.stride(1), 1)


def _make_plan(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
               window_size, softcap, learnable_sink, num_splits, return_softmax_lse):
    from cute_flash import kvcache
    from cute_flash.validation import check_kernel_device, check_variant, resolve_scale

    new = kvcache.check_kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                     num_splits)
    batch, seqlen_q, heads, head_dim = q.shape
    check_variant(causal, window_size, "bottom_right", softcap, learnable_sink, heads, q.device)
    scale = resolve_scale(softmax_scale, head_dim)
    check_kernel_device(q)
    if cache_seqlens is None:
        cache_seqlens = kvcache.sequence_slots(k_cache, block_table)
    cache_views = [_merged_rows(c) for c in (k_cache, v_cache)]
    # Not planned (the general path runs them): float32, a v head dim of its own, unaligned dims, ...
    if (q.numel() == 0 or q.dtype == torch.float32 or head_dim % ROW_ALIGN or q.stride(3) != 1
            or v_cache.shape[3] != head_dim
            or (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % TMA_ALIGN_BYTES or None in cache_views):
        return None
    if q.device.index != _current_device():
        return None
    route = kvcache.step_route(q.shape, k_cache.shape[2], kvcache.sequence_slots(k_cache, block_table), window_size,
                               learnable_sink, num_splits, q.device, torch.cuda.is_current_stream_capturing())
    if route.grouped:
        # Grouped rows (kvcache._grouped_step): q's and the output's (B, Nkv, group, Sq, D)
        # views, copied into and out of the rows' layout.
        q_view = _group_major_view(q.shape, q.stride(), k_cache.shape[2])
        out_view = _group_major_view(q.shape, _contiguous_strides(q.shape), k_cache.shape[2])
    else:
        kv_heads = k_cache.shape[2] if route.decode else None
        q_view = _query_view(q.shape, q.stride(), q.element_size(), kv_heads)
        out_view = _query_view(q.shape, _contiguous_strides(q.shape), q.element_size(), kv_heads)
    if q_view is None or out_view is None:
        return None
    return _Plan.make(q, k_cache, cache_views, q_view, out_view, new, cache_seqlens, cache_batch_idx, block_table,
                      scale, causal, window_size, softcap, learnable_sink, return_softmax_lse, route)


def _group_major_view(shape, strides, kv_heads):
    """(shape, stride) of a (B, Sq, N, D) tensor (its shape and strides) as (B, Nkv, group, Sq,
    D): grouped rows' order (kernels/head_mapping.py)."""
    batch, seqlen, heads, head_dim = shape
    s_b, s_s, s_h, s_d = strides
    group = heads // kv_heads
    return (batch, kv_heads, group, seqlen, head_dim), (s_b, group * s_h, s_h, s_s, s_d)


def _contiguous_strides(shape):
    strides, size = [], 1
    for n in reversed(shape):
        strides.insert(0, size)
        size *= n
    return tuple(strides)


def _query_view(shape, strides, element_size, kv_heads=None):
    """(shape, stride) of q (B, Sq, N, D) (its shape and strides) as the kernel's dense (B, N,
    Sq, D) queries; a decode step's (kv_heads given, Sq = 1) as (B, Nkv, group, D): a group's
    query heads are its sequence's rows. None when TMA cannot read that view."""
    batch, seqlen, heads, head_dim = shape
    s_b, s_s, s_h, _ = strides
    if kv_heads is None:
        shape, stride = (batch, heads, seqlen, head_dim), (s_b, s_h, s_s, 1)
    else:
        group = heads // kv_heads
        shape, stride = (batch, kv_heads, group, head_dim), (s_b, group * s_h, s_h, 1)
    if any((x * element_size) % TMA_ALIGN_BYTES for x, n in zip(stride[:3], shape[:3]) if n > 1):
        return None
    return shape, stride


@dataclass(frozen=True)
class _Plan:
    new: int  # rows appended per sequence
    decode: bool  # Sq = 1 without window or sink: a group's query heads as its sequence's rows
    grouped: bool  # grouped rows of a step of a few positions (q copied into the rows' order)
    splits: int  # split-KV parts of a decode or grouped step (1: none)
    kernel: object
    append: object  # the append kernel, or None
    merge: object  # the split merge kernel, or None
    scale: float
    cache_len: int  # the slots of one sequence
    page_size: int  # 0: a contiguous cache
    kv_views: tuple  # (shape, stride) of k's and v's packed (1, Nkv, total, D) views
    q_view: tuple  # (shape, stride) of q as the kernel's queries (B, H, S, D); grouped: (B, Nkv, group, Sq, D)
    out_view: tuple  # the same of a contiguous output (B, Sq, N, D)
    rows_shape: tuple  # the kernel's queries (B, H, rows, D)
    cu_k: torch.Tensor | None  # the sequences' first rows; None: cache_batch_idx * S_max per call
    seqlens: torch.Tensor | None  # an int cache_seqlens as a tensor
    used: torch.Tensor | None  # an int cache_seqlens + new, as a tensor
    default_pages: torch.Tensor | None  # the append's page table of a contiguous cache without cache_batch_idx
    lse_sink: torch.Tensor  # where an unsplit step's kernel writes an unwanted LSE (never read)
    merged_lse_sink: torch.Tensor  # the same as (B, N, Sq): a split step's merge, grouped rows
    last_offset: torch.Tensor  # (1,) int32: the entry offsets' last one (_entry_offsets)
    return_lse: bool

    @staticmethod
    def make(q, k_cache, cache_views, q_view, out_view, new, cache_seqlens, cache_batch_idx, block_table, scale, causal,
             window_size, softcap, learnable_sink, return_lse, route):
        from cute_flash import kvcache, launch_fwd
        from cute_flash.compile_kvcache import get_cache_append, get_split_merge
        from cute_flash.torch_helpers import TORCH_DTYPE_NAMES, device_traits

        device = q.device
        batch, seqlen_q, heads, head_dim = q.shape
        cache_batch, page_size, kv_heads, _ = k_cache.shape
        cache_len = kvcache.sequence_slots(k_cache, block_table)
        paged = block_table is not None
        decode, grouped, splits = route
        int_seqlens = isinstance(cache_seqlens, numbers.Integral)
        seqlens = kvcache._filled(batch, int(cache_seqlens), device) if int_seqlens else None
        if grouped:
            query_heads, rows = kv_heads, heads // kv_heads * seqlen_q
        else:
            _, query_heads, rows, _ = q_view[0]
        # A decode step's one row sees every key in use: no mask (as kvcache._decode_step); a
        # split one is the one-position case of grouped rows (kvcache._grouped_step).
        problem = kvcache.cache_problem(query_heads, kv_heads, page_size if paged else 0, causal and not decode,
                                        window_size, softcap, learnable_sink, splits, grouped or splits > 1)
        kernel = launch_fwd.kernel_for(q.dtype, head_dim, problem, device, (rows, cache_len),
                                       grid=(batch, query_heads, kv_heads))
        arch, _ = device_traits(device)
        dtype_name = TORCH_DTYPE_NAMES[q.dtype]
        if paged:
            cu_k = kvcache._arange(batch, 0, device)  # not read
        elif cache_batch_idx is None:
            cu_k = kvcache._arange(batch, cache_len, device)
        else:
            cu_k = None
        lse_sink = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=device)
        return _Plan(
            new=new, decode=decode, grouped=grouped, splits=splits, kernel=kernel,
            append=get_cache_append(dtype_name, head_dim, arch) if new else None,
            merge=get_split_merge(dtype_name, head_dim, arch, learnable_sink is not None) if splits > 1 else None,
            scale=scale, cache_len=cache_len, page_size=page_size if paged else 0, kv_views=tuple(cache_views),
            q_view=q_view, out_view=out_view, rows_shape=(batch, query_heads, rows, head_dim), cu_k=cu_k,
            seqlens=seqlens,
            used=kvcache._filled(batch, int(cache_seqlens) + new, device) if int_seqlens else None,
            default_pages=(kvcache._arange(batch, 1, device)[:batch].unsqueeze(1)
                           if cache_batch_idx is None and not paged else None),
            lse_sink=lse_sink.view(batch, query_heads, rows) if not grouped else lse_sink, merged_lse_sink=lse_sink,
            last_offset=torch.zeros(1, dtype=torch.int32, device=device),
            return_lse=return_lse,
        )

    def run(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, sink):
        seqlens = self.seqlens if self.seqlens is not None else cache_seqlens
        if self.new:
            pages = block_table if block_table is not None else (
                self.default_pages if cache_batch_idx is None else cache_batch_idx.unsqueeze(1))
            self.append(k, v, k_cache, v_cache, seqlens, pages)
        used = self.used if self.used is not None else (seqlens + self.new if self.new else seqlens)
        cu_k = self.cu_k if self.cu_k is not None else self._entry_offsets(cache_batch_idx)
        k4, v4 = (c.as_strided(*view) for c, view in zip((k_cache, v_cache), self.kv_views))
        batch, seqlen_q, heads, head_dim = q.shape
        if self.grouped:
            # Grouped rows: q copied into the rows' order (B, Nkv, group * Sq, D).
            queries = torch.empty(self.q_view[0], dtype=q.dtype, device=q.device)
            queries.copy_(q.as_strided(*self.q_view))
            queries = queries.view(self.rows_shape)
        else:
            queries = q.as_strided(*self.q_view)
        if self.splits == 1 and not self.grouped:
            # q and the output through the same strided view: no copies.
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = (torch.empty(self.rows_shape[:3], dtype=torch.float32, device=q.device) if self.return_lse
                   else self.lse_sink)
            self.kernel(queries, k4, v4, out.as_strided(*self.out_view), lse, sink, None, cu_k, used, block_table,
                        None, self.scale)
            if not self.return_lse:
                return out, None
            return out, (lse.view(batch, heads, 1) if self.decode else lse)
        # Grouped rows' LSE comes in the caller's (B (* splits), N, Sq) layout.
        lse_shape = (batch * self.splits, heads, seqlen_q)
        merged_lse = (torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if self.return_lse
                      else self.merged_lse_sink)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.splits == 1:
            rows = torch.empty(self.rows_shape, dtype=q.dtype, device=q.device)
            self.kernel(queries, k4, v4, rows, merged_lse, sink, None, cu_k, used, block_table, None,
                        self.scale)
            out.as_strided(*self.out_view).copy_(rows.view(self.out_view[0]))
            return out, (merged_lse if self.return_lse else None)
        # Split-KV: part s of sequence b's keys is the forward's output entry b * splits + s
        # (problem.split_keys), the parts merged by one kernel.
        partial = torch.empty((lse_shape[0],) + self.rows_shape[1:], dtype=q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        self.kernel(queries, k4, v4, partial, lse, sink, None, cu_k, used, block_table, None,
                    self.scale)
        self.merge(partial, lse, sink, out, merged_lse)
        return out, (merged_lse if self.return_lse else None)

    def _entry_offsets(self, cache_batch_idx):
        """cu_seqlens_k of a contiguous cache read through cache_batch_idx (its last entry is
        never read: the lengths come from seqused_k)."""
        return torch.cat((cache_batch_idx * self.cache_len, self.last_offset))
