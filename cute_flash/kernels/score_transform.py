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


class ScoreTransform:
    def __init__(self, problem: AttentionProblem, float32_accurate: bool = False):
        """float32_accurate: tanh(x) as 1 - 2 / (2^(2 x log2 e) + 1) on the SFU's exp2 and
        reciprocal (absolute error ~2^-22, which the softmax's exponent sees) instead of its
        tanh (2^-11); for the float32-accurate forward (kernels/fwd_sm90.py's split operands),
        where the SFU's tanh alone left 1.6e-5 of LSE error with a softcap. (libdevice's tanhf
        is as accurate but spilled registers at D = 128.)"""
        self.softcap = problem.softcap
        self.float32_accurate = float32_accurate

    def softmax_scale_log2(self, scale_log2):
        """The factor of the softmax's exponent for transformed scores."""
        if self.softcap:
            return Float32(self.softcap * LOG2_E)
        return scale_log2

    @cute.jit
    def transform(self, acc_s: cute.Tensor, scale_log2: Float32):
        """Scores -> what the softmax takes, in place (nothing without a softcap)."""
        if const_expr(self.softcap):
            pre = scale_log2 * Float32(1.0 / (LOG2_E * self.softcap))
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                if const_expr(self.float32_accurate):
                    # 2^(+inf) = inf gives 1, 2^(-inf) = 0 gives -1.
                    e = cute.math.exp2(acc_s[i] * (pre * Float32(2.0 * LOG2_E)), fastmath=True)
                    acc_s[i] = Float32(1.0) - Float32(2.0) * cute.arch.rcp_approx(e + Float32(1.0))
                else:
                    acc_s[i] = tanh_approx(acc_s[i] * pre)

    @cute.jit
    def grad(self, t: Float32) -> Float32:
        """d(transformed)/d(score) / scale = 1 - t^2 of a transformed score t; 0 for a masked
        one (t = -inf), so that P * grad stays 0 there and never becomes 0 * -inf."""
        return cute.arch.fmax(Float32(1.0) - t * t, Float32(0.0))
