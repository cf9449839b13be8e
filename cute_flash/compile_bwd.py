"""Compiling the backward kernels (preprocess, main, postprocess; or preprocess, dK/dV-only
main and the separate dQ kernel), once per key, through the shared cache (cute_flash.compile_cache:
this process, then the disk cache, then cute.compile).

Each kernel is compiled against symbolic sizes and strides and has its own disk-cache key,
holding exactly what its binary depends on (backward_parts): the pre- and postprocess are
shared by every config that leaves dq_accum in the same layout. The set of a backward config
is kept in this process under one key, so the launch (cute_flash.launch_bwd, the torch side:
buffers and the launch sequence) looks it up once per call.
"""

import dataclasses
from functools import partial
from typing import NamedTuple

from cute_flash.compile_cache import (
    cached,
    compile_kernel,
    cutlass_dtype,
    fake_accum_tensor,
    fake_attention_tensor,
    fake_backward_scales_tensor,
    fake_count_tensor,
    fake_offsets_tensor,
    fake_semaphore_tensor,
    fake_stat_tensor,
    fake_transposed_values_tensor,
    get_or_compile,
    get_or_compile_set,
)
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.rules import (
    FLOAT32_DTYPES,
    SCALED_HALVES,
    SPLIT_FLOAT32,
    TF32,
    dq_fragment_tile,
    gradient_chunks,
)

# The DSL and the kernel modules are imported only to compile (see compile_cache).


