"""Compiling the KV-cache kernels, the append (kernels/cache_append.py) and the split decode
step's merge (kernels/split_merge.py), through the shared cache (cute_flash.compile_cache),
once per (dtype, head dim, arch). The torch side is cute_flash.kvcache."""

from cute_flash.compile_cache import (
    cached,
    compile_kernel,
    cutlass_dtype,
    fake_offsets_tensor,
    fake_page_table_tensor,
    fake_row_tensor,
    get_or_compile,
)


def compile_cache_append(dtype_name: str, head_dims):
    """Compile (uncached) the append kernel; returns the TVM-FFI callable
    fn(k, v, k_cache, v_cache, cache_seqlens, page_table) on (B, S, N, D) tensors. head_dims:
    k's and v's D, or a pair (D, Dv) where v's differs."""
    from cute_flash.kernels.cache_append import CacheAppend

    head_dim, value_head_dim = head_dims if isinstance(head_dims, tuple) else (head_dims, head_dims)
    dtype = cutlass_dtype(dtype_name)
    new_k, cache_k = (fake_row_tensor(dtype, head_dim) for _ in range(2))
    new_v, cache_v = (fake_row_tensor(dtype, value_head_dim) for _ in range(2))
    return compile_kernel(CacheAppend(dtype, head_dim, value_head_dim), new_k, new_v, cache_k, cache_v,
                          fake_offsets_tensor(), fake_page_table_tensor())


def get_cache_append(dtype_name: str, head_dim: int, arch: str = "sm_90a", value_head_dim: int | None = None):
    """The append kernel for k of head_dim and v of value_head_dim (default head_dim) columns."""
    dims = head_dim if value_head_dim in (None, head_dim) else (head_dim, value_head_dim)
    return _get("cache-append", compile_cache_append, dtype_name, dims, arch)


def compile_split_merge(dtype_name: str, head_dim: int, sink: bool = False):
    """Compile (uncached) the merge kernel; returns the TVM-FFI callable
    fn(partial_out, partial_lse, sink, out, lse) (kernels/split_merge.py; `sink`, the (N,)
    float32 logits, with sink=True; None without)."""
    import cutlass.cute as cute
    from cutlass import Float32

    from cute_flash.compile_cache import fake_sink_tensor
    from cute_flash.kernels.split_merge import SplitMerge

    dtype = cutlass_dtype(dtype_name)
    partial, partial_lse = fake_row_tensor(dtype, head_dim), fake_row_tensor(Float32, cute.sym_int32(), rank=3)
    return compile_kernel(SplitMerge(dtype, head_dim, sink), partial, partial_lse, fake_sink_tensor() if sink else None,
                          fake_row_tensor(dtype, head_dim), fake_row_tensor(Float32, cute.sym_int32(), rank=3))


def get_split_merge(dtype_name: str, head_dim: int, arch: str = "sm_90a", sink: bool = False):
    """The merge kernel (with the sink's term when `sink`)."""
    if sink:
        return _get("split-merge-sink", lambda d, h: compile_split_merge(d, h, True), dtype_name, head_dim, arch)
    return _get("split-merge", compile_split_merge, dtype_name, head_dim, arch)


def _get(name, compile_fn, dtype_name, head_dim, arch):
    """The kernel `name` for (dtype, head dim (or a (D, Dv) pair), arch): this process's, else
    the disk cache's, else compiled."""
    key = (name, dtype_name, head_dim, arch)
    fn = cached(key)
    if fn is None:
        fn = get_or_compile(key, lambda: compile_fn(dtype_name, head_dim))
    return fn
