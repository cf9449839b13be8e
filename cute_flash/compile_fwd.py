"""Compiling the forward kernel (kernels/fwd_sm90.py), once per key, through the shared cache
(cute_flash.compile_cache: this process, then the disk cache, then cute.compile).

The key is ("fwd", dtype, head dim, value head dim, tile head dim, value tile head dim,
AttentionProblem, TileConfig, arch): no
shape and no SM count, so one
binary (and one disk-cache entry, so a cache precompiled for one Hopper part serves the
others) serves every call of a config. The torch side is cute_flash.launch_fwd.
"""

from cute_flash.compile_cache import (
    cached,
    compile_kernel,
    cutlass_dtype,
    fake_attention_tensor,
    fake_backward_scales_tensor,
    fake_lse_tensor,
    fake_offsets_tensor,
    fake_operand_scales_tensor,
    fake_page_table_tensor,
    fake_sink_tensor,
    fake_transposed_values_tensor,
    get_or_compile,
)
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.rules import SCALED_HALVES, SPLIT_FLOAT32

# The DSL and the kernel module are imported only to compile (see compile_cache).


def compile_forward(dtype_name: str, head_dim: int, problem: AttentionProblem, config, arch: str = "sm_90a",
                    tile_head_dim: int | None = None, value_head_dim: int | None = None,
                    value_tile_head_dim: int | None = None):
    """Compile (uncached) the forward kernel; returns the TVM-FFI callable
    fn(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, operand_scales, softmax_scale)
    (float32: q, k, v as kernels/tf32_operands.py makes them) for q and k of head dim `head_dim`
    and v and out of `value_head_dim` (default head_dim), run on Q / K tiles of `tile_head_dim`
    columns (default head_dim) and V / O tiles of `value_tile_head_dim` (default the former;
    cute_flash.head_dims). The arguments from sink to operand_scales are optional: the
    kernel is compiled, and must be called, with None for those the problem does not read
    (FlashForwardSm90.optional_arguments; a dense batch without sinks: all six).

    `arch` is recorded in the cache key; the DSL targets the GPU it finds, or CUTE_DSL_ARCH
    (e.g. sm_90a) on a machine without one.
    """
    from cutlass import Float32

    from cute_flash.kernels.fwd_sm90 import FlashForwardSm90

    dtype = cutlass_dtype(dtype_name)
    tile = tile_head_dim or head_dim
    value_dim = value_head_dim or head_dim
    value_tile = value_tile_head_dim or tile
    halves = dtype_name == SCALED_HALVES
    split = dtype_name == SPLIT_FLOAT32 or halves
    kernel = FlashForwardSm90(dtype, tile, problem, config, split_operands=split, value_head_dim=value_tile)
    # Split operands come as [hi | lo] pairs of tile-wide halves (cute_flash.float32).
    operand_cols = 2 * tile if split else head_dim
    q, k = (fake_attention_tensor(dtype, operand_cols) for _ in range(2))
    v = fake_attention_tensor(dtype, 2 * value_tile if halves else value_dim)
    o = fake_attention_tensor(kernel.out_dtype, value_dim)
    if kernel.values_transposed:
        if value_dim != head_dim:
            raise ValueError("the float32 forward takes one head dim for q, k and v (cute_flash.float32 pads)")
        v = fake_transposed_values_tensor(dtype, operand_cols)
    optional = (fake_sink_tensor, fake_offsets_tensor, fake_offsets_tensor, fake_offsets_tensor, fake_page_table_tensor,
                fake_operand_scales_tensor)
    optional = (fake() if read else None for fake, read in zip(optional, kernel.optional_arguments()))
    return compile_kernel(kernel, q, k, v, o, fake_lse_tensor(), *optional, Float32(1.0))


def get_forward(dtype_name: str, head_dim: int, problem: AttentionProblem, config, arch: str = "sm_90a",
                tile_head_dim: int | None = None, value_head_dim: int | None = None,
                value_tile_head_dim: int | None = None):
    """The forward kernel for this key (see compile_forward): from this process's cache, else
    from the disk cache, else compiled (and stored there)."""
    tile = tile_head_dim or head_dim
    value_dim = value_head_dim or head_dim
    value_tile = value_tile_head_dim or tile
    key = ("fwd", dtype_name, head_dim, value_dim, tile, value_tile, problem, config, arch)
    fn = cached(key)
    if fn is None:
        fn = get_or_compile(key, lambda: compile_forward(dtype_name, head_dim, problem, config, arch, tile,
                                                         value_dim, value_tile))
    return fn


def compile_halves_operands(head_dim: int, tile_head_dim: int, backward: bool = False):
    """Compile (uncached) the scaled halves' operand pass (kernels/half_operands.py): the
    forward's, fn(q, k, v, q_out, k_out, v_out, tops, reduced, scales (B, N, 2)), or with
    `backward` the backward's, which takes dout after v in each group and scales (B, N, 5);
    tops (B, heads of all, TOP_PARTIALS) int32, reduced an int (which tensors' maxima the
    pass reduces itself)."""
    import cutlass.cute as cute
    from cutlass import Float16, Float32, Int32

    from cute_flash.kernels.half_operands import TOP_PARTIALS, ScaledHalves, ScaledHalvesBackward

    count = 4 if backward else 3
    inputs = (fake_attention_tensor(Float32, head_dim) for _ in range(count))
    outputs = (fake_attention_tensor(Float16, 2 * tile_head_dim) for _ in range(count))
    tops = cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(), cute.sym_int32(), TOP_PARTIALS),
                                         stride=(cute.sym_int64(), TOP_PARTIALS, 1), assumed_align=16)
    kernel = (ScaledHalvesBackward if backward else ScaledHalves)(head_dim, tile_head_dim)
    scales = fake_backward_scales_tensor() if backward else fake_operand_scales_tensor()
    return compile_kernel(kernel, *inputs, *outputs, tops, Int32(0), scales)


def get_halves_operands(head_dim: int, tile_head_dim: int, arch: str = "sm_90a", backward: bool = False):
    key = ("halves-bwd-operands" if backward else "halves-operands", head_dim, tile_head_dim, arch)
    fn = cached(key)
    if fn is None:
        fn = get_or_compile(key, lambda: compile_halves_operands(head_dim, tile_head_dim, backward))
    return fn


def compile_tf32_operands(head_dim: int, tile_head_dim: int, split: bool):
    """Compile (uncached) the float32 forward's operand pass (kernels/tf32_operands.py);
    returns fn(q, k, v, q_out, k_out, vt_out)."""
    from cutlass import Float32

    from cute_flash.kernels.tf32_operands import Tf32Operands

    width = 2 * tile_head_dim if split else head_dim
    inputs = (fake_attention_tensor(Float32, head_dim) for _ in range(3))
    outputs = (fake_attention_tensor(Float32, width), fake_attention_tensor(Float32, width),
               fake_transposed_values_tensor(Float32, width))
    return compile_kernel(Tf32Operands(head_dim, tile_head_dim, split), *inputs, *outputs)


def get_tf32_operands(head_dim: int, tile_head_dim: int, split: bool, arch: str = "sm_90a"):
    key = ("tf32-operands", head_dim, tile_head_dim, split, arch)
    fn = cached(key)
    if fn is None:
        fn = get_or_compile(key, lambda: compile_tf32_operands(head_dim, tile_head_dim, split))
    return fn
