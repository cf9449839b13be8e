"""Compiling the CuTe DSL kernels, once per key, in-process.

A compiled forward is keyed by everything that changes the generated code: dtype, head dim,
causal, the tile config and the target arch; compiled kernels also persist on disk
(cute_flash.disk_cache), so a fresh process loads instead of compiling. Shapes and strides are not in the key: the kernel
is compiled against symbolic (B, N, S) sizes and strides and takes the real ones at call time
through the DSL's TVM-FFI calling path, which also picks up PyTorch's current stream.
"""

import logging
import threading
import time

from cute_flash import disk_cache

logger = logging.getLogger(__name__)

# The DSL (cutlass) is imported only to compile: a process whose kernels all come from the
# disk cache never pays its import (seconds), see disk_cache.

_cache = {}
_lock = threading.Lock()
compile_count = 0  # how many kernels this process has compiled; tests read it


def cutlass_dtype(dtype_name: str):
    import cutlass

    return {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype_name]


def _fake_attention_tensor(dtype, head_dim):
    """(B, N, S, D) with dynamic sizes and dynamic strides, D static and contiguous.

    TMA needs every stride but the last to be a multiple of 16 bytes; the torch side copies
    inputs that are not, so the kernel may assume it.
    """
    import cutlass.cute as cute

    aligned = 128 // dtype.width
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
    stride = tuple(cute.sym_int64(divisibility=aligned) for _ in range(3)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def _fake_lse_tensor():
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(), cute.sym_int64(), 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=4)


def compile_forward(dtype_name: str, head_dim: int, causal: bool, config, arch: str = "sm_90a"):
    """Compile (uncached) the forward kernel; returns the TVM-FFI callable
    fn(q, k, v, out, lse, softmax_scale).

    `arch` is recorded in the cache key; the DSL targets the GPU it finds, or CUTE_DSL_ARCH
    (e.g. sm_90a) on a machine without one.
    """
    import cutlass.cute as cute
    from cutlass import Float32

    from cute_flash.kernels.fwd_sm90 import FlashForwardSm90

    global compile_count
    dtype = cutlass_dtype(dtype_name)
    kernel = FlashForwardSm90(dtype, head_dim, causal, config)
    q, k, v, o = (_fake_attention_tensor(dtype, head_dim) for _ in range(4))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    compiled = cute.compile(
        kernel, q, k, v, o, _fake_lse_tensor(), Float32(1.0), stream, options="--enable-tvm-ffi"
    )
    compile_count += 1
    return compiled


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


def get_forward(dtype_name: str, head_dim: int, causal: bool, config, arch: str = "sm_90a"):
    # No SM count in the key: one binary (and one disk-cache entry, so a cache precompiled
    # for one Hopper part serves the others) per config.
    key = ("fwd", dtype_name, head_dim, causal, config, arch)
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn, _ = load_or_compile(key, lambda: compile_forward(dtype_name, head_dim, causal, config, arch))
                _cache[key] = fn
    return fn
