"""Where a small float32 forward's time goes, piece by piece, beside SDPA's efficient backend
and our own bf16 forward (GPU machine). The seeds' grid reads our float32 forward below
S = 1024 as 0.25-0.65x SDPA efficient's (host-bound). Each piece is timed as host us per call
in a loop without synchronisation (perf/host_overhead.py's per_call_us), in rotated rounds,
medians; then each kernel's GPU time from the profiler.

    ours f32 / ours bf16     cute_flash.flash_attention, causal, no grad
    sdpa efficient f32       SDPA's efficient backend on the same float32 inputs
    plan.run                 the cached plan's run (what flash_attention calls)
    kernel_operands          cute_flash.float32.kernel_operands (the operand pass, all of it,
                             its OperandPass looked up by the shapes)
    operand_pass.run         the plan's OperandPass run (what plan.run calls)
    kernel_operands, old     with --old-float32 FILE: that file's kernel_operands (an earlier
                             cute_flash/float32.py, e.g. `git show REV:cute_flash/float32.py`),
                             its host path against today's kernels
    torch max-norms (3)      three torch max-norm reductions (the halves' maxima before they
                             were reduced in the operand pass; only when the halves run)
    operand kernel, given    the compiled operand pass with its outputs (and tops) given
    launch, given            the forward kernel with its operands given

    python perf/experiments/fp32_fwd_host_parts.py [--rounds 5] [--iters 300] [--shapes 1,16,128,64 ...]
        [--old-float32 FILE]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import api, float32  # noqa: E402
from cute_flash.kernels.rules import SCALED_HALVES  # noqa: E402
from host_overhead import rotated_per_call_us  # noqa: E402


def load_module(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("old_float32", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases_for(shape, old_float32=None):
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float32) for _ in range(3))
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    cute_flash.flash_attention(q, k, v, causal=True)
    plan = next(p for p in api._plans.values() if p.dtype == torch.float32 and p.lse_shape[2] == shape[2]
                and p.operand_pass is not None and p.value_head_dim == shape[3])
    name, tile = plan.operand_pass.dtype_name, plan.operand_pass.tile
    operands = float32.kernel_operands(name, q, k, v, tile)
    out = torch.empty_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    cases = {
        "ours f32": lambda: cute_flash.flash_attention(q, k, v, causal=True),
        "ours bf16": lambda: cute_flash.flash_attention(qb, kb, vb, causal=True),
        "sdpa efficient f32": sdpa,
        "plan.run": lambda: plan.run(q, k, v, False),
        "kernel_operands": lambda: float32.kernel_operands(name, q, k, v, tile),
        "operand_pass.run": lambda: plan.operand_pass.run((q, k, v)),
        "launch, given": lambda: plan._launch(*operands[:3], out, plan.lse_sink, None, operands[3]),
    }
    if old_float32 is not None:
        cases["kernel_operands, old"] = lambda: old_float32.kernel_operands(name, q, k, v, tile)
    if name == SCALED_HALVES:
        # The plan's own pass, its outputs allocated once here (not a kept set).
        operand_pass = plan.operand_pass
        *outs, scales, partials = operand_pass.buffers(keep=False)
        # (What the pass did before it reduced the maxima itself: three torch max-norms.)
        cases["torch max-norms (3)"] = lambda: tuple(torch.linalg.vector_norm(t, ord=float("inf"), dim=(2, 3))
                                                     for t in (q, k, v))
        cases["operand kernel, given"] = lambda: operand_pass.kernel(q, k, v, *outs, partials, 7, scales)
    return name, cases


def kernel_table(fn, calls=50):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            rows.append((event.key[:60], event.count // calls, event.device_time_total / calls))
    return sorted(rows, key=lambda r: -r[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--shapes", nargs="+", default=["1,16,128,16", "1,16,128,64", "1,16,128,128",
                                                        "1,16,512,128"])
    parser.add_argument("--old-float32", help="an earlier cute_flash/float32.py whose kernel_operands to time too")
    args = parser.parse_args()
    old_float32 = load_module(args.old_float32) if args.old_float32 else None
    print(f"float32 matmul precision: {torch.get_float32_matmul_precision()}", flush=True)
    print(f"{'shape':20s} {'path':24s} {'median us':>10s} {'min':>8s} {'max':>8s}", flush=True)
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        name, cases = cases_for(shape, old_float32)
        results = rotated_per_call_us(cases, args.rounds, args.iters)
        for label, values in results.items():
            print(f"{str(shape):20s} {label:24s} {statistics.median(values):10.1f} {min(values):8.1f} "
                  f"{max(values):8.1f}  ({name})", flush=True)
        for label in ("ours f32", "sdpa efficient f32"):
            for kernel, count, us in kernel_table(cases[label]):
                print(f"{str(shape):20s}   GPU {label:18s} {us:7.1f} us x{count} {kernel}", flush=True)


if __name__ == "__main__":
    main()