def backward_parts(dtype_name: str, head_dim: int, problem: AttentionProblem, config, arch: str, dq_config=None,
                   overlap_postprocess: bool = True, tile_head_dim: int | None = None,
                   value_head_dim: int | None = None, value_tile_head_dim: int | None = None):
    """[(disk-cache key, compile function)] of preprocess, main and postprocess -- or, with a
    separate dQ kernel (dq_config, a SeparateDqConfig), of preprocess, dK/dV-only main and
    the dQ kernel. Each key holds exactly what its kernel's binary depends on (the pre- and
    postprocess are shared by every config that leaves dq_accum in the same layout). The
    DSL is imported only inside the compile functions: building the keys to load cached
    kernels must not import it. overlap_postprocess=False: a postprocess launched without
    programmatic dependent launch (after the main kernel has finished; for measuring what
    the overlap gains). tile_head_dim (default head_dim): the kernels' tile width for q, k
    (and their gradients) of head dim head_dim and v, O (and theirs) of value_head_dim (default
    head_dim; cute_flash.head_dims); the dQ accumulator has the tile's width, and a config that
    prepares heads inside the main kernel needs the three equal. value_tile_head_dim (default
    the tile): the main kernel's V, dO and dV tiles (a bwd entry's value tile of its own)."""
    separate = dq_config is not None
    tile = tile_head_dim or head_dim
    value_dim = value_head_dim or head_dim
    value_tile = value_tile_head_dim or tile
    kernel_value_tile = value_tile if value_tile != tile else None
    float32 = dtype_name in FLOAT32_DTYPES
    halves = dtype_name == SCALED_HALVES
    split = dtype_name == SPLIT_FLOAT32 or halves
    # Split operands: q, k, v and dO go to the kernels as [hi | lo] rows of 2 tiles' width.
    operand_cols = 2 * tile if split else head_dim
    if (tile != head_dim or value_dim != head_dim) and config.preprocess_in_main:
        raise ValueError("a fused_preprocess backward config needs tile_head_dim == head_dim == value_head_dim")
    # Without dQ the main kernel's binary does not depend on the config's dQ-only fields. It
    # also takes 64-query steps: the 128-row step (D=64 entries) spills 5-15 registers once
    # the dQ GEMM is gone (ptxas; the SASS test of the separate path checks). Float32 and
    # split-operand entries name their step (what fits in shared memory and registers,
    # rules.backward).
    # Its exp2s pinned whole (pinned_exp_columns 0): the entries' shares were timed on their
    # own steps (with the dQ GEMM) only, and this is the separate path's step as measured before.
    main_config = (
        dataclasses.replace(config, deterministic=False, dq_swap_ab=False, dq_stages=1,
                            block_m=config.block_m if float32 or split else 64, dq_atom_m=1, fused_preprocess=False,
                            pinned_exp_columns=0)
        if separate else config
    )
    # Split operands' preprocess reads O and the unsplit dO, float32 both: float32's binary.
    pre_dtype_name = TF32 if split else dtype_name
    # The main kernel leaves dq_accum in its dQ MMA's fragment order, which depends on these.
    fragment_tile = dq_fragment_tile(config)

    def compile_with(make_kernel, *arg_kinds, kernel_dtype_name=dtype_name, chunk=None):
        """cute.compile(kernel, fake args..., stream) for arg kinds t (attention tensor of q's
        head dim), v (of v's: v, O and their gradients), op (the operands q, k, v, dO: float32x3's
        and the halves' [hi | lo] rows, else t), stat, stat_rows (unaligned rows), accum, semaphore,
        done, count, scale, offsets, transposed (a float32 Q^T or K^T), scales (the halves'
        operand scales), grad (a gradient `chunk`'s columns of dq, dk or dv: the caller's views of
        them); a tuple of kinds (of a NamedTuple class) is that NamedTuple of fakes; an
        _Optional(i, kind) is kind's fake where the kernel reads its optional argument i
        (its optional_arguments()), else None (kernels/optional_arguments.py). The scaled halves'
        kernels read fp16 operands but float32 O, dO and gradients."""
        from cutlass import Float32, Int32

        dtype = cutlass_dtype(kernel_dtype_name)
        io_dtype = Float32 if halves else dtype
        fakes = dict(
            t=lambda: fake_attention_tensor(io_dtype, head_dim), v=lambda: fake_attention_tensor(io_dtype, value_dim),
            op=lambda: fake_attention_tensor(dtype, operand_cols),
            stat=fake_stat_tensor,
            stat_rows=lambda: fake_stat_tensor(contiguous_rows=False),
            accum=lambda: fake_accum_tensor(tile), semaphore=fake_semaphore_tensor,
            done=fake_count_tensor, count=lambda: Int32(1), scale=lambda: Float32(1.0), offsets=fake_offsets_tensor,
            transposed=lambda: fake_transposed_values_tensor(dtype, operand_cols),
            scales=fake_backward_scales_tensor,
            grad=lambda: fake_attention_tensor(io_dtype, min(chunk[1], head_dim - chunk[0])),
        )
        kernel = make_kernel(dtype)

        def fake(kind):
            if isinstance(kind, _Optional):
                return fake(kind.kind) if kernel.optional_arguments()[kind.index] else None
            return type(kind)(*(fake(k) for k in kind)) if isinstance(kind, tuple) else fakes[kind]()

        return compile_kernel(kernel, *(fake(kind) for kind in arg_kinds))

    def packed_batch():
        """The kinds of the kernels' packed-batch argument (an optional one)."""
        from cute_flash.kernels.sequences import PackedBatch

        return PackedBatch("offsets", "offsets", "offsets")

    def pre():
        from cute_flash.kernels.bwd_preprocess import BackwardPreprocess

        return compile_with(lambda dtype: BackwardPreprocess(dtype, tile, zero_dq_accum=not separate,
                                                             packed=problem.packed),
                            "v", "v", "stat_rows", "stat", "stat", "accum", "done", "done", "count",
                            _Optional(0, packed_batch()), kernel_dtype_name=pre_dtype_name)

    def main(chunk=None):
        from cute_flash.kernels.bwd_sm90 import CtaCounters, FlashBackwardSm90, QueryTransposes

        operands = ("op", "op", "op", "v", "op") if split else ("t", "t", "v", "v", "v")
        grads = ("grad", "grad") if chunk else ("t", "v")
        # The optional arguments (FlashBackwardSm90.optional_arguments): the dQ turns, the
        # packed batch, Q^T and dO^T, the scaled halves' scales.
        counters = CtaCounters(_Optional(0, "semaphore"), "done", "done")
        kinds = (*operands, "stat_rows", "stat", "stat", "accum", counters, *grads, "scale", "count", "count", "count",
                 _Optional(1, packed_batch()), _Optional(2, QueryTransposes("transposed", "transposed")),
                 _Optional(3, "scales"), "t", "count")
        assert not chunk or _grad_args(kinds) == _MAIN_GRAD_ARGS  # (GradientChunks slices these)
        return compile_with(lambda dtype: FlashBackwardSm90(dtype, tile, problem, main_config, with_dq=not separate,
                                                            split_operands=split, value_head_dim=kernel_value_tile,
                                                            grad_columns=chunk),
                            *kinds, chunk=chunk)

    def post():
        from cute_flash.kernels.bwd_postprocess import BackwardPostprocess

        return compile_with(lambda dtype: BackwardPostprocess(dtype, tile, fragment_tile, overlap_postprocess,
                                                              packed=problem.packed),
                            "accum", "t", "done", "count", "scale", _Optional(0, packed_batch()))

    def dq(chunk=None):
        from cute_flash.kernels.bwd_dq_sm90 import FlashBackwardDqSm90

        operands = ("op", "op", "op", "op") if split else ("t", "t", "v", "v")
        # The optional arguments (FlashBackwardDqSm90.optional_arguments): K^T, the scales, the
        # packed batch.
        kinds = (*operands, "stat", "stat", "grad" if chunk else "t", _Optional(0, "transposed"),
                 _Optional(1, "scales"), _Optional(2, packed_batch()), "scale")
        assert not chunk or _grad_args(kinds) == _DQ_GRAD_ARGS  # (GradientChunks slices these)
        return compile_with(lambda dtype: FlashBackwardDqSm90(dtype, tile, problem, dq_config, split_operands=split,
                                                              grad_columns=chunk),
                            *kinds, chunk=chunk)

    # The preprocess reads O and dO (v's head dim), the postprocess writes dQ (q's).
    if separate:
        # The gradients' column chunks (the scaled halves above D = 128; rules.gradient_chunks): a
        # dK / dV and a dQ kernel per chunk (none past q's columns), else one of each ([None]).
        chunks = [c for c in gradient_chunks(dtype_name, tile) if c is None or c[0] < head_dim]
        # (A chunk's kernels' keys end in their chunk; one launch's keep their old form.)
        chunk_key = lambda chunk: (chunk,) if chunk else ()  # noqa: E731
        return [
            (("bwd-pre", pre_dtype_name, value_dim, tile, False, problem.packed, arch), pre),
            *((("bwd-main-dkv", dtype_name, head_dim, value_dim, tile, problem, main_config, arch, value_tile,
                *chunk_key(c)), partial(main, c)) for c in chunks),
            *((("bwd-dq", dtype_name, head_dim, value_dim, tile, problem, dq_config, arch, *chunk_key(c)),
               partial(dq, c)) for c in chunks),
        ]
    return [
        (("bwd-pre", dtype_name, value_dim, tile, True, problem.packed, arch), pre),
        (("bwd-main", dtype_name, head_dim, value_dim, tile, problem, config, arch, value_tile), main),
        (("bwd-post", dtype_name, head_dim, tile, fragment_tile, overlap_postprocess, problem.packed, arch), post),
    ]


