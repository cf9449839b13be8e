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

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AttentionProblem:
    causal: bool = False

    def __post_init__(self):
        if type(self.causal) is not bool:
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        # The eager fast path hashes the problem on every call (it is part of api.call_signature,
        # the plan cache's key): a precomputed hash costs about half the generated one.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self):
        return self._hash

    @staticmethod
    def of(causal: bool = False) -> "AttentionProblem":
        """The shared problem of a call's public arguments (no new object per call: the host's
        per-call cost). `causal` may be any truthy value."""
        return _MASK_ONLY[bool(causal)]


_MASK_ONLY = {causal: AttentionProblem(causal=causal) for causal in (False, True)}
