"""Launching the Hopper forward kernel on torch tensors (the op's CUDA implementation).

Inputs arrive validated (cute_flash.validation). What is left here is what the kernel itself
needs: outputs, inputs TMA can read (torch_helpers.as_tma_operand copies the others once),
the config of the call (cute_flash.config) and the compiled kernel (cute_flash.compile_fwd).
The eager fast path (cute_flash.api) keeps the kernel_for answer per call signature.
"""

import torch

from cute_flash import compile_fwd
from cute_flash.config import (band_fitted, get_config, grid_fitted, heads_clustered, rows_fitted, softcap_fitted,
                               tile_head_dim, tile_head_dims)
from cute_flash import float32
from cute_flash.head_dims import require_row_aligned
from cute_flash.kernels.problem import GROUPED_ROWS_MAX_SQ, AttentionProblem
from cute_flash.torch_helpers import (
    SIXTEEN_BIT,
    TORCH_DTYPE_NAMES,
    as_tma_operand,
    batch_of_one,
    device_scope,
    device_traits,
)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, softmax_scale: float,
            sink=None):
    """Run the forward kernel; returns (out, lse) with out (B, N, Sq, Dv) (v's head dim),
    lse (B, N, Sq) fp32. sink: the (N,) float32 sink logits when problem.sink. float32 q, k,
    v: on TF32 at torch's float32 matmul precision (cute_flash.float32; one head dim)."""
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    out = torch.empty((batch, heads, seqlen_q, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0:
        # No key at all: softmax over an empty set. Every row is "fully masked": O = 0 and
        # LSE = -inf, the convention the kernel uses for rows that see no key (with a sink,
        # the sink is the only term: LSE = the sink's logit).
        out.zero_()
        if sink is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(sink.view(1, heads, 1).expand_as(lse))
        return out, lse
    kernel = kernel_for(q.dtype, head_dim, end_aligned_problem(problem, seqlen_q == seqlen_k, q.dtype), q.device,
                        (seqlen_q, seqlen_k), v.shape[-1], (batch, heads, k.shape[1]))
    q, k, v = (as_tma_operand(t) for t in (q, k, v))
    scales = None  # (absent arguments are None: FlashForwardSm90.optional_arguments)
    if q.dtype == torch.float32:
        name, tile = kernel_tile(q.dtype, head_dim, q.device)
        q, k, v, scales = float32.kernel_operands(name, q, k, v, tile)
    with device_scope(q.device):
        kernel(q, k, v, out, lse, sink, None, None, None, None, scales, softmax_scale)
    return out, lse


def kernel_dtype_name(dtype: torch.dtype, head_dim: int, packed: bool = False) -> str:
    """The kernels' dtype name (config entries, compile keys) for inputs of `dtype`: float32
    ones follow torch's float32 matmul precision, or for a packed batch run the scaled halves
    (cute_flash.float32)."""
    if dtype == torch.float32:
        return float32.kernel_dtype_name(head_dim, packed)
    return TORCH_DTYPE_NAMES[dtype]


def kernel_tile(dtype: torch.dtype, head_dim: int, device: torch.device, packed: bool = False) -> tuple:
    """(the kernels' dtype name, the native forward tile head dim that serves head_dim; with
    float32's value chunks the q / k tile of their pair)."""
    dtype_name = kernel_dtype_name(dtype, head_dim, packed)
    if float32.value_chunks(dtype_name, head_dim):
        return dtype_name, tile_head_dims(dtype_name, head_dim, float32.VALUE_CHUNK, "fwd", device)[0]
    return dtype_name, tile_head_dim(dtype_name, head_dim, "fwd", device)


class ValueChunks:
    """The forward of float32's value chunks (cute_flash.float32.value_chunks) as one kernel
    callable: each chunk's launch reads its columns of the halves' V (a chunk's [hi | lo] rows,
    2 VALUE_CHUNK wide) and writes its columns of O; every launch writes the same LSE."""

    def __init__(self, launches: tuple):
        self.launches = launches  # (first column, columns, kernel) per chunk

    def __call__(self, q, k, v, out, lse, *rest):
        for first, columns, kernel in self.launches:
            kernel(q, k, v[..., 2 * first: 2 * (first + float32.VALUE_CHUNK)], out[..., first: first + columns],
                   lse, *rest)


def kernel_for(dtype: torch.dtype, head_dim: int, problem: AttentionProblem, device: torch.device, seqlens=None,
               value_head_dim: int | None = None, grid=None):
    """The compiled forward for these inputs on this device (compiled on first use), with the
    config that cute_flash.config selects for `seqlens` = (Sq, Sk) on the native tile (or
    pair of tiles) that serves q's and k's head_dim and v's value_head_dim (default head_dim;
    multiples of head_dims.ROW_ALIGN; cute_flash.head_dims). grid: (batch, query heads, K/V
    heads) of a batch of query rows, where the entry's clusters of query heads may apply
    (config.heads_clustered) and its tile height is fitted to the grid (config.grid_fitted); a
    packed batch's is packed_grid's; None: neither."""
    require_row_aligned(head_dim, "forward kernels")
    chunks = float32.value_chunks(kernel_dtype_name(dtype, head_dim, problem.packed), value_head_dim or head_dim) \
        if dtype == torch.float32 else None
    if chunks:
        kernels = {w: kernel_for(dtype, head_dim, problem, device, seqlens, w, grid) for w in {w for _, w in chunks}}
        return ValueChunks(tuple((first, w, kernels[w]) for first, w in chunks))
    if value_head_dim is None or value_head_dim == head_dim:
        dtype_name, tile = kernel_tile(dtype, head_dim, device, problem.packed)
        value_head_dim, value_tile = head_dim, tile
    else:
        require_row_aligned(value_head_dim, "forward kernels")
        dtype_name = kernel_dtype_name(dtype, head_dim, problem.packed)
        tile, value_tile = tile_head_dims(dtype_name, head_dim, value_head_dim, "fwd", device)
    config = get_config(dtype_name, tile, problem.causal, "fwd", device, seqlens=seqlens, value_head_dim=value_tile)
    config = softcap_fitted(config, problem)
    arch, num_sms = device_traits(device)
    batch, heads, kv_heads = grid or (0, 0, 0)  # (no grid: no units, so neither fitting nor clusters)
    if seqlens is not None:
        # Rows of a (head, batch): with row_heads, G of them per query position.
        rows = seqlens[0] * max(problem.row_heads, 1)
        config = rows_fitted(config, rows)
        # (With row_heads a tile's rows are a group's: grid's heads / G units of them.)
        # K's and V's bytes per key as the kernel counts them for its sections: its tiles' widths.
        config = grid_fitted(config, problem, batch, heads // max(problem.row_heads, 1), rows, seqlens[1],
                             (tile + value_tile) * dtype.itemsize, num_sms)
    if dtype.itemsize == 2:  # float32's operands are split into parts (cute_flash.float32): unmeasured
        config = band_fitted(config, problem, max(tile, value_tile) * dtype.itemsize)
    config = heads_clustered(config, problem, batch, heads, kv_heads, seqlens[0] if seqlens else 0, num_sms)
    return compile_fwd.get_forward(dtype_name, head_dim, problem, config, arch, tile, value_head_dim, value_tile)


def packed_grid(q, k, max_seqlen_q: int) -> tuple:
    """kernel_for's grid of a packed batch, q (total_q, N, D) and k (total_k, Nkv, D): as many
    sequences of max_seqlen_q rows as total_q holds (at least one), one unit per query head.
    The host does not read the lengths; those sequences make about as many tiles as the
    total's rows (the fewest the lengths can make), where counting the longest sequence alone
    (until the fifty-first session) saw a batch of many short sequences as a grid of a few
    tiles, for which grid_fitted picks the shorter tile."""
    return max(q.shape[0] // max(max_seqlen_q, 1), 1), q.shape[1], k.shape[1]


def end_aligned_problem(problem: AttentionProblem, equal_lengths: bool, dtype: torch.dtype) -> AttentionProblem:
    """The problem a band forward runs with its tiles aligned to each sequence's end
    (AttentionProblem.end_aligned; kernels/sequences.py, SequenceLayout.aligned_to_end: the
    partial tile is then the one that sees the fewest keys; issue 22's long-tailed batch
    1.01-1.03x, dense causal D = 64 1.02-1.03x faster, perf/NOTES.md, sixtieth and sixty-first
    sessions). equal_lengths: the host knows every sequence has as many queries as keys
    without reading the offsets' values (dense Sq = Sk; packed: equal_offsets)."""
    return problem.end_aligned(equal_lengths, dtype in SIXTEEN_BIT)


def packed_kernel_problem(problem: AttentionProblem, q, k, max_seqlen_q: int,
                          equal_lengths: bool = False) -> AttentionProblem:
    """The problem a packed batch's forward kernel runs (the backward keeps `problem`): with
    grouped key/value heads, 16-bit and a group dividing 64 (rules.row_heads), a group's query
    heads at each position as consecutive rows of one tile (problem.row_heads), as the dense
    path does (api._heads_in_rows, grouped_rows), where the tile's keys are read once for the
    group instead of once per query head: decode-like batches (at most GROUPED_ROWS_MAX_SQ
    queries per sequence: one query head per tile read every sequence's keys 4x over at 32 / 8
    heads, 2.2-3.3x flash-attn-4's varlen time) and bands (causal or a window, whose key
    ranges then follow a tile's positions). q (total_q, N, D), k (total_k, Nkv, D).
    equal_lengths: every sequence has as many queries as keys (end_aligned_problem)."""
    problem = end_aligned_problem(problem, equal_lengths, q.dtype)
    group = q.shape[1] // max(k.shape[1], 1)
    if (problem.grouped and q.dtype in SIXTEEN_BIT and group > 1 and 64 % group == 0
            and (problem.band or max_seqlen_q <= GROUPED_ROWS_MAX_SQ)):
        return problem.with_group_in_rows(group)
    return problem


def packed_kernel(q, k, v, problem: AttentionProblem, max_seqlen_q: int, max_seqlen_k: int,
                  equal_lengths: bool = False):
    """kernel_for a packed batch: packed_kernel_problem's kernel on packed_grid's grid."""
    return kernel_for(q.dtype, q.shape[-1], packed_kernel_problem(problem, q, k, max_seqlen_q, equal_lengths),
                      q.device, (max_seqlen_q, max_seqlen_k), v.shape[-1], packed_grid(q, k, max_seqlen_q))


def equal_offsets(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table) -> bool:
    """Whether every packed sequence has as many queries as keys, from what the host has: one
    offsets tensor for both (as flash-attn-style training code and Hugging Face's unpadding
    pass for self-attention) and no seqused_k or page table."""
    return cu_seqlens_q is cu_seqlens_k and seqused_k is None and page_table is None


def forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q: int, max_seqlen_k: int,
                   problem: AttentionProblem, softmax_scale: float, sink=None, out=None, page_table=None,
                   operand_tops=None):
    """Run the forward kernel on a packed batch (problem.packed; kernels/sequences.py): q
    (total_q, N, D), k (total_k, Nkv, D) and v (total_k, Nkv, Dv), sequence b's rows from
    cu_seqlens_*[b] (int32, on q's device). Returns out (total_q, N, Dv) and lse (N, total_q)
    fp32. The kernel takes
    the packed tensors as a batch of one, (1, N, total, D) views; max_seqlen_q / _k pick the
    tile config (the grid's bound comes from total_q and B, kernels/tile_scheduler.py).
    out: a (total_q, N, D) tensor to write O into (any strides with a unit last one; the SDPA
    route passes empty_like(q), the layout aten's meta function promises). With
    problem.page_size k and v are pages as rows (num_pages * page_size, Nkv, D) and page_table
    (B, max_pages) int32 lists each sequence's (cu_seqlens_k unread, seqused_k its keys).
    operand_tops: float32 only, (q's, k's, v's) largest |x| per head as (1, H) tensors, None
    for those to reduce here (a KV cache's rows not in use excluded, cute_flash.kvcache;
    without them, with seqused_k, k's and v's over the rows in use, float32.keys_in_use_tops)."""
    total_q, heads, head_dim = q.shape
    if out is None:
        out = torch.empty((total_q, heads, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[0] == 0:
        # No sequence has a key: every row sees nothing (as launch_fwd.forward with Sk = 0).
        out.zero_()
        if sink is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(sink.view(heads, 1).expand_as(lse))
        return out, lse
    kernel = packed_kernel(q, k, v, problem, max_seqlen_q, max_seqlen_k,
                           equal_offsets(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table))
    operands = tuple(as_tma_operand(batch_of_one(t)) for t in (q, k, v))
    scales = None
    with device_scope(q.device):
        if q.dtype == torch.float32:
            # The scaled halves (cute_flash.float32): a power of two per head over the whole
            # packed tensor (with seqused_k k's and v's over the rows in use), its scales (1, N,
            # 2) read at the inputs' batch index (0 when packed: kernels/sequences.Sequence.batch).
            if operand_tops is None and seqused_k is not None and page_table is None:
                operand_tops = (None, *float32.keys_in_use_tops((k, v), cu_seqlens_k, seqused_k))
            *operands, scales = float32.halves_operands(*operands, kernel_tile(q.dtype, head_dim, q.device, True)[1],
                                                        operand_tops)
        launch_packed(kernel, operands, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                      softmax_scale, scales)
    return out, lse


def launch_packed(kernel, operands, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                  softmax_scale: float, operand_scales=None) -> None:
    """The packed forward kernel on the current device: operands, q, k and v as the (1, N,
    total, D) views TMA reads (torch_helpers.batch_of_one, copied where it cannot; float32's as
    the scaled halves with their operand_scales (B, N, 2)); out (total_q, N, Dv) and lse (N,
    total_q) written; absent arguments None, as the kernel is compiled (forward_packed and the
    eager plans, cute_flash.varlen_plan)."""
    kernel(*operands, batch_of_one(out), lse.unsqueeze(0), sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
           operand_scales, softmax_scale)


def forward_cached(q, k, v, cu_seqlens_k, seqused_k, page_table, max_seqlen_k: int, problem: AttentionProblem,
                   softmax_scale: float, sink=None, out=None, splits: int = 1, positions: int = 0):
    """Run the forward kernel on a dense batch of queries against a KV cache
    (problem.cached_keys; kernels/sequences.py): q (B, N, Sq, D) (any strides TMA can read,
    e.g. a view of flash-attn's (B, Sq, N, D)), k and v the cache as packed rows (total, Nkv,
    D; v's head dim Dv may differ) with sequence b's keys from row cu_seqlens_k[b], seqused_k[b]
    of them; or with problem.page_size the cache's pages (num_pages * page_size, Nkv, D) and
    page_table (B, max_pages) int32 listing each sequence's (kernels/key_pages.py). Returns out
    (B, N, Sq, Dv)
    (into `out` when given: a view with a unit last stride) and lse (B, N, Sq) fp32. With
    problem.split_keys each sequence's keys are walked in `splits` parts: out (B * splits, N,
    Sq, D) and lse (B * splits, N, Sq), part s of sequence b at b * splits + s, each normalised
    over its part's keys (kernels/split_merge.py merges them). With problem.grouped_rows q is
    (B, Nkv, group * Sq, D), a key/value head's group at its `positions` = Sq query positions
    as rows (head_mapping.py), and the LSE comes in the (B (* splits), Nkv * group, Sq)
    layout."""
    batch, heads, seqlen_q, head_dim = q.shape
    entries = batch * splits if problem.split_keys else batch
    if out is None:
        out = torch.empty((entries, heads, seqlen_q, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse_shape = (entries, heads, seqlen_q)
    if problem.grouped_rows:
        lse_shape = (entries, heads * seqlen_q // positions, positions)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    kernel = kernel_for(q.dtype, head_dim, problem, q.device, (seqlen_q, max_seqlen_k), v.shape[-1],
                        (batch, heads, k.shape[1]))
    q4, k4, v4 = (as_tma_operand(t) for t in (q, batch_of_one(k), batch_of_one(v)))
    with device_scope(q.device):
        # (A dense batch of queries: no cu_seqlens_q; no page table unless paged, no operand scales.)
        kernel(q4, k4, v4, out, lse, sink, None, cu_seqlens_k, seqused_k, page_table, None, softmax_scale)
    return out, lse
