"""Reference attention in plain PyTorch: the ground truth, and the FlashAttention algorithm
written out tile by tile so it can be read, stepped through and tested on a CPU.

Conventions (those of torch.nn.functional.scaled_dot_product_attention):
* q (B, N, Sq, D), k (B, N, Sk, D), v (B, N, Sk, Dv); scale defaults to 1/sqrt(D);
* causal is the top-left-aligned lower triangle: query i sees keys j <= i;
* LSE is the natural-log log-sum-exp of each row's scaled scores;
* a row that sees no key (Sk = 0) gives O = 0 and LSE = -inf.
attention_reference also takes the variants of cute_flash.flash_attention: k and v with
Nkv heads dividing N (grouped-query attention), window_size and alignment (the band mask of
band_mask), softcap, and per-head sink logits.
"""

import math

import torch


def _scale(q: torch.Tensor, softmax_scale):
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Boolean (Sq, Sk) mask, True where query i may see key j (j <= i)."""
    return band_mask(seqlen_q, seqlen_k, causal=True, device=device)


def band_mask(seqlen_q: int, seqlen_k: int, causal=False, window_size=(-1, -1), alignment="top_left",
              device=None) -> torch.Tensor:
    """Boolean (Sq, Sk) mask, True where query i may see key j: i + off - left <= j <= i + off
    + right, off = 0 (top_left) or Sk - Sq (bottom_right), -1 meaning unbounded, causal
    meaning right = 0."""
    left, right = window_size
    if causal:
        right = 0
    off = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + off
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def attention_reference(q, k, v, causal=False, softmax_scale=None, dtype=torch.float64, window_size=(-1, -1),
                        alignment="top_left", softcap=0.0, sink=None):
    """Naive attention computed in `dtype`; returns (out, lse), out in `dtype`, lse in `dtype`."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * _scale(q, softmax_scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or tuple(window_size) != (-1, -1):
        visible = band_mask(q.shape[-2], k.shape[-2], causal, window_size, alignment, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        # One more logit per row, without a value: it joins the denominator only.
        sink_col = sink.to(dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([scores, sink_col], dim=-1), dim=-1)
        probs = torch.exp(scores - lse[..., None])
        return probs @ v, lse
    lse = torch.logsumexp(scores, dim=-1)
    # A row with no visible key has LSE -inf; clamping it keeps exp(-inf - LSE) at 0 instead of
    # NaN, while NaN or inf in the inputs still propagate as they would in plain math.
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(dtype).min))
    return probs @ v, lse


