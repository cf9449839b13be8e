"""Where a batch entry's queries and keys lie: the one reader of problem.packed.

* Dense batches (the default): q is (B, N, Sq, D) and every sequence has Sq queries and Sk
  keys; the kernels' views are (S, D, N, B) and a (head, batch) slice is an (S, D) matrix.
* Packed batches (problem.packed, flash-attn's "varlen"): the sequences lie one after the
  other along one token axis, q (total_q, N, D) and k, v (total_k, Nkv, D), and sequence b
  owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (keys likewise; with problem.keys_used
  only the first seqused_k[b] of its keys). The host passes them as a batch of one,
  (1, N, total, D), so the kernels' views keep their rank; the offsets are read on the device
  (no host sync) and a sequence's slice is the packed matrix shifted by its first row.

The backward's padded per-row buffers (LSE * log2(e), delta, the dQ accumulator; dense:
Sq_pad rows per (batch, head)) give each packed sequence a region of its own:
seqlen_pad.PACKED_REGION_EXTRA rows more than its length, from row cu_seqlens_q[b] (rounded
up to 16 bytes) + b * seqlen_pad.PACKED_ROW_SLACK (`stat_offset`), which its blocks never
leave.

What a packed tile must not do: write past its sequence's last query row (those rows belong
to the next sequence: the forward stores O with per-row predicates instead of a TMA store
that clips only at the tensor's end), or use keys past its sequence's last key (the key-tail
mask, with the sequence's own length, hides them; block_ranges makes the block that holds
the tail a masked one). Reading them is harmless: they are the neighbours' rows, or TMA's
zero fill past the tensor.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.head_mapping import HeadMapping
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.seqlen_pad import PACKED_REGION_EXTRA, packed_region_start


def _clamped(offset, low, high):
    """A packed offset clamped into [low, high]: offsets that break the documented contract
    (monotone, within the totals) give wrong rows, never accesses out of bounds."""
    return cutlass.min(cutlass.max(offset, low), high)


class PackedBatch(NamedTuple):
    """The backward kernels' packed-batch argument (torch passes a plain tuple; None for a
    dense batch, kernels/optional_arguments.py)."""
    cu_seqlens_q: cute.Tensor  # (B + 1,) int32
    cu_seqlens_k: cute.Tensor  # (B + 1,) int32
    seqused_k: cute.Tensor  # (B,) int32, read with problem.keys_used


class Sequence(NamedTuple):
    """One batch entry: its first query row and key row in the (packed) tensors (a paged
    cache's keys: logical key 0, kernels/key_pages.py), its lengths, its index along the
    inputs' batch mode (0 when packed), its first row in the backward's padded per-row
    buffers, its number in the batch (its page-table row), its index along the forward's
    output (O, LSE) batch mode, and which part of its keys the CTA walks, of how many
    (problem.split_keys; else 0 of 1); and how many query positions of its first tile lie
    before its first query (a packed forward's tiles aligned to its end: SequenceLayout.
    aligned_to_end; else 0)."""
    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32
    batch: Int32
    stat_offset: Int32
    index: Int32
    out_batch: Int32
    split: Int32
    splits: Int32
    skipped: Int32 = 0


class SequenceLayout:
    def __init__(self, problem: AttentionProblem):
        self.packed = problem.packed
        self.cached_keys = problem.cached_keys  # dense queries, keys read from a cache
        self.keys_used = problem.keys_used
        self.page_size = problem.page_size
        self.split_keys = problem.split_keys
        self.heads = HeadMapping(problem)  # q's view has rows of (G, S) pairs with row_heads
        # A forward's band tiles may end at each sequence's last query (aligned_to_end).
        self.tiles_end_aligned = problem.tiles_end_aligned

    def output_batches(self, mQ: cute.Tensor, mLSE: cute.Tensor, cu_seqlens_q):
        """Entries of the forward's grid along the batch: the sequences (the tensors' batch
        mode, or len(cu_seqlens_q) - 1 in a packed batch), or with split keys the output's
        batch mode (B x splits; mLSE: the (S, N, B) view)."""
        if const_expr(self.split_keys):
            return mLSE.shape[2]
        if const_expr(self.packed):
            return cu_seqlens_q.shape[0] - 1
        return mQ.shape[3]

    @cute.jit
    def of(self, batch, mQ: cute.Tensor, mK: cute.Tensor, gmem) -> Sequence:
        """The bounds of batch entry `batch` (mQ, mK: the kernel's (S, D, N, B) views; gmem:
        the kernel's tensors, whose fields cu_seqlens_q, cu_seqlens_k ((B + 1,) int32),
        seqused_k ((B,) int32) and page_table ((B, max_pages) int32) a packed kernel reads).
        With split keys `batch` numbers the output's entries (output_batches): part
        batch % splits of sequence batch // splits, splits = the output's entries / B."""
        if const_expr(self.packed):
            return self._packed_sequence(batch, *self._bounds(batch, gmem), mQ, mK, gmem)
        if const_expr(self.split_keys):
            splits = gmem.lse.shape[2] // mQ.shape[3]
            index = batch // splits
            offset_k, seqlen_k = Int32(0), mK.shape[0]  # a dense batch's keys: all of them
            if const_expr(self.cached_keys):
                offset_k, seqlen_k = self._keys(index, mK, gmem)
            return Sequence(Int32(0), mQ.shape[0], offset_k, seqlen_k, index, Int32(0), index, batch,
                            batch - index * splits, splits)
        if const_expr(self.cached_keys):
            offset_k, seqlen_k = self._keys(batch, mK, gmem)
            return Sequence(Int32(0), mQ.shape[0], offset_k, seqlen_k, batch, Int32(0), batch, batch, Int32(0),
                            Int32(1))
        return Sequence(Int32(0), self.heads.positions(mQ), Int32(0), mK.shape[0], batch, Int32(0), batch, batch,
                        Int32(0), Int32(1))

    @cute.jit
    def _keys(self, batch, mK: cute.Tensor, gmem):
        """(first key row, key count) of a sequence whose keys lie at offsets (packed, or a
        cache)."""
        _, _, start_k, end_k, used = self._bounds(batch, gmem)
        return self._keys_from(start_k, end_k, used, mK, gmem)

    @cute.jit
    def _bounds(self, batch, gmem):
        """What sequence `batch`'s bounds are made of, as stored: (cu_seqlens_q[b],
        cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1], seqused_k[b]); each entry is
        read only where the problem has that tensor (else 0), and q's only when packed."""
        start_q, end_q, start_k, end_k, used = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
        if const_expr(self.packed):
            start_q = gmem.cu_seqlens_q[batch]
            end_q = gmem.cu_seqlens_q[batch + 1]
        if const_expr(self.page_size == 0):
            start_k = gmem.cu_seqlens_k[batch]
            if const_expr(not self.keys_used):
                end_k = gmem.cu_seqlens_k[batch + 1]
        if const_expr(self.keys_used or self.page_size > 0):
            used = gmem.seqused_k[batch]
        return start_q, end_q, start_k, end_k, used

    @cute.jit
    def _keys_from(self, start_k, end_k, used, mK: cute.Tensor, gmem):
        """(first key row, key count) from _bounds' entries, clamped into the packed key tensor:
        offsets that break the contract give wrong rows, never an access outside it."""
        if const_expr(self.page_size > 0):
            # Logical keys 0 .. seqused_k[b] - 1, at most what its row of pages holds.
            return Int32(0), _clamped(used, 0, gmem.page_table.shape[1] * self.page_size)
        total_k = mK.shape[0]
        offset_k = _clamped(start_k, 0, total_k)
        if const_expr(self.keys_used):
            return offset_k, _clamped(used, 0, total_k - offset_k)
        return offset_k, _clamped(end_k, offset_k, total_k) - offset_k

    @cute.jit
    def _packed_sequence(self, batch, start_q, end_q, start_k, end_k, used, mQ: cute.Tensor, mK: cute.Tensor,
                         gmem) -> Sequence:
        """The Sequence of packed batch entry `batch` from its _bounds (clamped into the packed
        tensors, _clamped)."""
        total_q = self.heads.positions(mQ)
        offset_q = _clamped(start_q, 0, total_q)
        seqlen_q = _clamped(end_q, offset_q, total_q) - offset_q
        offset_k, seqlen_k = self._keys_from(start_k, end_k, used, mK, gmem)
        return Sequence(offset_q, seqlen_q, offset_k, seqlen_k, Int32(0), packed_region_start(offset_q, batch), batch,
                        Int32(0), Int32(0), Int32(1))

    @cute.jit
    def aligned_to_end(self, seq: Sequence, positions: cutlass.Constexpr[int]) -> Sequence:
        """A sequence (packed or dense) as the forward's band tiles see it with tiles_end_aligned:
        its first tile starts `skipped` positions before its first query, so that its last tile
        ends at its last query. Under a band (causal, a window) the partial tile is the one
        that sees the fewest keys: aligned to the start, the last tile, which sees every key,
        computed up to 191 rows of nothing over all of them (192-row tiles on issue 22's
        long-tailed batch: 10.8 % of the computed scores wasted, 6.7 % aligned to the end;
        perf/NOTES.md, sixtieth session). With bottom-right alignment the band's offset,
        seqlen_k - seqlen_q, follows the longer seqlen_q: the skipped positions see no key.
        They are never stored (the epilogue's lower row bound), and what their Q rows hold
        (the previous sequence's rows, or TMA's zero fill before row 0) is masked."""
        skipped = (positions - seq.seqlen_q % positions) % positions
        return seq._replace(offset_q=seq.offset_q - skipped, seqlen_q=seq.seqlen_q + skipped, skipped=skipped)

    @cute.jit
    def has_rows(self, m_block, block_m: cutlass.Constexpr[int], seq: Sequence):
        """Whether query block m_block holds rows of the sequence (a packed grid has tiles to
        spare; a dense batch's grid covers exactly Sq: a compile-time True)."""
        if const_expr(self.packed):
            return m_block >= 0 and m_block * self.heads.positions_per_tile(block_m) < seq.seqlen_q
        return True

    def rows(self, t: cute.Tensor, head, seq: Sequence, keys: bool = False) -> cute.Tensor:
        """The sequence's (S, D) matrix of head `head` in a kernel view t (S, D, N, B), its
        row 0 the sequence's first query (or key, with keys=True); with row_heads q's and O's
        ((G, S), D) rows from its first position's."""
        if const_expr(self.packed or (keys and self.cached_keys)):
            first = seq.offset_k if keys else seq.offset_q
            if const_expr(self.heads.row_heads and not keys):
                first = (0, first)  # q's and O's rows as (G, positions) pairs (HeadMapping.rows_view)
            return cute.domain_offset((first, 0), t[None, None, head, 0])
        if const_expr(self.tiles_end_aligned and not keys):
            return self._from_first_query(t[None, None, head, seq.batch], seq)
        return t[None, None, head, seq.batch]

    def output_rows(self, t: cute.Tensor, head, seq: Sequence) -> cute.Tensor:
        """rows() of the forward's output O (S, D, N, B_out): with split keys the CTA's
        part's entry."""
        if const_expr(self.packed):
            return self.rows(t, head, seq)
        if const_expr(self.tiles_end_aligned):
            return self._from_first_query(t[None, None, head, seq.out_batch], seq)
        return t[None, None, head, seq.out_batch]

    def _from_first_query(self, rows: cute.Tensor, seq: Sequence) -> cute.Tensor:
        """A dense batch entry's q or O rows from its first tile's first row: offset_q, below 0
        where the tiles end at the last query (aligned_to_end; TMA fills the rows before row 0
        with zeros and does not store them), else 0."""
        first = (0, seq.offset_q) if const_expr(self.heads.row_heads) else seq.offset_q
        return cute.domain_offset((first, 0), rows)

    @cute.jit
    def has_keys(self, n_block, block_n: cutlass.Constexpr[int], seq: Sequence):
        """Whether key block n_block holds keys of the sequence (a compile-time True for a
        dense batch)."""
        if const_expr(self.packed):
            return n_block >= 0 and n_block * block_n < seq.seqlen_k
        return True

    def counter_batch(self, batch):
        """The row of the backward's per-(batch, head) dQ counters a sequence counts in: a
        packed batch counts per head (row 0): every CTA of its compact grid counts once,
        whatever the offsets' values, so the postprocess's wait never depends on them."""
        if const_expr(self.packed):
            return 0
        return batch

    def region_rows(self, seqlen_q):
        """Rows of a packed sequence's region in the padded per-row buffers."""
        return seqlen_q + PACKED_REGION_EXTRA

    def padded_rows(self, t: cute.Tensor, head, seq: Sequence) -> cute.Tensor:
        """The sequence's (rows, D) matrix of head `head` in a padded buffer (S_pad, D, N, B)
        (the dQ accumulator), its row 0 the sequence's first query."""
        if const_expr(self.packed):
            return cute.domain_offset((seq.stat_offset, 0), t[None, None, head, 0])
        return t[None, None, head, seq.batch]

    def padded_stats(self, t: cute.Tensor, head, seq: Sequence) -> cute.Tensor:
        """The sequence's vector of head `head` in a padded per-row buffer (S_pad, N, B)."""
        if const_expr(self.packed):
            return cute.domain_offset((seq.stat_offset,), t[None, head, 0])
        return t[None, head, seq.batch]

    # Packed grids without empty CTAs: sequence b owns the block numbers [s_b, s_b +
    # ceil(len_b / block) + extra) with s_b = (cu_seqlens[b] + b * (1 + extra) * block) //
    # block, disjoint ranges that end by total // block + (1 + extra) * B, a bound the host has
    # without reading the offsets (`extra` blocks per sequence: the preprocess's regions).

    def block_numbers(self, total, block: int, num_batches, extra: int = 0):
        """How many block numbers a packed grid has per head."""
        return total // block + (1 + extra) * num_batches

    @cute.jit
    def locate(self, number, block: cutlass.Constexpr[int], keys: cutlass.Constexpr[bool], mQ: cute.Tensor,
               mK: cute.Tensor, gmem, extra: cutlass.Constexpr[int] = 0):
        """(Sequence, block index in it, rows) of a block number of a packed grid numbered over
        the queries (cu_seqlens_q; rows: the sequence's queries) or, with keys=True, the keys
        (cu_seqlens_k; rows: its offsets' span, 0 with seqused_k): `of` of the sequence found,
        whose index may lie past its rows (a number left over). A warp's lanes test up to 32 evenly spaced
        sequences per round, narrowing the range 32-fold, ceil(log32 B) rounds; each lane reads
        its candidate's bounds (_bounds) in the same round trip as the offset it tests, and the
        last round's winner hands them over by shuffles. (A search followed by `of` took one
        more memory round trip, and every round trip delays the tile's first TMA load: about
        0.2 us per tile, perf/NOTES.md, twenty-fifth session.) Every lane of the warp must take
        part. Offsets are clamped as `of` clamps them."""
        assert not (keys and self.page_size > 0), "a paged cache's keys are not numbered by offsets"
        cu_seqlens = gmem.cu_seqlens_k if const_expr(keys) else gmem.cu_seqlens_q
        total = mK.shape[0] if const_expr(keys) else self.heads.positions(mQ)
        num_batches = cu_seqlens.shape[0] - 1
        lane = cute.arch.lane_idx()
        lo = Int32(0)
        count = num_batches
        # The base-32 digits of B - 1, and at least one round (its reads carry the bounds).
        rounds = cutlass.max((32 - Int32(cute.arch.clz(num_batches - 1)) + 4) // 5, 1)
        start_q, end_q, start_k, end_k, used = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
        for _ in cutlass.range(rounds, unroll=1):
            stride = (count + 31) // 32
            candidate = lo + lane * stride
            at_or_below = cutlass.Boolean(False)
            c_start_q, c_end_q, c_start_k, c_end_k, c_used = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
            if candidate < lo + count:
                c_start_q, c_end_q, c_start_k, c_end_k, c_used = self._bounds(candidate, gmem)
                start = c_start_k if const_expr(keys) else c_start_q
                at_or_below = (_clamped(start, 0, total) + candidate * (1 + extra) * block) // block <= number
            won = cutlass.max(Int32(cute.arch.popc(cute.arch.vote_ballot_sync(at_or_below))) - 1, 0)
            lo = lo + won * stride
            count = cutlass.min(stride, count - won * stride)
            start_q = cute.arch.shuffle_sync(c_start_q, won)
            end_q = cute.arch.shuffle_sync(c_end_q, won)
            start_k = cute.arch.shuffle_sync(c_start_k, won)
            end_k = cute.arch.shuffle_sync(c_end_k, won)
            used = cute.arch.shuffle_sync(c_used, won)
        seq = self._packed_sequence(lo, start_q, end_q, start_k, end_k, used, mQ, mK, gmem)
        start = _clamped(start_k if const_expr(keys) else start_q, 0, total)
        end = _clamped(end_k if const_expr(keys) else end_q, start, total)
        return seq, number - (start + lo * (1 + extra) * block) // block, end - start
