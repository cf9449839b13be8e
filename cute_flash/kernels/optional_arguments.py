"""Optional kernel arguments: a tensor a kernel reads only for some problems (the packed batch's
offsets, a sink's logits, float32's transposed operands and scales, deterministic mode's dQ
turns) is compiled as None where the kernel does not read it, and the caller passes None there.
A None argument costs a launch nothing; a never-read stand-in tensor cost ~0.3 us of host time
each (TVM-FFI converts every tensor argument), ~4 us per small backward.

Each kernel class that takes such arguments says which it reads (its `optional_arguments`), and
its __call__ checks what it was compiled with against that, so a compile that passes a tensor
where the kernel reads none (or None where it reads one) fails at compile time; a call that
passes something else than the compile did fails in TVM-FFI's argument check."""


def check_given(kernel: str, names: tuple, arguments: tuple, reads: tuple) -> None:
    """Raise unless arguments[i] is None exactly where reads[i] is False (a compile-time check:
    call it in __call__ with the DSL's Python values)."""
    given = tuple(a is not None for a in arguments)
    if given != tuple(bool(r) for r in reads):
        wrong = [f"{n} ({'given' if g else 'None'}, {'read' if r else 'not read'})"
                 for n, g, r in zip(names, given, reads) if g != bool(r)]
        raise ValueError(f"{kernel}: optional arguments compiled against what the kernel reads: {', '.join(wrong)}")
