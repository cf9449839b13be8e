"""Online softmax over WGMMA accumulator fragments (the FlashAttention recurrence).

For each query row the kernel keeps a running maximum m and a running sum l of exp(s - m).
When a new key block raises m, everything accumulated so far (l and the output rows) is
multiplied by exp(m_old - m_new). Scores are kept unscaled; the softmax scale is folded into
the exponent as scale * log2(e) so that each element costs one FFMA and one EX2.

A row is spread over the 4 threads of a quad, so the maximum is reduced across the quad on
every block, while the sum stays per-thread until `finalize` (the per-thread partial sums are
rescaled by the same factor, so reducing them once at the end gives the same result).

Bounded scores (a softcap's c * tanh(.) lies in [-c, c]) need no running maximum where P's
type has float32's exponent range (bf16): with a fixed exponent offset M every exp2(s - M)
stays a normal number and the row sum cannot overflow (ScoreTransform.bounded_offset_log2),
so the maximum's reduction, its shuffles and O's rescaling drop out of the loop. The row's
largest probability is then no longer exactly 1, so its 16-bit rounding in P V would no
longer cancel against the float32 row sum (a row that sees one key would get O = V (1 + up to
2^-9)): O is normalised by the sum of the rounded probabilities instead, and the LSE taken
from the exact sum.
"""

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.layouts import acc_as_rows_cols
from cute_flash.kernels.ptx import bf16_of_pair, exp2_fma, exp2_fma_bounded, pack_half2

LN_2 = math.log(2.0)
# The A/B switch of perf/experiments/softcap_tiles.py: bounded scores' exp2 on the FMA pipe
# through exp2_fma_bounded (seven instructions, bf16 P's accuracy) rather than the general
# exp2_fma (ten, float32's).
BOUNDED_EXP2_FOLDED = True


