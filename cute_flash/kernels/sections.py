"""How a causal grid's (head, batch) pairs split into sections (kernels/tile_scheduler.py numbers
the tiles block-major inside each, the sections one after another).

As few sections of at most `most` pairs as cover the pairs, their sizes within one of each
other, the larger first: equal sizes rather than full sections and a short last one, since a
short last section starts its longest tiles when little else is left to run beside them
((2, 8, 12288) in sections of 5, 5, 5, 1 pairs modelled 9 % longer than in 4 x 4).

Plain integer arithmetic without the DSL: the kernels' hosts run it on the DSL's integers
(minimum, maximum: cutlass.min, cutlass.max), and cute_flash.grid_makespan, which replays the
kernels' order on the CPU and must not import the DSL, on Python ints.
"""


def section_sizes(pairs, most, minimum=min, maximum=max):
    """(small, larger, count) for `pairs` pairs in sections of at most `most` (at least 1):
    count sections, the first `larger` of them of small + 1 pairs, the rest of small. (An empty
    grid: no sections, small 1, so that the kernels' host can still make divisors of it.)"""
    most = maximum(minimum(most, pairs), 1)
    count = (pairs + most - 1) // most
    small = maximum(pairs // maximum(count, 1), 1)
    return small, pairs - small * count, count
