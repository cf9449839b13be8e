"""The attention problem a kernel is compiled for: what of the math is fixed at compile time,
as one frozen value that the host layer builds once per call signature and every kernel,
block range and mask reads (and that compile keys contain), instead of loose bools threaded
through each layer.

Today it is the mask: none, or causal (top-left aligned: query i sees key j iff j <= i).
It is the seam the variants extend: a mask with windows and an alignment (block_ranges.py
and mask.py are the only readers of the mask's shape), a score transform (softcap: the
softmax's reader), a query-head to key/value-head mapping (GQA: the kernels' tile
coordinates) and the sequence layout (variable-length batches: the kernels' sequence
bounds). Plain Python, no DSL and no torch: the host imports it without either.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionProblem:
    causal: bool = False

    def __post_init__(self):
        if type(self.causal) is not bool:
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
