"""One-off: does the TF32 WGMMA round or truncate float32 operands? (GPU script; RS=1 feeds A
from registers.) Prints the largest error of a 64x64x32 product against float64 on the raw
inputs, on inputs truncated to TF32 and on inputs rounded to TF32: the one near 0 names what
the tensor cores do. Also the first check that the DSL builds a TF32 atom (cute_flash's
kernels/wgmma.MmaTF32Op is this op)."""
import os
import cutlass, cutlass.cute as cute
from cutlass import Float32
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum
import cuda.bindings.driver as cuda

from cute_flash.kernels.wgmma import MmaTF32Op  # noqa: E402

K = cute.nvgpu.OperandMajorMode.K
SRC = warpgroup.OperandSource.RMEM if os.environ.get("RS") else warpgroup.OperandSource.SMEM
op = MmaTF32Op((64, 64, 8), SRC, K, K)


class Probe:
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream: cuda.CUstream):
        tiled = cute.make_tiled_mma(cute.make_mma_atom(op), (1, 1, 1), permutation_mnk=None)
        atom = warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, Float32, 32), Float32)
        sl = cute.tile_to_shape(atom, (64, 32), order=(0, 1))
        self.kernel(mA, mB, mC, tiled, sl).launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mA, mB, mC, tiled: cute.TiledMma, sl: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(Float32, sl.outer, 1024, swizzle=sl.inner)
        sB = smem.allocate_tensor(Float32, sl.outer, 1024, swizzle=sl.inner)
        for i in cutlass.range(tidx, 64 * 32, 128):
            r = i // 32
            c = i % 32
            sA[r, c] = mA[r, c]
            sB[r, c] = mB[r, c]
        cute.arch.fence_view_async_shared()
        cute.arch.barrier()
        thr = tiled.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((64, 64)), Float32)
        acc.fill(0.0)
        wg = tiled.get_slice(0)
        if cutlass.const_expr(SRC == warpgroup.OperandSource.SMEM):
            tA = wg.make_fragment_A(wg.partition_A(sA))
        else:
            tA = thr.make_fragment_A(thr.partition_shape_A((64, 32)))
            cute.autovec_copy(thr.partition_A(sA), tA)
        tB = wg.make_fragment_B(wg.partition_B(sB))
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(tiled, acc, tA[None, None, k], tB[None, None, k], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        tC = thr.partition_C(mC)
        cute.autovec_copy(acc, tC)

if __name__ == "__main__":
    import torch
    from cutlass.cute.runtime import from_dlpack
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(64, 32, device=dev); b = torch.randn(64, 32, device=dev); c = torch.zeros(64, 64, device=dev)
    ta, tb, tc = (from_dlpack(x, assumed_align=16) for x in (a, b, c))
    fn = cute.compile(Probe(), ta, tb, tc, cuda.CUstream(0), options="--enable-tvm-ffi") if False else cute.compile(Probe(), ta, tb, tc, cuda.CUstream(0))
    print("compiled")
    if dev == "cuda":
        fn(ta, tb, tc, cuda.CUstream(torch.cuda.current_stream().cuda_stream)); torch.cuda.synchronize()
        ref = a.double() @ b.double().T
        trunc = lambda x: (x.view(torch.int32) & ~0x1FFF).view(torch.float32)
        rnd = lambda x: ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
        print("err vs exact", (c.double() - ref).abs().max().item())
        print("err vs trunc", (c.double() - trunc(a).double() @ trunc(b).double().T).abs().max().item())
        print("err vs round", (c.double() - rnd(a).double() @ rnd(b).double().T).abs().max().item())
