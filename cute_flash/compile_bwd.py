"""Compiling and launching the backward kernels (preprocess, main, postprocess).

Same scheme as compile_cache for the forward: each kernel is compiled once per (dtype, head
dim, causal, config, arch) against symbolic sizes and strides, through the DSL's TVM-FFI
calling path (which also picks up PyTorch's current stream), and kept in the process and in
the disk cache (cute_flash.disk_cache), so a fresh process with a warm cache compiles nothing.

`backward` is the torch-level glue: it allocates the fp32 work buffers (LSE * log2(e), delta
and the dQ accumulator, all padded to a multiple of 128 query rows) and runs
    preprocess: delta = rowsum(dO * O), lse_log2, dq_accum = 0 (with a fused_preprocess
                config only for the first heads, see prepare_ahead_plan), dq_done = 0
    main:       dK, dV, dq_accum += dS K (a writer warp's bulk reduce-adds); each CTA
                counts itself in dq_done[b, h] when done; with fused_preprocess also the
                preprocess of the other heads
    postprocess: dQ = dq_accum * softmax_scale (it starts while the main kernel's last CTAs
                run and waits per (b, h) on dq_done)
With a config whose `deterministic` is true it also allocates a zeroed int32 semaphore per
(batch, head, query block), which orders the main kernel's dQ additions (bitwise
reproducible dQ); otherwise the main kernel gets a 1-element dummy it never reads.

When a SeparateDqConfig applies (long sequences, see cute_flash.config) there is no dQ
accumulator at all:
    preprocess: delta, lse_log2 (nothing zeroed)
    main:       dK, dV only
    dq kernel:  dQ (bwd_dq_sm90: one CTA per query block, dQ in registers, written once)
and the work buffers are O(B N Sq) floats instead of O(B N Sq D).
"""

import dataclasses
import threading

from cute_flash.compile_cache import _fake_attention_tensor, cutlass_dtype, load_or_compile
from cute_flash.kernels.seqlen_pad import padded_seqlen_q

# The DSL and the kernel modules are imported only to compile (see compile_cache).

_cache = {}
_lock = threading.Lock()
compile_count = 0
# The dQ postprocess overlaps the end of the main kernel (see bwd_postprocess); False runs it
# after the main kernel has finished, for measuring what the overlap gains.
OVERLAP_POSTPROCESS = True