@dataclass
class OnlineSoftmax:
    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor
    # (a, b): in blocks stepped with a `transform`, the first a of every b columns of a row
    # take exp2 on the FMA pipe (ptx.exp2_fma) instead of the SFU; None: all on the SFU
    # (ScoreTransform.fma_exp2_columns).
    fma_columns: cutlass.Constexpr = None
    # Bounded scores (module docstring): the fixed exponent offset M (a Python float), else None.
    # Then row_max is unused and rounded_sum holds the sum of the bf16-rounded probabilities,
    # unless the kernel sums them on the tensor cores (rounded_sums_by_mma: finalize's
    # rounded_sums; kernels/probability_sums.py).
    offset_log2: cutlass.Constexpr = None
    rounded_sum: cute.Tensor = None
    rounded_sums_by_mma: cutlass.Constexpr = False

    @staticmethod
    def create(scale_log2: Float32, num_rows: cutlass.Constexpr[int], fma_columns=None,
               offset_log2=None, rounded_sums_by_mma=False) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        rounded_sum = None
        if offset_log2 is not None and not rounded_sums_by_mma:
            rounded_sum = cute.make_rmem_tensor(num_rows, Float32)
        return OnlineSoftmax(scale_log2, row_max, row_sum, fma_columns, offset_log2, rounded_sum,
                             rounded_sums_by_mma)

    @property
    def rescales(self) -> bool:
        """Whether step() returns row scales for O (a running maximum), else None."""
        return self.offset_log2 is None

    @cute.jit
    def step(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool], transform=None,
             transform_scale=None) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return each row's O rescale.

        transform (a ScoreTransform, or None): acc_s holds raw scores of an unmasked block, to
        be transformed (transform.value(s, transform_scale)) on the way: the row maximum is
        taken over the raw scores and transformed once (the transform is monotone), so it
        does not wait for every score's transform (a softcap's tanh on the SFU)."""
        if cutlass.const_expr(self.offset_log2 is not None):
            self._step_bounded(acc_s, is_first, transform, transform_scale)
            return None
        s_rows = acc_as_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            new_max = _reduce_row(s_rows, r, cute.arch.fmax)
            if cutlass.const_expr(transform is not None):
                new_max = cute.arch.warp_reduction_max(new_max, threads_in_group=4)
                new_max = transform.value(new_max, transform_scale)
            if cutlass.const_expr(not is_first):
                new_max = cute.arch.fmax(new_max, self.row_max[r])
            if cutlass.const_expr(transform is None):
                new_max = cute.arch.warp_reduction_max(new_max, threads_in_group=4)
            old_max = self.row_max[r]
            self.row_max[r] = new_max
            # A row whose keys are all masked so far has max -inf; subtracting 0 instead keeps
            # exp2 at 0 for it rather than producing NaN from (-inf) - (-inf).
            safe_max = new_max if new_max != -Float32.inf else Float32(0.0)
            max_scaled = safe_max * self.scale_log2
            if cutlass.const_expr(transform is not None):
                for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
                    s_rows[r, c] = transform.value(s_rows[r, c], transform_scale)
            if cutlass.const_expr(transform is None or self.fma_columns is None):
                s_rows[r, None].store(
                    cute.math.exp2(s_rows[r, None].load() * self.scale_log2 - max_scaled, fastmath=True)
                )
            else:
                # Unmasked: no -inf, for which exp2_fma would give 2^-125.
                _exp2_row_split(s_rows, r, self.scale_log2, max_scaled, self.fma_columns)
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = _reduce_row(s_rows, r, lambda a, b: a + b)
            else:
                # exp2(0) is exactly 1 when the max did not move, which lets the caller skip
                # rescaling O without changing a bit of the result.
                row_scale[r] = cute.math.exp2((old_max - safe_max) * self.scale_log2, fastmath=True)
                # The rescaled running sum starts the block's sum instead of being added after
                # it: ptxas then issues more of the block's exp2 work before the wait for the
                # previous P V (SASS: 157 instead of 124 instructions at bf16 D = 128 causal),
                # 1-4 % faster causal, 0.5-1.4 % full (perf/NOTES.md, thirty-fourth session).
                self.row_sum[r] = _reduce_row(s_rows, r, lambda a, b: a + b, self.row_sum[r] * row_scale[r])
        return row_scale

    @cute.jit
    def _step_bounded(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool], transform, transform_scale):
        """step() with the fixed offset: P = exp2(s * scale_log2 - M) in place, rounded to bf16
        (values P V reads exactly), both sums accumulated."""
        s_rows = acc_as_rows_cols(acc_s)
        offset = Float32(self.offset_log2)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            if cutlass.const_expr(transform is not None):
                for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
                    s_rows[r, c] = transform.value(s_rows[r, c], transform_scale)
            if cutlass.const_expr(transform is None or self.fma_columns is None):
                s_rows[r, None].store(cute.math.exp2(s_rows[r, None].load() * self.scale_log2 - offset, fastmath=True))
            elif cutlass.const_expr(BOUNDED_EXP2_FOLDED):
                # Unmasked: every exponent lies in [-125, 64], what exp2_fma_bounded asks.
                _exp2_row_split(s_rows, r, self.scale_log2, offset, self.fma_columns, int(self.offset_log2))
            else:
                # Unmasked (exp2_fma has no 0): every exponent lies in [-125, 64].
                _exp2_row_split(s_rows, r, self.scale_log2, offset, self.fma_columns)
            self.row_sum[r] = _reduce_row(s_rows, r, lambda a, b: a + b, None if is_first else self.row_sum[r])
            if cutlass.const_expr(not self.rounded_sums_by_mma):
                for c in cutlass.range_constexpr(0, cute.size(s_rows, mode=[1]), 2):
                    pair = pack_half2(s_rows[r, c], s_rows[r, c + 1], cutlass.BFloat16)
                    s_rows[r, c] = bf16_of_pair(pair, "low")
                    s_rows[r, c + 1] = bf16_of_pair(pair, "high")
                self.rounded_sum[r] = _reduce_row(s_rows, r, lambda a, b: a + b,
                                                  None if is_first else self.rounded_sum[r])

    @cute.jit
    def finalize(self, sink_log2=None, row_sinks_log2=None, rounded_sums=None) -> cute.Tensor:
        """Reduce row sums over the quad; return 1/l per row and leave the natural-log LSE in
        row_sum. A row that saw no key gets 1/l = 0 (so O = 0) and LSE = -inf.

        sink_log2 (a sink logit times log2(e), or None): one more term of every row's
        denominator, without a value. It is combined at the larger of the two maxima, so a
        sink far above every score cannot overflow: then O -> 0 and LSE -> the sink.
        row_sinks_log2: instead, one such value per row of this thread (rows of several query
        heads: grouped rows). rounded_sums: with rounded_sums_by_mma, each row's whole sum of
        the rounded probabilities (ProbabilitySums.row_sums)."""
        inv_sum = cute.make_rmem_tensor_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            # What O is divided by: the sum of the probabilities P V used (bounded scores), or
            # the exact sum, whose largest term (1) has no rounding.
            normaliser = total
            if cutlass.const_expr(self.offset_log2 is not None):
                if cutlass.const_expr(self.rounded_sums_by_mma):
                    normaliser = rounded_sums[r]
                else:
                    normaliser = cute.arch.warp_reduction_sum(self.rounded_sum[r], threads_in_group=4)
                max_scaled = Float32(self.offset_log2)
            else:
                # -inf for a row that saw no key: its terms vanish (a sink's stays).
                max_scaled = self.row_max[r] * self.scale_log2
            empty = total == Float32(0.0) or total != total
            sink = sink_log2 if cutlass.const_expr(row_sinks_log2 is None) else row_sinks_log2[r]
            if cutlass.const_expr(sink is None):
                inv_sum[r] = Float32(0.0) if empty else cute.arch.rcp_approx(normaliser)
                lse = (max_scaled + cute.math.log2(total, fastmath=True)) * LN_2
                self.row_sum[r] = -Float32.inf if empty else lse
            else:
                top = cute.arch.fmax(max_scaled, sink)
                rows_part = cute.math.exp2(max_scaled - top, fastmath=True)
                sink_part = cute.math.exp2(sink - top, fastmath=True)
                total = total * rows_part + sink_part
                inv_sum[r] = rows_part * cute.arch.rcp_approx(normaliser * rows_part + sink_part)
                self.row_sum[r] = (top + cute.math.log2(total, fastmath=True)) * LN_2
        return inv_sum


def _exp2_row_split(rows_cols: cute.Tensor, r: int, scale_log2, max_scaled, fma_columns, bounded_offset=None):
    """Row r in place: exp2(s * scale_log2 - max_scaled), the first a of every b columns
    (fma_columns = (a, b)) on the FMA pipe, the rest on the SFU. bounded_offset (an int, the
    value of max_scaled): exponents known to lie in [-125, 64] take exp2_fma_bounded. Plain
    Python: unrolls at trace time."""
    on_fma, period = fma_columns
    for c in range(cute.size(rows_cols, mode=[1])):
        if c % period >= on_fma:
            rows_cols[r, c] = cute.math.exp2(rows_cols[r, c] * scale_log2 - max_scaled, fastmath=True)
        elif bounded_offset is not None:
            rows_cols[r, c] = exp2_fma_bounded(rows_cols[r, c], scale_log2, bounded_offset)
        else:
            rows_cols[r, c] = exp2_fma(rows_cols[r, c] * scale_log2 - max_scaled)


def _reduce_row(rows_cols: cute.Tensor, r: int, op, init=None) -> Float32:
    """Reduce one row of this thread with four independent chains (ILP) instead of one; init
    (or None) joins the first chain first.

    Plain Python on purpose: it runs at trace time and unrolls fully.
    """
    n = cute.size(rows_cols, mode=[1])
    lanes = 4 if n % 4 == 0 else 1
    partial = [rows_cols[r, j] for j in range(lanes)]
    if init is not None:
        partial[0] = op(init, partial[0])
    for c in range(lanes, n, lanes):
        for j in range(lanes):
            partial[j] = op(partial[j], rows_cols[r, c + j])
    while len(partial) > 1:
        partial = [op(partial[i], partial[i + 1]) for i in range(0, len(partial), 2)]
    return partial[0]


@cute.jit
def rescale_rows_if_needed(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """Multiply O's rows by row_scale, skipped when no row of the warp changed its max.

    Once a few key blocks have been seen the running max rarely moves, so most blocks skip
    the 64-plus FMULs; the vote keeps the branch warp-uniform.
    """
    changed = row_scale[0] != Float32(1.0)
    for r in cutlass.range_constexpr(1, cute.size(row_scale)):
        changed = changed | (row_scale[r] != Float32(1.0))
    if cute.arch.vote_any_sync(changed):
        rescale_rows(acc_o, row_scale)


@cute.jit
def rescale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    o_rows = acc_as_rows_cols(acc_o)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        o_rows[r, None].store(o_rows[r, None].load() * row_scale[r])
