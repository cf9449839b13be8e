"""Backward postprocess: dQ = dq_accum * softmax_scale, converted to fp16/bf16.

The main kernel leaves the unscaled fp32 sum over key blocks of dS K in dq_accum (B, N,
Sq_pad, D); the scale is applied once here rather than per key block. One CTA per 128 query
rows of one (batch, head); reads need no bound (the buffer is padded), writes stop at Sq.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.kernels.layouts import row_tiled_copy, sequence_major

TILE_M = 128  # must divide bwd_sm90.SEQLEN_Q_PAD
NUM_THREADS = 256
VALUES = 8  # per thread and row: one 16-byte store of dQ, two 16-byte loads of dq_accum


class BackwardPostprocess:
    def __init__(self, dtype, head_dim: int):
        if head_dim % VALUES != 0 or NUM_THREADS % (head_dim // VALUES) != 0:
            raise ValueError(f"head_dim={head_dim} not supported by the dQ postprocess")
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # (B, N, Sq_pad, D) fp32
        mdQ: cute.Tensor,  # (B, N, Sq, D)
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        mdQaccum, mdQ = [sequence_major(t) for t in (mdQaccum, mdQ)]
        load = row_tiled_copy(Float32, NUM_THREADS, self.head_dim, VALUES)
        store = row_tiled_copy(self.dtype, NUM_THREADS, self.head_dim, VALUES)
        self.kernel(mdQaccum, mdQ, softmax_scale, load, store).launch(
            grid=(cute.ceil_div(mdQ.shape[0], TILE_M), mdQ.shape[2], mdQ.shape[3]),
            block=[NUM_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        softmax_scale: Float32,
        load: cute.TiledCopy,
        store: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        tile = (TILE_M, self.head_dim)
        row_limit = mdQ.shape[0] - m_block * TILE_M

        thr_load = load.get_slice(tidx)
        thr_store = store.get_slice(tidx)
        tAgA = thr_load.partition_S(cute.local_tile(mdQaccum[None, None, head, batch], tile, (m_block, 0)))
        tQgQ = thr_store.partition_D(cute.local_tile(mdQ[None, None, head, batch], tile, (m_block, 0)))
        tQcQ = thr_store.partition_D(cute.make_identity_tensor(tile))
        r_acc = cute.make_rmem_tensor_like(tAgA)
        cute.copy(load, tAgA, r_acc)
        r_dq = cute.make_rmem_tensor_like(tQgQ)
        r_dq.store((r_acc.load() * softmax_scale).to(self.dtype))
        for m in cutlass.range_constexpr(cute.size(tQgQ, mode=[1])):
            if tQcQ[0, m, 0][0] < row_limit:
                cute.copy(store, r_dq[None, m, None], tQgQ[None, m, None])