def _fake_stat_tensor(contiguous_rows: bool = True):
    """(B, N, S) fp32 with dynamic sizes; the last mode contiguous."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    # TMA loads slices of the padded buffers: their head/batch strides are whole 16-byte rows.
    divisibility = 4 if contiguous_rows else 1
    stride = (cute.sym_int64(divisibility=divisibility), cute.sym_int64(divisibility=divisibility), 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=16 if contiguous_rows else 4)


def _fake_accum_tensor(head_dim):
    """(B, N, Sq_pad, D) fp32, rows contiguous and D-strided (static), so the kernel's
    per-element offsets inside a tile are compile-time constants."""
    import cutlass.cute as cute
    from cutlass import Float32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
    stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), head_dim, 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=16)


def _fake_count_tensor():
    """(B, N) int32, last mode contiguous: the dQ-done count per (batch, head)."""
    import cutlass.cute as cute
    from cutlass import Int32

    shape = (cute.sym_int32(), cute.sym_int32())
    return cute.runtime.make_fake_tensor(Int32, shape, stride=(cute.sym_int64(), 1), assumed_align=4)


def _fake_semaphore_tensor():
    """(B, N, num_m_blocks) int32, last mode contiguous."""
    import cutlass.cute as cute
    from cutlass import Int32

    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(), cute.sym_int64(), 1)
    return cute.runtime.make_fake_tensor(Int32, shape, stride=stride, assumed_align=4)


_dummies = {}


def _dummy(shape, dtype, device):
    """A small zeroed tensor standing in for a buffer the kernel is compiled not to touch
    (the dQ semaphore outside deterministic mode, the dQ accumulator with a separate dQ
    kernel): one per (shape, dtype, device), never written."""
    import torch

    key = (shape, dtype, device)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def _stream():
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _backward_parts(dtype_name: str, head_dim: int, causal: bool, config, arch: str, dq_config=None):
    """[(disk-cache key, compile function)] of preprocess, main and postprocess -- or, with a
    separate dQ kernel (dq_config, a SeparateDqConfig), of preprocess, dK/dV-only main and
    the dQ kernel. Each key holds exactly what its kernel's binary depends on (the pre- and
    postprocess are shared by every config that leaves dq_accum in the same layout). The
    DSL is imported only inside the compile functions: building the keys to load cached
    kernels must not import it."""
    separate = dq_config is not None
    # Without dQ the main kernel's binary does not depend on the config's dQ-only fields. It
    # also takes 64-query steps: the 128-row step (D=64 entries) spills 5-15 registers once
    # the dQ GEMM is gone (ptxas; the SASS test of the separate path checks).
    main_config = (
        dataclasses.replace(config, deterministic=False, dq_swap_ab=False, dq_stages=1, block_m=64, dq_atom_m=1,
                            fused_preprocess=False)
        if separate else config
    )
    # The main kernel leaves dq_accum in its dQ MMA's fragment order, which depends on these.
    fragment_tile = (config.block_m, config.dq_atom_m, config.num_mma_warpgroups, config.dq_swap_ab)
    overlap = OVERLAP_POSTPROCESS

    def compile_with(make_kernel, *arg_kinds):
        """cute.compile(kernel, fake args..., stream) for arg kinds t (attention tensor),
        stat, stat_rows (unaligned rows), accum, semaphore, scale."""
        import cutlass.cute as cute
        from cutlass import Float32, Int32

        dtype = cutlass_dtype(dtype_name)
        fakes = dict(
            t=lambda: _fake_attention_tensor(dtype, head_dim), stat=_fake_stat_tensor,
            stat_rows=lambda: _fake_stat_tensor(contiguous_rows=False),
            accum=lambda: _fake_accum_tensor(head_dim), semaphore=_fake_semaphore_tensor,
            done=_fake_count_tensor, count=lambda: Int32(1), scale=lambda: Float32(1.0),
        )
        args = [fakes[kind]() for kind in arg_kinds]
        return cute.compile(make_kernel(dtype), *args, _stream(), options="--enable-tvm-ffi")

    def pre():
        from cute_flash.kernels.bwd_preprocess import BackwardPreprocess

        return compile_with(lambda dtype: BackwardPreprocess(dtype, head_dim, zero_dq_accum=not separate),
                            "t", "t", "stat_rows", "stat", "stat", "accum", "done", "done", "count")

    def main():
        from cute_flash.kernels.bwd_sm90 import FlashBackwardSm90

        return compile_with(lambda dtype: FlashBackwardSm90(dtype, head_dim, causal, main_config, with_dq=not separate),
                            "t", "t", "t", "t", "t", "stat_rows", "stat", "stat", "accum", "semaphore", "done",
                            "done", "t", "t", "scale", "count", "count")

    def post():
        from cute_flash.kernels.bwd_postprocess import BackwardPostprocess

        return compile_with(lambda dtype: BackwardPostprocess(dtype, head_dim, fragment_tile, overlap),
                            "accum", "t", "done", "count", "scale")

    def dq():
        from cute_flash.kernels.bwd_dq_sm90 import FlashBackwardDqSm90

        return compile_with(lambda dtype: FlashBackwardDqSm90(dtype, head_dim, causal, dq_config),
                            "t", "t", "t", "t", "stat", "stat", "t", "scale")

    if separate:
        return [
            (("bwd-pre", dtype_name, head_dim, False, arch), pre),
            (("bwd-main-dkv", dtype_name, head_dim, causal, main_config, arch), main),
            (("bwd-dq", dtype_name, head_dim, causal, dq_config, arch), dq),
        ]
    return [
        (("bwd-pre", dtype_name, head_dim, True, arch), pre),
        (("bwd-main", dtype_name, head_dim, causal, config, arch), main),
        (("bwd-post", dtype_name, head_dim, fragment_tile, overlap, arch), post),
    ]


def compile_backward(dtype_name: str, head_dim: int, causal: bool, config, arch: str = "sm_90a",
                     dq_config=None):
    """Compile (uncached) the three backward kernels; returns (preprocess, main, postprocess),
    TVM-FFI callables:
        preprocess(out, dout, lse, lse_log2, delta, dq_accum, dq_done, prepared, num_heads_prepared)
        main(q, k, v, out, dout, lse, lse_log2, delta, dq_accum, dq_semaphore, dq_done, prepared,
             dk, dv, softmax_scale, prep_ahead, prep_ctas)
        postprocess(dq_accum, dq, dq_done, num_key_blocks, softmax_scale)
    or, with dq_config, (preprocess, dK/dV main, dq kernel) where the last is
        dq_kernel(q, k, v, dout, lse_log2, delta, dq, softmax_scale).
    `arch` is only recorded in the cache key (see compile_cache.compile_forward)."""
    global compile_count
    parts = _backward_parts(dtype_name, head_dim, causal, config, arch, dq_config)
    fns = tuple(compile_fn() for _, compile_fn in parts)
    compile_count += len(fns)
    return fns


def _load_or_compile(key, compile_fn):
    global compile_count
    fn, compiled = load_or_compile(key, compile_fn)
    compile_count += compiled
    return fn


def get_backward(dtype_name: str, head_dim: int, causal: bool, config, arch: str = "sm_90a",
                 dq_config=None):
    """The three backward kernels for this key (see compile_backward): from this process's
    cache, else from the disk cache (cute_flash.disk_cache), else compiled (and stored there)."""
    key = (dtype_name, head_dim, causal, config, arch, dq_config, OVERLAP_POSTPROCESS)
    fns = _cache.get(key)
    if fns is None:
        with _lock:
            fns = _cache.get(key)
            if fns is None:
                fns = tuple(
                    _load_or_compile(part_key, compile_fn)
                    for part_key, compile_fn in _backward_parts(dtype_name, head_dim, causal, config, arch,
                                                                dq_config)
                )
                _cache[key] = fns
    return fns


# fused_preprocess: heads prepared by the preprocess kernel are those whose CTAs the grid
# launches within about this many waves of SMs from the start; each later head is prepared by
# the CTAs of the head this many waves before it (bwd_prepare_ahead), long before it runs.
PREP_AHEAD_WAVES = 2


def prepare_ahead_plan(config, dq_config, causal, batch, heads, seqlen_k, num_sms, dlse,
                       rows_contiguous) -> tuple:
    """(prep_ahead, prep_ctas) for the main kernel: the preprocess prepares heads
    0 .. prep_ahead - 1 (in launch order), and the first prep_ctas key blocks of head j
    prepare head j + prep_ahead. prep_ahead = B x N when the main kernel prepares nothing:
    configs without fused_preprocess (or where the kernel ignores it), the separate dQ kernel,
    an upstream LSE gradient (delta is corrected on the torch side after the preprocess), and
    O or dO whose rows are not contiguous (rows_contiguous False: the kernel reads a head's
    rows as one range)."""
    total = batch * heads
    if not config.preprocess_in_main or dq_config is not None or dlse is not None or not rows_contiguous:
        return total, 1
    num_n_blocks = -(-seqlen_k // config.block_n)
    # Causal: the lower half of the key blocks walk the most query blocks.
    prep_ctas = (num_n_blocks + 1) // 2 if causal else num_n_blocks
    prep_ahead = max(1, -(-PREP_AHEAD_WAVES * num_sms // num_n_blocks))
    return min(total, prep_ahead), prep_ctas


def backward(q, k, v, out, dout, lse, causal: bool, softmax_scale: float, config, grads=None,
             dlse=None, dq_config=None):
    """dq, dk, dv of attention(q, k, v) for the upstream gradient dout.

    dq_config (a SeparateDqConfig, optional): when it applies to Sq, dQ comes from the
    separate dQ kernel and no dQ accumulator is allocated.

    q, out, dout (B, N, Sq, D); k, v (B, N, Sk, D); lse (B, N, Sq) fp32 natural-log LSE from
    the forward (-inf for rows that see no key). `grads` optionally supplies the (dq, dk, dv)
    output tensors (same shapes and dtype as q, k, v). `dlse` (B, N, Sq), optional, is the
    upstream gradient of the LSE: d loss / d S_ij gains dlse_i * P_ij, which is the same as
    using delta - dlse in place of delta. Runs on PyTorch's current stream of q's device.
    """
    import torch

    from cute_flash.launch import _TORCH_DTYPE_NAMES, _device_traits, as_tma_operand, device_scope, tma_compatible

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    if grads is None:
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if any(g.numel() == 0 for g in grads) or seqlen_k == 0:
        # No query, no key or no batch/head: every gradient is zero (or empty).
        for g in grads:
            g.zero_()
        return grads
    # The kernels write dq with vector stores and dk / dv with TMA: outputs that cannot take
    # those are computed in scratch buffers and copied.
    work = tuple(
        g if tma_compatible(g) else torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in grads
    )
    dq, dk, dv = work
    arch, num_sms = _device_traits(q.device)
    if dq_config is not None and not dq_config.applies(seqlen_q):
        dq_config = None
    pre, main, last = get_backward(_TORCH_DTYPE_NAMES[q.dtype], head_dim, causal, config, arch, dq_config)
    q, k, v, out, dout = (as_tma_operand(t) for t in (q, k, v, out, dout))
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    padded = padded_seqlen_q(seqlen_q, config.block_m)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse_log2 = torch.empty((batch, heads, padded), **f32)
    delta = torch.empty((batch, heads, padded), **f32)
    if dq_config is not None:
        dq_accum = _dummy((1, 1, padded_seqlen_q(1), head_dim), torch.float32, q.device)
        dq_done = prepared = _dummy((1, 1), torch.int32, q.device)
    else:
        dq_accum = torch.empty((batch, heads, padded, head_dim), **f32)
        # Zeroed by the preprocess; the main kernel's CTAs count themselves in them.
        dq_done = torch.empty((batch, heads), dtype=torch.int32, device=q.device)
        prepared = torch.empty((batch, heads), dtype=torch.int32, device=q.device)
    # Only a config whose main kernel prepares later heads reads O / dO as row ranges.
    rows_contiguous = config.preprocess_in_main and all(
        t.stride(2) == head_dim or t.shape[2] == 1 for t in (out, dout)
    )
    prep_ahead, prep_ctas = prepare_ahead_plan(config, dq_config, causal, batch, heads, seqlen_k, num_sms, dlse,
                                               rows_contiguous)
    if config.deterministic and dq_config is None:
        num_m_blocks = (seqlen_q + config.block_m - 1) // config.block_m
        dq_semaphore = torch.zeros((batch, heads, num_m_blocks), dtype=torch.int32, device=q.device)
    else:
        dq_semaphore = _dummy((1, 1, 1), torch.int32, q.device)
    with device_scope(q.device):
        pre(out, dout, lse, lse_log2, delta, dq_accum, dq_done, prepared, prep_ahead)
        if dlse is not None:
            # Rows whose LSE is -inf have P = 0, so their delta does not matter.
            delta[:, :, :seqlen_q].sub_(dlse.to(torch.float32))
        main(q, k, v, out, dout, lse, lse_log2, delta, dq_accum, dq_semaphore, dq_done, prepared, dk, dv,
             softmax_scale, prep_ahead, prep_ctas)
        if dq_config is not None:
            last(q, k, v, dout, lse_log2, delta, dq, softmax_scale)
        else:
            # Nothing may run between the main kernel and the postprocess: the postprocess
            # overlaps the main kernel (programmatic dependent launch, see bwd_postprocess).
            last(dq_accum, dq, dq_done, -(-seqlen_k // config.block_n), softmax_scale)
    for g, w in zip(grads, work):
        if g is not w:
            g.copy_(w)
    return grads


def compile_backward_cubins(dtype_name, head_dim, causal, config, out_dir, timeout=900, dq_config=None) -> dict:
    """Compile the three backward kernels for sm_90a in a subprocess (no GPU needed); return
    {'preprocess' | 'main' | 'postprocess': cubin path}, or with dq_config (the separate dQ
    kernel's path) {'preprocess' | 'main' | 'dq': cubin path}. See cute_flash.sass for why a
    subprocess: the DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR at import."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(out_dir))
    job = json.dumps(dict(
        dtype=dtype_name, head_dim=head_dim, causal=causal, config=dataclasses.asdict(config),
        dq_config=dataclasses.asdict(dq_config) if dq_config is not None else None,
    ))
    proc = subprocess.run(
        [sys.executable, "-m", "cute_flash.compile_bwd", job],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {job} failed:\n{proc.stdout}\n{proc.stderr}")
    names = {"preprocess": "BackwardPreprocess", "main": "FlashBackwardSm90"}
    names.update({"dq": "FlashBackwardDqSm90"} if dq_config is not None else {"postprocess": "BackwardPostprocess"})
    cubins = {}
    for key, marker in names.items():
        found = sorted(p for p in out_dir.glob("*.cubin") if marker in p.name)
        if not found:
            raise RuntimeError(f"compiling {job} left no {key} cubin in {out_dir}")
        cubins[key] = found[-1]
    return cubins


if __name__ == "__main__":
    import json
    import sys

    from cute_flash.config import BackwardTileConfig, SeparateDqConfig

    _job = json.loads(sys.argv[1])
    _dq = _job.get("dq_config")
    compile_backward(_job["dtype"], _job["head_dim"], _job["causal"], BackwardTileConfig(**_job["config"]),
                     dq_config=SeparateDqConfig(**_dq) if _dq else None)
