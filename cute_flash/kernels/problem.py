"""The attention problem a kernel is compiled for: what of the math is fixed at compile time,
as one frozen value that the host layer builds once per call signature and every kernel,
block range and mask reads (and that compile keys contain), instead of loose bools threaded
through each layer.

* The mask: a band around the diagonal. Query i sees key j iff
      i + offset - left <= j <= i + offset + right   (and j < Sk),
  where a missing bound is unbounded, `causal` is right = 0, and the diagonal's offset is 0
  (top-left alignment, SDPA's is_causal) or Sk - Sq (bottom-right, flash-attn's and every
  KV cache's). The offset is a run-time value (Sq and Sk are); the bounds are compile-time.
  block_ranges.py and mask.py are the only readers of the mask's shape.
* softcap: scores s become softcap * tanh(s / softcap) before the softmax (0: off).
* sink: a per-head logit that joins each row's softmax denominator (the kernels take the
  (N,) float32 tensor; the flag says whether to read it).
* grouped: k and v have fewer heads than q (GQA / MQA); query head h reads key/value head
  h // (N / Nkv). The group size is a run-time value.
* packed: the batch's sequences lie one after the other along one token axis (flash-attn's
  "varlen"), their bounds read on the device from cu_seqlens (kernels/sequences.py); with
  keys_used a sequence's keys end after seqused_k[b] of them.
* cached_keys: the queries are a dense batch (B, N, Sq, D) but the keys and values a KV
  cache: sequence b's keys start at row cu_seqlens_k[b] of the packed (total, Nkv, D) cache
  (or in its pages) and number seqused_k[b] (keys_used). The forward only (inference).
* page_size: the keys and values lie in pages of that many rows, a page table (B, max_pages)
  listing each sequence's pages (a paged KV cache; kernels/key_pages.py); 0: in rows. Needs
  keys_used with a packed batch or cached keys (the forward only: caches are for inference).
* split_keys: each sequence's key blocks are divided among `splits` CTAs (split-KV; a run-time
  count: the output's batch mode holds B x splits entries, sequence b's part s at b * splits + s),
  each writing an O normalised over its part and its LSE, which kernels/split_merge.py merges.
  A part is a run of the blocks the tile would walk. Dense queries: over cached keys (a KV
  cache's decode step), or as grouped rows over a dense batch's keys (flash_attention's decode
  steps with few (batch, key/value head) units). A sink joins the merged denominator, once: the
  parts leave it out and the merge adds it.
* grouped_rows: a key/value head's group of query heads at every query position are one
  sequence's rows, group-major (row r: query head kv_head * group + r // Sq, position r % Sq),
  so that one CTA reads the keys once for the group (decoding several tokens per step). The
  masks and key ranges see positions; Sq and the group come from the LSE, which the kernel
  writes in the (B, N, Sq) layout. Dense queries (over cached keys or a dense batch, not
  packed) and heads equal in the kernel's view (not grouped); a sink is per row (its query
  head's). The forward only.
* row_heads: G >= 2 (0: off), a compile-time group size: a key/value head's G query heads at
  each query position are G consecutive rows of a tile, position-major (row r: query head
  kv_head * G + r % G, position r // G), so that a tile of block_m rows covers block_m / G
  positions of the whole group and loads each key block once for it. Prefill with grouped
  heads: a narrow window's key range follows the tile's positions, block_m / G of them, not
  block_m (gpt-oss's 128-key window). q and O keep their (B, N, S, D) layout (the TMA boxes
  take the (G, positions) rows as two modes); not grouped in the kernel's view. Packed batches
  too: there the positions are each sequence's, and a decode-like batch (a few queries per
  sequence) reads each sequence's keys once per group instead of once per query head.
  The forward only.

Plain Python, no DSL and no torch: the host imports it without either.
"""

from dataclasses import dataclass, fields, replace
from functools import lru_cache

ALIGNMENTS = ("top_left", "bottom_right")
# Grouped rows (grouped_rows) for steps of up to this many query positions (several tokens per
# step: speculative decoding): a tile must hold rows of every position (block_m >= Sq,
# head_mapping.HeadMapping.band), and beyond a few positions the group's tiles fill the GPU
# without it.
GROUPED_ROWS_MAX_SQ = 16


