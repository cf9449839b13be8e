"""Backward postprocess: dQ = dq_accum * softmax_scale, converted to fp16/bf16.

The main kernel leaves the unscaled fp32 sum over key blocks of dS K in dq_accum (B, N,
Sq_pad, D); the scale is applied once here rather than per key block. Reads need no bound
(the buffer is padded), writes stop at Sq -- and at dQ's head dim, when it is narrower than
the tile (`head_dim`, dq_accum's width; cute_flash.head_dims).

dq_accum is in fragment order: each block_m-row block holds the dQ MMA's accumulator
fragments in the order of dq_accumulate.dq_fragment_copy (the main kernel's writer warp adds
its staged tiles as they are). One CTA per block with the main kernel's consumer thread
count: thread t loads exactly the registers consumer thread t stored (coalesced 16-byte
loads), puts them back in row order through shared memory, and the rows go out with 16-byte
stores.

The postprocess overlaps the end of the main kernel. It is launched with
programmatic dependent launch; the main kernel lets it start once all of its CTAs are running
(griddepcontrol.launch_dependents), which is when most SMs have run out of main-kernel work:
without the overlap they would idle until the last CTAs finish (the main grid's last partial
wave). Each CTA first waits until every main CTA of its (batch, head) has counted itself in
dq_done (after its bulk reductions were performed), so it reads only finished sums. The CTA
with the highest block index (launched last) also waits for the whole main grid before it
exits (griddepcontrol.wait): the postprocess then completes only after the main kernel, so
whatever follows on the stream may read dK and dV however stream order is relaxed.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_flash.kernels import rules
from cute_flash.kernels.bwd_sm90 import dq_tiled_mma
from cute_flash.kernels.dq_accumulate import DqBlockConverter
from cute_flash.kernels.layouts import sequence_major
from cute_flash.kernels.optional_arguments import check_given
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.ptx import wait_until_equal
from cute_flash.kernels.sequences import PackedBatch, SequenceLayout


class BackwardPostprocess:
    """`fragment_tile` = (block_m, dq_atom_m, num_mma_warpgroups, dq_swap_ab) of the main
    kernel's config: what its dQ fragment order depends on. `overlap=False` launches without
    programmatic dependent launch (after the main kernel has finished; for measuring the
    overlap). `packed`: a packed batch (kernels/sequences.py): dq_accum's blocks lie in each
    sequence's region, dQ's rows at its offset."""

    def __init__(self, dtype, head_dim: int, fragment_tile, overlap: bool = True, packed: bool = False):
        rules.require("BackwardPostprocess", rules.backward_postprocess(dtype.__name__.lower(), head_dim, fragment_tile))
        self.dtype = dtype
        self.head_dim = head_dim
        self.fragment_tile = fragment_tile
        self.overlap = overlap
        self.packed = packed
        self.sequences = SequenceLayout(AttentionProblem(packed=packed))
        self.tile_m, self.dq_atom_m, self.num_mma_warpgroups, self.swap_ab = fragment_tile
        self.converter = DqBlockConverter(dtype, head_dim, self.tile_m, self.num_mma_warpgroups)
        self.num_threads = self.converter.num_threads

    def optional_arguments(self) -> tuple:
        """Which of __call__'s optional arguments (batch) this kernel reads; the others are None
        (optional_arguments.py)."""
        return (self.packed,)

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # (B, N, Sq_pad, D) fp32
        mdQ: cute.Tensor,  # (B, N, Sq, D)
        mdQdone: cute.Tensor,  # (B, N) int32: main-kernel CTAs done adding
        num_key_blocks: Int32,  # main-kernel CTAs per (batch, head)
        softmax_scale: Float32,
        batch: PackedBatch | None,  # packed (then B = 1 above), else None (optional_arguments.py)
        stream: cuda.CUstream,
    ):
        check_given("the backward's postprocess", ("batch",), (batch,), self.optional_arguments())
        mdQaccum, mdQ = [sequence_major(t) for t in (mdQaccum, mdQ)]
        store = self.converter.store_copy()
        # dq_accum is read through the dQ MMA's fragment copy.
        tiled_mma_dq = dq_tiled_mma(self.dtype, self.head_dim, self.dq_atom_m, self.num_mma_warpgroups,
                                    self.tile_m, self.swap_ab)
        smem_bytes = self.converter.smem_bytes() + 128
        grid = (cute.ceil_div(mdQ.shape[0], self.tile_m), mdQ.shape[2], mdQ.shape[3])
        if const_expr(self.packed):
            # Query blocks of every sequence, numbered without empty ones (SequenceLayout.locate).
            grid = (self.sequences.block_numbers(mdQ.shape[0], self.tile_m, batch.cu_seqlens_q.shape[0] - 1),
                    mdQ.shape[2], 1)
        self.kernel(mdQaccum, mdQ, mdQdone, num_key_blocks, softmax_scale, batch, store, tiled_mma_dq).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=smem_bytes,
            stream=stream,
            use_pdl=self.overlap,
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        mdQdone: cute.Tensor,
        num_key_blocks: Int32,
        softmax_scale: Float32,
        packed: object,  # the PackedBatch of a packed batch, else None
        store: cute.TiledCopy,
        tiled_mma_dq: cute.TiledMma,
    ):
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.packed):
            seq, m_block, _ = self.sequences.locate(m_block, self.tile_m, False, mdQ, mdQ, packed)
            batch = seq.index
        else:
            seq = self.sequences.of(batch, mdQ, mdQ, packed)
        if self.sequences.has_rows(m_block, self.tile_m, seq):
            self.convert_block(mdQaccum, mdQ, mdQdone, num_key_blocks, softmax_scale, store, tiled_mma_dq,
                               m_block, head, batch, seq)
        if const_expr(self.overlap):
            num_x, num_heads, num_z = cute.arch.grid_dim()
            x, _, z = cute.arch.block_idx()
            if x == num_x - 1 and head == num_heads - 1 and z == num_z - 1:
                cute.arch.griddepcontrol_wait()

    @cute.jit
    def convert_block(self, mdQaccum, mdQ, mdQdone, num_key_blocks, softmax_scale, store, tiled_mma_dq, m_block,
                      head, batch, seq):
        """dQ of query block m_block of (batch, head) once its sums are complete."""
        tidx, _, _ = cute.arch.thread_idx()
        tile = (self.tile_m, self.head_dim)
        gAccum = cute.local_tile(self.sequences.padded_rows(mdQaccum, head, seq), tile, (m_block, 0))
        gdQ = cute.local_tile(self.sequences.rows(mdQ, head, seq), tile, (m_block, 0))
        if tidx == 0:
            wait_until_equal(mdQdone.iterator + cute.crd2idx((self.sequences.counter_batch(batch), head),
                                                             mdQdone.layout), num_key_blocks)
        # Thread 0's acquire orders the other threads' loads after the main kernel's sums.
        cute.arch.barrier()
        sdQ = cutlass.memory.SmemAllocator().allocate_tensor(self.dtype, self.converter.smem_layout(),
                                                             byte_alignment=128)
        self.converter.convert(gAccum, gdQ, seq.seqlen_q - m_block * self.tile_m, mdQ.shape[1], softmax_scale,
                               tiled_mma_dq, self.swap_ab, store, sdQ, tidx, None)
