"""What compile_fwd and compile_bwd share: one cache of compiled kernels (in this process, over
the disk cache), the one cute.compile call, and the fake tensors kernels are compiled against.

A compiled kernel is keyed by everything that changes its generated code (dtype, head dim,
AttentionProblem, tile config, target arch, ...); the key is a tuple whose first item names the kernel
set ("fwd", "bwd-pre", "bwd-main", ...), so both directions share one dict. Shapes and strides
are not in the key: the kernels are compiled against symbolic (B, N, S) sizes and strides and
take the real ones at call time through the DSL's TVM-FFI calling path, which also picks up
PyTorch's current stream. Compiled kernels persist on disk (cute_flash.disk_cache), so a fresh
process loads instead of compiling.

The DSL (cutlass) is imported only to compile: a process whose kernels all come from the disk
cache never pays its import (seconds), see disk_cache.
"""

import logging
import threading
import time

from cute_flash import disk_cache

logger = logging.getLogger(__name__)

_cache = {}
_lock = threading.Lock()
compile_count = 0  # how many kernels this process has compiled (cute.compile calls); tests read it

# The hot path of the getters (compile_fwd.get_forward, compile_bwd.get_backward): what this
# process already holds under a key, else None; one dict look-up, nothing built.
cached = _cache.get


def get_or_compile(key, compile_fn):
    """The kernel for `key`: from this process, else from the disk cache, else compile_fn()
    (then stored on disk). One lock for every key: the DSL compiles one kernel at a time."""
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn, _ = load_or_compile(key, compile_fn)
                _cache[key] = fn
    return fn


def get_or_compile_set(key, parts, assemble=None):
    """A tuple of kernels kept in this process under `key` as a whole (one look-up per call
    on the hot path); each (disk key, compile_fn) of `parts` goes through get_or_compile, so
    kernels shared by several sets are loaded or compiled once. assemble: what is kept is
    assemble(the parts' kernels) (default the tuple of them)."""
    fns = _cache.get(key)
    if fns is None:
        fns = tuple(get_or_compile(part_key, compile_fn) for part_key, compile_fn in parts)
        if assemble is not None:
            fns = assemble(fns)
        _cache[key] = fns  # two threads racing here store equal tuples of the same kernels
    return fns


def load_or_compile(key, compile_fn):
    """The kernel for `key` from the disk cache, else compile_fn() (then stored there); logs
    which, with its time, at INFO on the `cute_flash` logger. Returns (fn, compiled)."""
    start = time.perf_counter()
    fn = disk_cache.load(key)
    if fn is not None:
        logger.info("loaded %s from the disk cache in %.3f s", key, time.perf_counter() - start)
        return fn, False
    fn = compile_fn()
    logger.info("compiled %s in %.2f s", key, time.perf_counter() - start)
    disk_cache.store(key, fn)
    return fn, True


def compile_kernel(kernel, *args):
    """cute.compile(kernel, *args, stream) as a TVM-FFI function that takes torch tensors;
    the stream resolves to PyTorch's current stream of the current device at call time.
    Compiles for the GPU the DSL finds, or CUTE_DSL_ARCH (e.g. sm_90a) on a machine without
    one."""
    import cutlass.cute as cute

    global compile_count
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    compiled = cute.compile(kernel, *args, stream, options="--enable-tvm-ffi")
    compile_count += 1
    return compiled


def cutlass_dtype(dtype_name: str):
    import cutlass

    from cute_flash.kernels.rules import FLOAT32_DTYPES, SCALED_HALVES

    if dtype_name in FLOAT32_DTYPES:  # TF32 in one pass or three: float32 in memory either way
        return cutlass.Float32
    # Scaled halves: float32 inputs as fp16 parts (cute_flash.float32).
    return {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, SCALED_HALVES: cutlass.Float16}[dtype_name]


# Fake tensors: what the kernels assume of the tensors they are called with.