def packed_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, dtype=torch.float64, **kwargs):
    """attention_reference per sequence of a packed batch (cute_flash.varlen): q (total_q, N, D),
    k and v (total_k, Nkv, D); returns out (total_q, N, D) and lse (N, total_q) in `dtype`.
    kwargs: attention_reference's (masks per sequence)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[b], cu_q[b + 1], cu_k[b]
        k1 = k0 + used[b] if used is not None else cu_k[b + 1]
        if q1 == q0:
            continue
        rows = q[q0:q1].transpose(0, 1)  # (N, Sq, D)
        if k1 == k0:
            # No key: the kernels' convention (O = 0, LSE = -inf, or the sink's logit).
            if kwargs.get("sink") is not None:
                lse[:, q0:q1] = kwargs["sink"].to(dtype).view(-1, 1)
            continue
        o, l = attention_reference(rows, k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1), dtype=dtype, **kwargs)
        out[q0:q1] = o.transpose(0, 1)
        lse[:, q0:q1] = l
    return out, lse


def tiled_attention(q, k, v, causal=False, softmax_scale=None, block_m=64, block_n=64, trace=None,
                    window_size=(-1, -1), alignment="top_left", softcap=0.0, sink=None):
    """The FlashAttention forward, one (block_m x block_n) tile at a time; returns (out, lse).

    For each block of query rows it walks the key/value blocks and keeps, per row,
      m: the largest score seen so far,
      l: the sum of exp(score - m) over the keys seen so far,
      acc: the sum of exp(score - m) * v over the keys seen so far.
    A new block that raises m rescales l and acc by exp(m_old - m_new) before adding its own
    terms, so nothing is ever recomputed and no (Sq, Sk) matrix exists. At the end O = acc / l
    and LSE = m + log(l). Under causal masking, key blocks entirely right of the diagonal are
    skipped, which is where the kernel saves half the work.

    `trace`, if a list, receives one dict per (query block, key block) step with the running
    m, l, acc and acc / l of that query block, for tests and for reading along.

    The variants as in attention_reference: key/value heads shared by groups of query heads,
    the band mask (only the key blocks inside a query block's band are walked, as the kernels
    do), softcap, and a sink logit per head added to each row's sum at the end.
    """
    scale = _scale(q, softmax_scale)
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    banded = causal or tuple(window_size) != (-1, -1)
    left, right = window_size
    right = 0 if causal else right
    offset = k.shape[-2] - q.shape[-2] if alignment == "bottom_right" else 0
    *batch, seqlen_q, _ = q.shape
    seqlen_k = k.shape[-2]
    out = torch.zeros(*batch, seqlen_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((*batch, seqlen_q), float("-inf"), dtype=q.dtype, device=q.device)
    for m_start in range(0, seqlen_q, block_m):
        m_end = min(m_start + block_m, seqlen_q)
        q_tile = q[..., m_start:m_end, :]
        row_max = torch.full((*batch, m_end - m_start), float("-inf"), dtype=q.dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(*batch, m_end - m_start, v.shape[-1], dtype=q.dtype, device=q.device)
        # The band: the last row of this block sees keys up to m_end - 1 + offset + right, the
        # first from m_start + offset - left; blocks outside are never visited.
        n_end_total = min(seqlen_k, max(m_end + offset + right, 0)) if right >= 0 else seqlen_k
        n_first = max(m_start + offset - left, 0) // block_n * block_n if left >= 0 else 0
        for n_start in range(n_first, n_end_total, block_n):
            n_end = min(n_start + block_n, seqlen_k)
            scores = (q_tile @ k[..., n_start:n_end, :].transpose(-1, -2)) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if banded:
                visible = band_mask(seqlen_q, seqlen_k, causal, window_size, alignment, q.device)
                scores = scores.masked_fill(~visible[m_start:m_end, n_start:n_end], float("-inf"))
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            # Rows that have seen only masked keys keep max -inf; exp must then give 0, not NaN.
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            correction = torch.exp(row_max - safe_max)
            probs = torch.exp(scores - safe_max[..., None])
            row_sum = row_sum * correction + probs.sum(dim=-1)
            acc = acc * correction[..., None] + probs @ v[..., n_start:n_end, :]
            row_max = new_max
            if trace is not None:
                normalised = acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)[..., None]
                trace.append(dict(m_start=m_start, n_start=n_start, row_max=row_max.clone(),
                                  row_sum=row_sum.clone(), acc=acc.clone(), out=normalised))
        if sink is not None:
            # The sink joins the sum (not the values) at the end, at the larger maximum.
            sink_rows = sink.to(q.dtype).view(-1, 1).expand_as(row_max)
            top = torch.maximum(torch.where(torch.isinf(row_max), sink_rows, row_max), sink_rows)
            row_sum = row_sum * torch.exp(row_max - top).nan_to_num(0.0) + torch.exp(sink_rows - top)
            acc = acc * torch.exp(row_max - top).nan_to_num(0.0)[..., None]
            row_max = top
        # Rows that saw no key give 0 and LSE -inf; NaN (from NaN inputs) stays NaN.
        unseen = row_sum == 0
        out[..., m_start:m_end, :] = torch.where(
            unseen[..., None], 0.0, acc / torch.where(unseen, torch.ones_like(row_sum), row_sum)[..., None]
        )
        lse[..., m_start:m_end] = torch.where(unseen, float("-inf"), row_max + torch.log(row_sum))
    return out, lse
