"""Throughput of the SFU's operations on Hopper, relative to ex2.approx.f32 (one device call).

The softcap's cost (perf/NOTES.md, issue 21) is set by how many MUFU operations a score
takes; whether the half-precision forms (tanh.approx.f16x2, two MUFU.TANH.F16 in SASS) issue
any faster than the float32 ones was only read from SASS, never measured. Each variant runs
8 independent chains of one instruction per thread, with many warps per SM sub-partition,
and is timed with CUDA events; the table gives instructions per ns and the ratio to
ex2.approx.f32 (16 per clock per SM on sm_90), measured in the same rounds.

    python perf/experiments/sfu_throughput.py [--rounds 5] [--iters 4096]
    CUTE_DSL_ARCH=sm_90a CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=/tmp/sfu \\
        python perf/experiments/sfu_throughput.py --sass   # CPU: the loops' opcodes
"""

import argparse
import os
import statistics

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

CHAINS = 8
THREADS = 512
VARIANTS = {  # name: (PTX on one 32-bit register, values per instruction)
    "ex2.f32": ("ex2.approx.ftz.f32 $0, $1;", 1),
    "tanh.f32": ("tanh.approx.f32 $0, $1;", 1),
    # + 1 so that ptxas cannot fold rcp(rcp(x)) to x (it does); the FADD runs on another pipe.
    "rcp.f32": ("{ .reg .f32 t; rcp.approx.ftz.f32 t, $1; add.f32 $0, t, 0f3F800000; }", 1),
    "tanh.f16x2": ("tanh.approx.f16x2 $0, $1;", 2),
    "tanh.bf16x2": ("tanh.approx.bf16x2 $0, $1;", 2),
    "ex2.f16x2": ("ex2.approx.f16x2 $0, $1;", 2),
    "ex2.bf16x2": ("ex2.approx.ftz.bf16x2 $0, $1;", 2),
    "fma.f32": ("fma.rn.f32 $0, $1, $1, $1;", 1),
}


def make_kernel(asm: str):
    def op(v):
        return Int32(llvm.inline_asm(T.i32(), [Int32(v).ir_value()], asm, "=r,r", has_side_effects=False,
                                     is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, iters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        seed = x[i]
        v = [seed + Int32(k) for k in range(CHAINS)]
        for _ in cutlass.range(iters, unroll=4):
            for k in cutlass.range_constexpr(CHAINS):
                v[k] = op(v[k])
        total = v[0]
        for k in cutlass.range_constexpr(1, CHAINS):
            total = total ^ v[k]
        out[i] = total

    @cute.jit
    def launch(x: cute.Tensor, out: cute.Tensor, iters: Int32):
        kernel(x, out, iters).launch(grid=[x.shape[0] // THREADS, 1, 1], block=[THREADS, 1, 1])

    return launch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=4096)
    parser.add_argument("--sass", action="store_true", help="compile only and print each loop's MUFU opcodes")
    args = parser.parse_args()
    import torch
    from cutlass.cute.runtime import from_dlpack

    if args.sass:
        # CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR are read when the DSL is imported: set them outside.
        from pathlib import Path

        from cute_flash.sass import disassemble, opcode_counts
        dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
        for name, (asm, _) in VARIANTS.items():
            x = torch.zeros(THREADS, dtype=torch.int32)
            cute.compile(make_kernel(asm), from_dlpack(x), from_dlpack(x), Int32(1))
            cubins = sorted(dump.rglob("*.cubin"))  # one name for every variant: read, then remove
            sass = disassemble(cubins[0]) if cubins else ""
            if os.environ.get("SFU_SHOW") == name:
                print(sass)
            counts = opcode_counts(sass)
            for cubin in cubins:
                cubin.unlink()
            print(name, {k: v for k, v in counts.items() if k.startswith(("MUFU", "FFMA", "HFMA"))})
        return

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = sms * 8 * THREADS
    x = torch.randint(0x3C00, 0x3E00, (n,), dtype=torch.int32, device="cuda")  # small halves / tiny floats
    x = x | (x << 16)
    out = torch.empty_like(x)
    compiled = {name: cute.compile(make_kernel(asm), from_dlpack(x), from_dlpack(out), Int32(args.iters))
                for name, (asm, _) in VARIANTS.items()}
    times = {name: [] for name in VARIANTS}
    for r in range(args.rounds + 1):
        for name, fn in compiled.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(from_dlpack(x), from_dlpack(out), Int32(args.iters))
            end.record()
            torch.cuda.synchronize()
            if r:  # round 0 warms up
                times[name].append(start.elapsed_time(end))
    instructions = n * args.iters * CHAINS
    base = instructions / statistics.median(times["ex2.f32"])
    print(f"{'variant':>12} {'ms':>8} {'instr/ns':>9} {'vs ex2.f32':>10} {'values vs ex2.f32':>17}")
    for name, (asm, values) in VARIANTS.items():
        ms = statistics.median(times[name])
        rate = instructions / ms
        print(f"{name:>12} {ms:8.3f} {rate / 1e6:9.1f} {rate / base:10.3f} {values * rate / base:17.3f}")


if __name__ == "__main__":
    main()
