"""Which key/value head a query head reads: the same head, or with grouped-query attention
(problem.grouped: k and v have Nkv heads, Nkv dividing N) head h // (N / Nkv), so that
the N / Nkv query heads of a group read one K/V head and no per-query-head copy of k or v
exists. The group size is a run-time value (the tensors' head counts)."""

import cutlass.cute as cute
from cutlass import Int32, const_expr

from cute_flash.kernels.problem import AttentionProblem


class HeadMapping:
    def __init__(self, problem: AttentionProblem):
        self.grouped = problem.grouped

    @cute.jit
    def kv_head(self, head: Int32, num_heads: Int32, num_kv_heads: Int32):
        """The key/value head of query head `head`."""
        kv = head
        if const_expr(self.grouped):
            kv = head // (num_heads // num_kv_heads)
        return kv

    @cute.jit
    def group_size(self, num_heads: Int32, num_kv_heads: Int32):
        """Query heads per key/value head (1 without grouping, a compile-time 1)."""
        size = 1
        if const_expr(self.grouped):
            size = num_heads // num_kv_heads
        return size