def compile_backward(dtype_name: str, head_dim: int, problem: AttentionProblem, config, arch: str = "sm_90a",
                     dq_config=None, overlap_postprocess: bool = True, tile_head_dim: int | None = None,
                     value_head_dim: int | None = None, value_tile_head_dim: int | None = None):
    """Compile (uncached) the three backward kernels; returns (preprocess, main, postprocess),
    TVM-FFI callables:
        preprocess(out, dout, lse, lse_log2, delta, dq_accum, dq_done, prepared, num_heads_prepared, batch)
        main(q, k, v, out, dout, lse, lse_log2, delta, dq_accum, (dq_semaphore, dq_done, prepared),
             dk, dv, softmax_scale, prep_ahead, prep_ctas, prepared_count, batch, (q_t, dout_t), scales, dq,
             dq_target)
        postprocess(dq_accum, dq, dq_done, done_count, softmax_scale, batch)
    (dq, dq_target: a fused_postprocess kernel's dQ and the dq_done total that completes a head,
    0 to leave dQ to the postprocess; the other kernels never read them)
    where batch = (cu_seqlens_q, cu_seqlens_k, seqused_k) of a problem.packed batch
    (kernels/sequences.PackedBatch), and (q_t, dout_t) the float32 kernels' transposed copies
    (kernels/tf32_operands),
    or, with dq_config, (preprocess, dK/dV main, dq kernel) where the last is
        dq_kernel(q, k, v, dout, lse_log2, delta, dq, k_t, scales, batch, softmax_scale)
    (k_t: float32's K^T copy, kernels/tf32_operands), and scales the scaled halves' operand
    scales (B, N, 5) (cute_flash.float32.backward_operands). batch, (q_t, dout_t), k_t, scales
    and dq_semaphore (deterministic mode only) are None where the kernels do not read them
    (kernels/optional_arguments.py). The scaled halves take their fp16 operands in place of
    q, k, v, dout (and of the transposes) and float32 out, dk, dv, dq.
    `arch` is only recorded in the cache key (see compile_fwd.compile_forward)."""
    parts = backward_parts(dtype_name, head_dim, problem, config, arch, dq_config, overlap_postprocess, tile_head_dim,
                           value_head_dim, value_tile_head_dim)
    return _in_chunks(tuple(compile_fn() for _, compile_fn in parts), parts)


