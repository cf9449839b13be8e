"""Compiling the KV-cache append kernel (kernels/cache_append.py) through the shared cache
(cute_flash.compile_cache), once per (dtype, head dim, arch). The torch side is
cute_flash.kvcache."""

from cute_flash.compile_cache import (
    cached,
    compile_kernel,
    cutlass_dtype,
    fake_offsets_tensor,
    fake_page_table_tensor,
    fake_row_tensor,
    get_or_compile,
)


def compile_cache_append(dtype_name: str, head_dim: int):
    """Compile (uncached) the append kernel; returns the TVM-FFI callable
    fn(k, v, k_cache, v_cache, cache_seqlens, page_table) on (B, S, N, D) tensors."""
    from cute_flash.kernels.cache_append import CacheAppend

    dtype = cutlass_dtype(dtype_name)
    rows = (fake_row_tensor(dtype, head_dim) for _ in range(4))
    return compile_kernel(CacheAppend(dtype, head_dim), *rows, fake_offsets_tensor(), fake_page_table_tensor())


def get_cache_append(dtype_name: str, head_dim: int, arch: str = "sm_90a"):
    key = ("cache-append", dtype_name, head_dim, arch)
    fn = cached(key)
    if fn is None:
        fn = get_or_compile(key, lambda: compile_cache_append(dtype_name, head_dim))
    return fn