def fake_attention_tensor(dtype, head_dim):
    """(B, N, S, D) with dynamic sizes and dynamic strides, D static and contiguous.

    TMA needs every stride but the last to be a multiple of 16 bytes; the torch side copies
    inputs that are not (torch_helpers.as_tma_operand), so the kernel may assume it.
    """
    import cutlass.cute as cute

    aligned = 128 // dtype.width
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
    stride = tuple(cute.sym_int64(divisibility=aligned) for _ in range(3)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def fake_transposed_values_tensor(dtype, head_dim):
    """V^T of a float32 forward, (B, N, D, Sk) with the keys contiguous (cute_flash.float32):
    dynamic sizes and strides but D's, which is static."""
    import cutlass.cute as cute

    aligned = 128 // dtype.width
    shape = (cute.sym_int32(), cute.sym_int32(), head_dim, cute.sym_int32())
    stride = tuple(cute.sym_int64(divisibility=aligned) for _ in range(3)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def fake_row_tensor(dtype, last, rank: int = 4):
    """A tensor of `rank` modes (a KV cache or its new rows, the split merge's operands; any
    order of the outer modes) with dynamic sizes and strides, the last mode of size `last`
    (static, or a cute.sym_int32()) and contiguous, no alignment assumed (read and written
    element by element: kernels/cache_append.py, kernels/split_merge.py)."""
    import cutlass.cute as cute

    shape = tuple(cute.sym_int32() for _ in range(rank - 1)) + (last,)
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=dtype.width // 8)


def fake_lse_tensor():
    """(B, N, Sq) fp32, the forward's LSE output: last mode contiguous."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(), cute.sym_int64(), 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=4)


def fake_sink_tensor():
    """(N,) fp32 per-head sink logits (read only by kernels compiled with problem.sink)."""
    import cutlass.cute as cute
    from cutlass import Float32

    return cute.runtime.make_fake_tensor(Float32, (cute.sym_int32(),), stride=(1,), assumed_align=4)


def fake_operand_scales_tensor():
    """(B, N, 2) fp32, contiguous: the scaled-halves forward's factors per (batch, query head)
    of its scores and of O (cute_flash.float32; read only by those kernels)."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), 2)
    stride = (cute.sym_int64(), 2, 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=4)


def fake_backward_scales_tensor():
    """(B, N, 5) fp32, contiguous: the scaled-halves backward's powers of two per (batch, query
    head) (kernels/half_operands.SCALE_*; read only by those kernels)."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), 5)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=(cute.sym_int64(), 5, 1), assumed_align=4)


def fake_offsets_tensor():
    """(n,) int32: a packed batch's cu_seqlens or seqused_k (read only by kernels compiled with
    problem.packed / problem.keys_used)."""
    import cutlass.cute as cute
    from cutlass import Int32

    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(),), stride=(1,), assumed_align=4)


def fake_page_table_tensor():
    """(B, max_pages) int32, rows contiguous: a paged cache's page table (read only by kernels
    compiled with problem.page_size)."""
    import cutlass.cute as cute
    from cutlass import Int32

    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(), cute.sym_int32()), stride=(cute.sym_int32(), 1),
                                         assumed_align=4)


def fake_stat_tensor(contiguous_rows: bool = True):
    """(B, N, S) fp32 with dynamic sizes; the last mode contiguous."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    # TMA loads slices of the padded buffers: their head/batch strides are whole 16-byte rows.
    divisibility = 4 if contiguous_rows else 1
    stride = (cute.sym_int64(divisibility=divisibility), cute.sym_int64(divisibility=divisibility), 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=16 if contiguous_rows else 4)


def fake_accum_tensor(head_dim):
    """(B, N, Sq_pad, D) fp32, rows contiguous and D-strided (static), so the kernel's
    per-element offsets inside a tile are compile-time constants."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
    stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), head_dim, 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=16)


def fake_count_tensor():
    """(B, N) int32, last mode contiguous: a count per (batch, head)."""
    import cutlass.cute as cute
    from cutlass import Int32

    shape = (cute.sym_int32(), cute.sym_int32())
    return cute.runtime.make_fake_tensor(Int32, shape, stride=(cute.sym_int64(), 1), assumed_align=4)


def fake_semaphore_tensor():
    """(B, N, num_m_blocks) int32, last mode contiguous."""
    import cutlass.cute as cute
    from cutlass import Int32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(), cute.sym_int64(), 1)
    return cute.runtime.make_fake_tensor(Int32, shape, stride=stride, assumed_align=4)