def get_backward(dtype_name: str, head_dim: int, problem: AttentionProblem, config, arch: str = "sm_90a",
                 dq_config=None, overlap_postprocess: bool = True, tile_head_dim: int | None = None,
                 value_head_dim: int | None = None, value_tile_head_dim: int | None = None):
    """The three backward kernels for this key (see compile_backward): from this process's
    cache, else from the disk cache (cute_flash.disk_cache), else compiled (and stored there)."""
    tile = tile_head_dim or head_dim
    value_dim = value_head_dim or head_dim
    value_tile = value_tile_head_dim or tile
    key = ("bwd", dtype_name, head_dim, value_dim, tile, value_tile, problem, config, arch, dq_config,
           overlap_postprocess)
    fns = cached(key)
    if fns is None:
        parts = backward_parts(dtype_name, head_dim, problem, config, arch, dq_config, overlap_postprocess, tile,
                               value_dim, value_tile)
        fns = get_or_compile_set(key, parts, assemble=lambda kernels: _in_chunks(kernels, parts))
    return fns


class GradientChunks:
    """One kernel callable for the launches of a backward kernel's gradient chunks
    (rules.gradient_chunks): each launch gets the same arguments but its chunk's columns of the
    gradients it writes (the arguments at `grad_args`)."""

    def __init__(self, launches: tuple, grad_args: tuple):
        self.launches = launches  # ((first column, columns), kernel) per chunk
        self.grad_args = grad_args

    def __call__(self, *args):
        for (first, columns), kernel in self.launches:
            chunk_args = list(args)
            for i in self.grad_args:
                chunk_args[i] = args[i][..., first: first + columns]
            kernel(*chunk_args)


# Where the gradients are among the dK / dV kernel's and the dQ kernel's arguments (compile_backward;
# backward_parts checks them against the argument kinds it compiles with).
_MAIN_GRAD_ARGS, _DQ_GRAD_ARGS = (10, 11), (6,)


class _Optional(NamedTuple):
    """backward_parts' kind of a kernel's optional argument `index` (its optional_arguments())."""
    index: int
    kind: object


def _grad_args(kinds: tuple) -> tuple:
    return tuple(i for i, kind in enumerate(kinds) if kind == "grad")