@dataclass(frozen=True)
class AttentionProblem:
    causal: bool = False  # right bound 0
    window_left: int = -1  # keys more than this before the diagonal are masked; -1: unbounded
    window_right: int = -1  # keys more than this after the diagonal are masked; -1: unbounded (or causal)
    bottom_right: bool = False  # the diagonal is key i + Sk - Sq for query i
    softcap: float = 0.0
    sink: bool = False
    grouped: bool = False
    packed: bool = False
    keys_used: bool = False
    cached_keys: bool = False
    page_size: int = 0
    split_keys: bool = False
    grouped_rows: bool = False
    row_heads: int = 0

    def __post_init__(self):
        for name in ("causal", "bottom_right", "sink", "grouped", "packed", "keys_used", "cached_keys", "split_keys",
                     "grouped_rows"):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if type(value) is not int or value < -1:
                raise ValueError(f"{name} must be an int >= -1 (-1: unbounded), got {value!r}")
        if self.causal and self.window_right != -1:
            raise ValueError("a causal problem has no separate right window (causal is window_right = 0)")
        if type(self.softcap) is not float or not self.softcap >= 0.0 or self.softcap == float("inf"):
            raise ValueError(f"softcap must be a finite float >= 0, got {self.softcap!r}")
        if self.keys_used and not (self.packed or self.cached_keys):
            raise ValueError("keys_used (seqused_k) needs a packed batch or cached keys")
        if self.cached_keys and (self.packed or not self.keys_used):
            raise ValueError("cached_keys needs keys_used (each sequence's length) and dense queries (not packed)")
        if type(self.page_size) is not int or self.page_size < 0:
            raise ValueError(f"page_size must be an int >= 0 (0: not paged), got {self.page_size!r}")
        if self.page_size and not self.keys_used:
            raise ValueError("a paged problem (page_size) needs keys_used (each sequence's length)")
        if self.split_keys and not (self.cached_keys or self.grouped_rows):
            raise ValueError("split_keys needs dense queries over cached keys or as grouped rows")
        if type(self.row_heads) is not int or self.row_heads == 1 or self.row_heads < 0:
            raise ValueError(f"row_heads must be an int >= 2 (0: off), got {self.row_heads!r}")
        if self.row_heads and (self.grouped or self.grouped_rows or self.cached_keys or self.split_keys):
            raise ValueError("row_heads needs equal heads in the kernel's view (the group is in the rows), not "
                             "grouped_rows, cached keys or split keys")
        if self.grouped_rows and (self.packed or self.grouped):
            raise ValueError("grouped_rows needs dense queries and equal heads in the kernel's view (the group is in "
                             "the rows)")
        # The eager fast path hashes the problem on every call (it is part of api.call_signature,
        # the plan cache's key): a precomputed hash costs about half the generated one.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self):
        return self._hash

    # The mask, as the kernels read it (compile-time values; None: unbounded).

    @property
    def right(self):
        return 0 if self.causal else (None if self.window_right < 0 else self.window_right)

    @property
    def left(self):
        return None if self.window_left < 0 else self.window_left

    @property
    def band(self) -> bool:
        """Whether the mask has an edge besides the key tail (causal or a window)."""
        return self.left is not None or self.right is not None

    def with_group_in_rows(self, group: int) -> "AttentionProblem":
        """This grouped problem with each key/value head's `group` query heads as consecutive
        rows of its tiles instead (row_heads): the forward of a banded grouped prefill
        (api._rows_problem) or of a packed batch (launch_fwd.packed_kernel_problem). Cached:
        the hosts ask on every call."""
        return _with_group_in_rows(self, group)

    def aligned_bottom_right(self) -> "AttentionProblem":
        """This problem with bottom-right alignment: the same mask where every sequence has as
        many queries as keys, and what a band forward runs there to align its tiles to each
        sequence's end (kernels/sequences.py, SequenceLayout.aligned_to_end;
        launch_fwd.end_aligned_problem). Cached: the hosts ask on every call."""
        return _aligned_bottom_right(self)

    @property
    def tiles_end_aligned(self) -> bool:
        """Whether a 16-bit forward of this problem ends its band tiles at each sequence's last
        query (SequenceLayout.aligned_to_end): a band under bottom-right alignment, not grouped
        rows (their rows cycle through the positions), split keys or queries over a cache."""
        return self.bottom_right and self.band and not (self.grouped_rows or self.split_keys or self.cached_keys)

    def end_aligned(self, equal_lengths: bool, sixteen_bit: bool) -> "AttentionProblem":
        """The problem a forward of this one runs: bottom-right, whose band tiles end at each
        sequence's last query (tiles_end_aligned), where a top-left band has as many queries
        as keys in every sequence (equal_lengths: the same mask), 16-bit inputs only (float32's
        kernels keep their tiles aligned to the start); itself otherwise. The backward keeps
        this problem (launch_fwd.end_aligned_problem)."""
        if equal_lengths and sixteen_bit and self.band and not self.bottom_right:
            aligned = self.aligned_bottom_right()
            if aligned.tiles_end_aligned:
                return aligned
        return self

    @staticmethod
    def of(causal=False, window_size=(-1, -1), alignment="top_left", softcap=0.0, sink=False,
           grouped=False, packed=False, keys_used=False, page_size=0, cached_keys=False,
           split_keys=False, grouped_rows=False, row_heads=0) -> "AttentionProblem":
        """The shared problem of a call's public arguments (no new object per call: the host's
        per-call cost), canonical so that equal masks share kernels: a right window of 0 is
        causal, and without a bound the alignment does not matter. Arguments are checked by
        cute_flash.validation first; `causal` may be any truthy value."""
        return _problem(bool(causal), tuple(window_size), alignment, float(softcap), bool(sink), bool(grouped),
                        bool(packed), bool(keys_used), int(page_size), bool(cached_keys), bool(split_keys),
                        bool(grouped_rows), int(row_heads))


@lru_cache(maxsize=1024)
def _problem(causal, window_size, alignment, softcap, sink, grouped, packed, keys_used, page_size, cached_keys,
             split_keys, grouped_rows, row_heads):
    left, right = (int(w) for w in window_size)
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if right == 0:
        causal = True
    if causal:
        right = -1
    bounded = causal or left >= 0 or right >= 0
    return AttentionProblem(causal=causal, window_left=left, window_right=right,
                            bottom_right=bounded and alignment == "bottom_right", softcap=softcap, sink=sink,
                            grouped=grouped, packed=packed, keys_used=keys_used, cached_keys=cached_keys,
                            page_size=page_size, split_keys=split_keys, grouped_rows=grouped_rows,
                            row_heads=row_heads)


@lru_cache(maxsize=256)
def _aligned_bottom_right(problem: AttentionProblem) -> AttentionProblem:
    return replace(problem, bottom_right=True)


@lru_cache(maxsize=256)
def _with_group_in_rows(problem: AttentionProblem, group: int) -> AttentionProblem:
    return replace(problem, grouped=False, row_heads=group)
