"""What happens to a score between S = Q K^T and the softmax: nothing, or the softcap
(problem.softcap = c > 0, Gemma 2): s -> c * tanh(s * scale / c).

Scores stay unscaled in the kernels, the softmax scale folded into the exponent as
scale_log2 = scale * log2(e). With a softcap the kernels keep t = tanh(s * scale / c)
instead, and the exponent's factor becomes c * log2(e), a compile-time constant:
exp2(t * c * log2(e) - m) = exp(c * t - m'). The softcap comes before the mask (tanh(-inf)
is -1, not -inf). Its gradient: d(c * t)/ds = scale * (1 - t^2), and the kernels apply
`scale` to dK and dQ already, so the backward's dS gains the factor 1 - t^2. The backward
folds it into P as soon as P exists (P * (1 - t^2) in P's registers, after P's 16-bit copy
for dV is taken): keeping t or the factor beside P and dP until dS spills at D = 128.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.ptx import tanh_approx

LOG2_E = math.log2(math.e)

# With a softcap every score takes two SFU operations (tanh, exp2) against the tensor cores'
# 2 x 2 x D flops: at D = 128 the SFU is as busy as the tensor cores (ncu: the softcap's 26 %
# came with the SFU at 60 % of its peak, tensor cores 76 -> 59 %). In the blocks whose
# softmax takes the transform (OnlineSoftmax.step), the first a of every b columns take exp2
# on the FMA pipe instead. Each emulated exp2 takes issue slots the softmax also needs, so the
# share that pays falls as the tensor work per score (2 x 2 x D flops) grows and leaves the
# SFU slack, and rises as the emulation gets cheaper. {largest tile head dim: (a, b), or None
# for every exp2 on the SFU}, per emulation:
# - bounded scores (bf16; ptx.exp2_fma_bounded, seven instructions): bf16, (4 | 2, 32, 8192),
#   ratio to no softcap causal / full (perf/NOTES.md, sixty-fifth session): D = 64 2 of 4
#   (1.29 / 1.31 against 1 of 4's 1.35 / 1.38; whole pairs, as P is packed: 1 of 2 1.33 /
#   1.35); D = 96 1 of 4 (the others no better); D = 128 1 of 8 (1.12 / 1.18-1.20; 1 of 4
#   1.13 / 1.15-1.17, but it spilled a register around the loop of the packed 192 x 80 tile
#   with 16 query heads as rows, tests/test_sass.py); D = 192 2 of 16 (1.10 / 1.12 against
#   1 of 8's 1.11 / 1.14-1.15); D = 256 none (1 of 16 and 1 of 8 level, 1 of 4 3-4 % slower).
SOFTCAP_FMA_EXP2_COLUMNS = {64: (2, 4), 96: (1, 4), 128: (1, 8), 192: (2, 16), 256: None}
# - unbounded scores (fp16 on two-warpgroup tiles; ptx.exp2_fma, ten instructions): 1 of 4
#   was 0.4-3 % faster than none, 3/8 no better, 1/2 and 3/4 slower than none (twenty-first
#   session); D = 64 and 96: 1 of 4; D = 128 and 192: 1 of 8; D = 256: none (measured with
#   bf16's bounded scores on this emulation, sixty-fourth session). Measured on fp16 itself
#   (sixty-sixth session, (4 | 2, 32, 8192), cap 30, 7 rounds): at D = 128 and 192 none, 1 of
#   8 and 1 of 4 within 1.5 % of each other; fp16's three-warpgroup tiles (the D = 64 and 96
#   entries) keep the transform out of the softmax, so no share reaches them.
SOFTCAP_FMA_EXP2_COLUMNS_GENERAL = {96: (1, 4), 192: (1, 8), 256: None}

# Capped scores s in [-c, c] let the softmax run without a running maximum (OnlineSoftmax's
# bounded scores) where P has float32's exponent range: exp2(s * c_log2 - M) with
# c_log2 = c * log2(e) must stay normal at s = -c (-c_log2 - M >= -125: ex2.approx flushes
# below 2^-126, and a row whose every term flushed would read as empty) and leave room for the
# row sum and P V at s = c (c_log2 - M <= 64: 2^64 x 2^31 keys x |v|). So M = max(0,
# ceil(c_log2 - 64)), for c_log2 <= 94 (c <= 65; Gemma 2 uses 50).
BOUNDED_TOP_LOG2 = 64.0
BOUNDED_BOTTOM_LOG2 = -125.0
# The A/B switch of perf/experiments/softcap_bounded.py (False: always the running maximum).
BOUNDED_SOFTMAX = True


class ScoreTransform:
    def __init__(self, problem: AttentionProblem, float32_accurate: bool = False):
        """float32_accurate: tanh(x) as 1 - 2 / (2^(2 x log2 e) + 1) on the SFU's exp2 and
        reciprocal (absolute error ~2^-22, which the softmax's exponent sees) instead of its
        tanh (2^-11); for the float32-accurate forward (kernels/fwd_sm90.py's split operands),
        where the SFU's tanh alone left 1.6e-5 of LSE error with a softcap. (libdevice's tanhf
        is as accurate but spilled registers at D = 128.)"""
        self.softcap = problem.softcap
        self.float32_accurate = float32_accurate

    def fma_exp2_columns(self, head_dim: int, bounded: bool):
        """OnlineSoftmax's fma_columns for these scores on a tile of head dim `head_dim`, with
        a bounded softmax (bounded_offset_log2) or not: (a, b), the first a of every b columns
        off the SFU, or None."""
        if self.softcap and not self.float32_accurate:
            table = SOFTCAP_FMA_EXP2_COLUMNS if bounded else SOFTCAP_FMA_EXP2_COLUMNS_GENERAL
            return next(share for bound, share in sorted(table.items()) if head_dim <= bound)
        return None

    def bounded_offset_log2(self, p_dtype):
        """OnlineSoftmax's offset_log2 for P of type p_dtype: M (above), or None where the
        scores are unbounded, P is not bf16 (fp16's exponent range is too small) or the cap
        too large."""
        if not (BOUNDED_SOFTMAX and self.softcap and not self.float32_accurate and p_dtype is cutlass.BFloat16):
            return None
        top = self.softcap * LOG2_E
        # An integer: ptx.exp2_fma_bounded folds it into its rounding constant.
        offset = float(max(0, math.ceil(top - BOUNDED_TOP_LOG2)))
        return offset if -top - offset >= BOUNDED_BOTTOM_LOG2 else None

    def softmax_scale_log2(self, scale_log2):
        """The factor of the softmax's exponent for transformed scores."""
        if self.softcap:
            return Float32(self.softcap * LOG2_E)
        return scale_log2

    @cute.jit
    def transform(self, acc_s: cute.Tensor, scale_log2: Float32):
        """Scores -> what the softmax takes, in place (nothing without a softcap)."""
        if const_expr(self.softcap):
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = self.value(acc_s[i], scale_log2)

    @cute.jit
    def value(self, score: Float32, scale_log2: Float32) -> Float32:
        """One score's transformed value (a softcap: tanh(score * scale / c)). Monotone, so a
        row's largest transformed score is the transformed largest score (OnlineSoftmax.step
        with `transform`: the row maximum need not wait for every tanh)."""
        pre = scale_log2 * Float32(1.0 / (LOG2_E * self.softcap))
        if const_expr(self.float32_accurate):
            # 2^(+inf) = inf gives 1, 2^(-inf) = 0 gives -1.
            e = cute.math.exp2(score * (pre * Float32(2.0 * LOG2_E)), fastmath=True)
            return Float32(1.0) - Float32(2.0) * cute.arch.rcp_approx(e + Float32(1.0))
        return tanh_approx(score * pre)

    @cute.jit
    def grad(self, t: Float32) -> Float32:
        """d(transformed)/d(score) / scale = 1 - t^2 of a transformed score t; 0 for a masked
        one (t = -inf), so that P * grad stays 0 there and never becomes 0 * -inf."""
        return cute.arch.fmax(Float32(1.0) - t * t, Float32(0.0))