def _in_chunks(fns: tuple, parts: list) -> tuple:
    """The (preprocess, main, last) of backward_parts' kernels `fns`: a gradient-chunked
    backward's main and dQ kernels (keys ending in their chunk, a tuple) each as one GradientChunks."""
    chunks = [key[-1] for key, _ in parts[1:]]
    if not isinstance(chunks[0], tuple):
        return fns
    n = (len(fns) - 1) // 2
    return (fns[0], GradientChunks(tuple(zip(chunks[:n], fns[1: 1 + n])), _MAIN_GRAD_ARGS),
            GradientChunks(tuple(zip(chunks[n:], fns[1 + n:])), _DQ_GRAD_ARGS))


def compile_tf32_backward_operands(head_dim: int, tile_head_dim: int, split: bool):
    """Compile (uncached) the float32 backward's operand pass (kernels/tf32_operands.py,
    Tf32BackwardOperands) for inputs of head dim `head_dim`, split into TF32 parts for tiles of
    `tile_head_dim` or not; returns fn(q, k, v, dout, (q, k, v, dout) rounded, (q^T, k^T, dout^T))."""
    from cutlass import Float32

    from cute_flash.kernels.tf32_operands import PermutedTransposes, RoundedRows, Tf32BackwardOperands

    width = 2 * tile_head_dim if split else head_dim
    inputs = (fake_attention_tensor(Float32, head_dim) for _ in range(4))
    rows = lambda: fake_attention_tensor(Float32, width)  # noqa: E731
    transposed = lambda: fake_transposed_values_tensor(Float32, width)  # noqa: E731
    return compile_kernel(Tf32BackwardOperands(head_dim, tile_head_dim, split), *inputs,
                          RoundedRows(rows(), rows(), rows(), rows()),
                          PermutedTransposes(transposed(), transposed(), transposed()))


def get_tf32_backward_operands(head_dim: int, tile_head_dim: int, split: bool, arch: str = "sm_90a"):
    # Without split the pass does not depend on the tile (the kernels' TMA fills past D).
    tile = tile_head_dim if split else head_dim
    key = ("tf32-bwd-operands", head_dim, tile, split, arch)
    fn = cached(key)
    if fn is None:
        fn = get_or_compile(key, lambda: compile_tf32_backward_operands(head_dim, tile, split))
    return fn


def compile_backward_cubins(dtype_name, head_dim, problem, config, out_dir, timeout=900, dq_config=None,
                            tile_head_dim=None, value_head_dim=None, value_tile_head_dim=None) -> dict:
    """Compile the three backward kernels for sm_90a in cute_flash.sass's compile child (no GPU
    needed; see there why a child process); return {'preprocess' | 'main' | 'postprocess':
    cubin path}, or with dq_config (the separate dQ kernel's path) {'preprocess' | 'main' |
    'dq': cubin path}."""
    import json
    from pathlib import Path

    from cute_flash.sass import compile_in_child

    out_dir = Path(out_dir).resolve()
    job = dict(
        kind="bwd", dtype=dtype_name, head_dim=head_dim, problem=dataclasses.asdict(problem),
        config=dataclasses.asdict(config), dq_config=dataclasses.asdict(dq_config) if dq_config is not None else None,
        tile_head_dim=tile_head_dim, value_head_dim=value_head_dim, value_tile_head_dim=value_tile_head_dim,
    )
    files = compile_in_child(job, out_dir, timeout)
    names = {"preprocess": "BackwardPreprocess", "main": "FlashBackwardSm90"}
    names.update({"dq": "FlashBackwardDqSm90"} if dq_config is not None else {"postprocess": "BackwardPostprocess"})
    cubins = {}
    for key, marker in names.items():
        found = [p for p in files if p.suffix == ".cubin" and marker in p.name]
        if not found:
            raise RuntimeError(f"compiling {json.dumps(job)} left no {key} cubin in {out_dir}")
        cubins[key] = found[-1]
    return cubins
