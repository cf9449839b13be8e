"""Where a forward key block's time goes, per consumer warpgroup: SM clock stamps at the phase
boundaries of every main-loop step (FlashForwardSm90._mainloop_step), written by each consumer
warpgroup's first thread to a trace buffer, then summarised (one device call).

Stamps (events) of one step of one warpgroup, in order:

  0 entry        the step starts (the previous block's P is stored)
  1 turn         K_j has landed and the ping-pong turn is ours (with pingpong; else = issued)
  2 issued       S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued, the turn passed on
  3 s_ready      S_j is complete (wait_group 1)
  4 softmax_end  the softmax of S_j is done, before the wait for P_{j-1} V_{j-1}
  5 pv_ready     P_{j-1} V_{j-1} is complete (wait_group 0)
  6 exit         P_j is stored (and O rescaled): the step ends

Phases reported (median cycles over the steady steps of every tile, i.e. without a tile's
first and last two steps): wait (0 -> 1), issue (1 -> 2), S (2 -> 3), softmax (3 -> 4), P V
wait (4 -> 5), store P (5 -> 6), period (0 -> next 0). Also the overlap of the two warpgroups'
softmax windows, and the instrumented kernel's time against the shipped one (the stamps'
own cost: predicated stores, clock reads that ptxas does not move code across).

The kernel class is the shipped one with _mainloop_step, _pingpong_wait / _pass and the
module's warpgroup.wait_group wrapped (nothing in cute_flash changes); the buffer's address is
compiled into the kernel as a constant, so each variant is compiled here, uncached.

    python perf/experiments/fwd_phase_trace.py [--shape 4,32,8192,128] [--dtype bfloat16]
        [--causal 1] [--cases plain,softcap30] [--value-head-dim 128] [--csv F]
"""

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

import cute_flash.kernels.fwd_sm90 as fwd_sm90  # noqa: E402
from cute_flash.benchmarking import round_medians, round_ratios, rotated_rounds, run_poisoned  # noqa: E402
from cute_flash.compile_fwd import compile_forward  # noqa: E402
from cute_flash.config import load_config_file, without_clusters  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.reference import attention_reference  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402

EVENTS = ("entry", "turn", "issued", "s_ready", "softmax_end", "pv_ready", "exit")
SLOTS = 8  # u32 per (step, warpgroup) record: the seven stamps and the SM id
MAX_STEPS = 256  # steps traced per tile (longer tiles keep their first MAX_STEPS)
WARPGROUPS = 3  # consumer warpgroups a record set has room for (two- and three-warpgroup tiles)
CSV_CTAS = 264  # CTAs written by --csv (two waves on 132 SMs)
WARPGROUP_THREADS = 128


@dsl_user_op
def _stamp_register(address: Int64, leader: Int32, register: str = "%clock", *, loc=None, ip=None):
    """Store a special register (the SM clock's low 32 bits, or %smid) at address if leader
    != 0 (one asm block: no branch)."""
    llvm.inline_asm(
        None, [Int64(address).ir_value(loc=loc, ip=ip), Int32(leader).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .pred p; .reg .u32 c; mov.u32 c, {register}; setp.ne.s32 p, $1, 0; @p st.global.u32 [$0], c; }}",
        "l,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def record_address(buffer_address: int, block, wg, record, event: int, records: int = MAX_STEPS):
    """Byte address of one stamp in a (blocks, WARPGROUPS, records, SLOTS) u32 trace buffer."""
    return Int64(buffer_address) + (((Int64(block) * WARPGROUPS + Int64(wg)) * records + Int64(record)) * SLOTS + event) * 4


def traced_class(buffer_address: int, light: bool = False, kernel_ref=None):
    """The shipped forward kernel class with stamps at EVENTS, written to buffer_address;
    light: only each step's entry and the tile's entry and exit (what fa4_fwd_phase_trace.py
    stamps in flash-attn-4). kernel_ref: a one-element list that receives the instance (for
    _StampedWaits)."""
    base = fwd_sm90.FlashForwardSm90

    class TracedForward(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if kernel_ref is not None:
                kernel_ref[0] = self

        @cute.jit
        def _stamp(self, event: cutlass.Constexpr[int]):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            consumer = tid - WARPGROUP_THREADS
            wg = consumer // WARPGROUP_THREADS
            # Steps past MAX_STEPS overwrite the last record.
            step = cutlass.min(self._trace_step, MAX_STEPS - 1)
            leader = Int32(consumer % WARPGROUP_THREADS == 0)
            _stamp_register(record_address(buffer_address, bid, wg, step, event), leader)
            if cutlass.const_expr(event == 0):
                _stamp_register(record_address(buffer_address, bid, wg, step, 7), leader, "%smid")

        @cute.jit
        def _mainloop_step(self, k_state, v_state, gemm_qk, gemm_pv, store_p, softmax, acc_o, acc_pv, k_pipe,
                           v_pipe, wg_idx, scale_log2, mask_fn, pending_scale):
            # k_state counts the key blocks consumed: the first block is taken before the loop,
            # so steps are numbered from 1.
            self._trace_step = k_state.count
            self._stamp(0)
            k_state, v_state = base._mainloop_step(
                self, k_state, v_state, gemm_qk, gemm_pv, store_p, softmax, acc_o, acc_pv, k_pipe, v_pipe, wg_idx,
                scale_log2, mask_fn, pending_scale)
            if cutlass.const_expr(not light):
                self._stamp(6)
            return k_state, v_state

        @cute.jit
        def consume(self, *args):
            # The tile's own record (step 0, which no main-loop step uses): entry and exit.
            self._trace_step = Int32(0)
            self._stamp(0)
            base.consume(self, *args)
            self._trace_step = Int32(0)
            self._stamp(6)

        def _pingpong_wait(self, wg_idx):
            base._pingpong_wait(self, wg_idx)
            if not light:
                self._stamp(1)

        def _pingpong_pass(self, wg_idx):
            base._pingpong_pass(self, wg_idx)
            if not light:
                self._stamp(2)

    return TracedForward


class _StampedWaits:
    """Stands in for fwd_sm90's `warpgroup` module while a traced kernel compiles: the step's
    wait_group(1) stamps s_ready after it, wait_group(0) softmax_end before and pv_ready after."""

    def __init__(self, real, kernel_ref, serial_pv=False):
        self._real, self._kernel, self._serial_pv = real, kernel_ref, serial_pv

    def __getattr__(self, name):
        return getattr(self._real, name)

    def wait_group(self, n):
        kernel = self._kernel[0]
        if n == 0:
            kernel._stamp(4)
        # serial_pv (a diagnostic, not a kernel): the wait for S also waits for P_{j-1} V_{j-1},
        # so no WGMMA of this warpgroup runs during its softmax.
        self._real.wait_group(0 if self._serial_pv else n)
        kernel._stamp(3 if n == 1 else 5)


def compile_with(kernel_class, dtype, d, problem, config, value_head_dim=None, warpgroup=None):
    """The forward compiled (uncached) with kernel_class standing in for FlashForwardSm90 (and
    `warpgroup`, where given, for fwd_sm90's warpgroup module) while it compiles."""
    real_class, real_wg = fwd_sm90.FlashForwardSm90, fwd_sm90.warpgroup
    fwd_sm90.FlashForwardSm90 = kernel_class
    fwd_sm90.warpgroup = warpgroup or real_wg
    try:
        return compile_forward(dtype, d, problem, config, value_head_dim=value_head_dim,
                               value_tile_head_dim=value_head_dim)
    finally:
        fwd_sm90.FlashForwardSm90, fwd_sm90.warpgroup = real_class, real_wg


def compile_traced(dtype, d, problem, config, buffer, value_head_dim=None, light=False, serial_pv=False):
    kernel_ref = [None]
    waits = None if light else _StampedWaits(fwd_sm90.warpgroup, kernel_ref, serial_pv)
    return compile_with(traced_class(buffer.data_ptr(), light, kernel_ref), dtype, d, problem, config,
                        value_head_dim, waits)


def _median_mean(values: torch.Tensor):
    """(median, mean) of a 1-D tensor, NaNs when it is empty."""
    values = values.double()
    return (values.median().item(), values.mean().item()) if values.numel() else (float("nan"), float("nan"))


def summarise(trace: torch.Tensor, ctas: int):
    """Per-phase medians over steady steps; trace is (ctas, WARPGROUPS, MAX_STEPS, SLOTS) int64 (u32 values)."""
    t = trace[:ctas].to(torch.int64)
    tile = t[:, :, 0, :].clone()  # step 0: the tile's entry (event 0) and exit (event 6)
    t[:, :, 0, :] = 0
    valid = t[..., 6] != 0  # a step's record exists where its exit stamp was written
    # Clock differences modulo 2^32.
    def diff(a, b):
        return (t[..., b] - t[..., a]) % (1 << 32)
    phases = {
        "wait": diff(0, 1), "issue": diff(1, 2), "S": diff(2, 3), "softmax": diff(3, 4),
        "pv_wait": diff(4, 5), "store_p": diff(5, 6), "step": diff(0, 6),
    }
    period = torch.zeros_like(t[..., 0])
    period[..., :-1] = (t[..., 1:, 0] - t[..., :-1, 0]) % (1 << 32)
    phases["period"] = period
    steps = valid.sum(-1)  # (ctas, 2)
    idx = torch.arange(t.shape[2])
    first = torch.argmax(valid.to(torch.int32), dim=-1, keepdim=True)  # first traced step
    last = first + steps.unsqueeze(-1) - 1
    steady = valid & (idx >= first + 2) & (idx <= last - 2)
    steady_period = steady & (idx <= last - 3)
    out = {}
    # The tile's prologue (entry to its first step: Q, the first key block's GEMM, mask and
    # softmax) and epilogue (last step's exit to the tile's end: the last P V, O's store),
    # over tiles with steps.
    has_steps = steps > 0
    first_entry = torch.gather(t[..., 0], 2, first).squeeze(-1)
    last_exit = torch.gather(t[..., 6], 2, last.clamp(min=0)).squeeze(-1)
    for name, values in (("tile_prologue", (first_entry - tile[..., 0]) % (1 << 32)),
                         ("tile_epilogue", (tile[..., 6] - last_exit) % (1 << 32)),
                         ("tile_total", (tile[..., 6] - tile[..., 0]) % (1 << 32))):
        out[name] = _median_mean(values[has_steps])
    for name, values in phases.items():
        out[name] = _median_mean(values[steady_period if name == "period" else steady])
    # The first steps of a tile (the masked ones of a causal tile come first): step times by position.
    by_position = []
    for pos in range(6):
        by_position.append(_median_mean(phases["step"][valid & (idx == first + pos)])[0])
    # Softmax windows of the two warpgroups of one CTA at one step: how much they overlap.
    s0, e0 = t[:, 0, :, 3], t[:, 0, :, 4]
    s1, e1 = t[:, 1, :, 3], t[:, 1, :, 4]
    both = steady[:, 0] & steady[:, 1]
    lo = torch.maximum(s0, s1)
    hi = torch.minimum(e0, e1)
    out["softmax_overlap_same_step"] = _median_mean((hi - lo).clamp(min=0)[both])
    # The other warpgroup's S ready relative to ours (0 -> 1 lead at the same step).
    lead = ((t[:, 1, :, 3] - t[:, 0, :, 3]) % (1 << 32)).to(torch.int64)
    out["wg1_s_after_wg0_s"] = _median_mean(torch.where(lead > (1 << 31), lead - (1 << 32), lead)[both])
    return out, by_position, int(steady.sum())


CASES = {  # name: (softcap, pingpong override or None, serial_pv: the traced kernel only)
    "plain": (0.0, None, False),
    "softcap30": (30.0, None, False),
    "softcap30_nopp": (30.0, False, False),
    "softcap50": (50.0, None, False),
    "plain_nopp": (0.0, False, False),
    "softcap30_serial_pv": (30.0, None, True),
    "plain_serial_pv": (0.0, None, True),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,32,8192,128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--value-head-dim", type=int, default=None)
    parser.add_argument("--cases", default="plain,softcap30")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--csv", default=None, help="write the raw trace of the first CSV_CTAS CTAs of each case to CSV (prefix)")
    args = parser.parse_args()

    b, n, s, d = (int(x) for x in args.shape.split(","))
    dv = args.value_head_dim or d
    causal = bool(args.causal)
    torch_dtype = getattr(torch, args.dtype)
    table = load_config_file(Path(__file__).resolve().parents[2] / "configs" / "h100.yaml")
    config = without_clusters(table.lookup(args.dtype, d, causal, "fwd", seqlen=s, value_head_dim=dv))
    ctas = b * n * math.ceil(s / config.block_m)
    buffer = torch.zeros(ctas, WARPGROUPS, MAX_STEPS, SLOTS, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)
    sink, packed = None, DENSE_BATCH
    q, k = (torch.randn(b, n, s, d, device="cuda", dtype=torch_dtype) for _ in range(2))
    v = torch.randn(b, n, s, dv, device="cuda", dtype=torch_dtype)
    out = torch.empty(b, n, s, dv, device="cuda", dtype=torch_dtype)
    lse = torch.empty(b, n, s, dtype=torch.float32, device="cuda")
    results = {}
    sides = {}
    for name in args.cases.split(","):
        cap, pingpong, serial_pv = CASES[name]
        cfg = config if pingpong is None else dataclasses.replace(config, pingpong=pingpong)
        problem = AttentionProblem.of(causal, softcap=cap)
        shipped = compile_forward(args.dtype, d, problem, cfg, value_head_dim=args.value_head_dim,
                                  value_tile_head_dim=args.value_head_dim)
        traced = compile_traced(args.dtype, d, problem, cfg, buffer, value_head_dim=args.value_head_dim,
                                serial_pv=serial_pv)
        # Correctness of the traced kernel (it must compute what the shipped one does).
        qs, ks, vs = q[:1, :2, :1000], k[:1, :2, :1000], v[:1, :2, :1000]
        o_t, _ = run_poisoned(traced, qs, ks, vs, scale)
        ref, _ = attention_reference(qs, ks, vs, causal=causal, softcap=cap)
        err = (o_t.double() - ref).abs().max().item()
        print(f"{name}: traced kernel max error {err:.2e} on (1, 2, 1000, {d})")
        buffer.zero_()
        traced(q, k, v, out, lse, sink, *packed, scale)
        torch.cuda.synchronize()
        trace = buffer.cpu().to(torch.int64) % (1 << 32)
        results[name] = summarise(trace, ctas)
        if args.csv:
            flat = trace[:CSV_CTAS].reshape(-1, SLOTS)
            nz = flat[:, 6] != 0
            index = torch.nonzero(nz).squeeze(1)
            with open(f"{args.csv}-{name}.csv", "w") as f:
                f.write("cta,wg,step," + ",".join(EVENTS) + ",smid\n")
                for i, row in zip(index.tolist(), flat[nz].tolist()):
                    cta, rest = divmod(i, 2 * MAX_STEPS)
                    wg, step = divmod(rest, MAX_STEPS)
                    f.write(f"{cta},{wg},{step}," + ",".join(str(x) for x in row) + "\n")
        sides[name] = lambda fn=shipped: fn(q, k, v, out, lse, sink, *packed, scale)
        sides[name + "+trace"] = lambda fn=traced: fn(q, k, v, out, lse, sink, *packed, scale)
    with torch.no_grad():
        rows = rotated_rounds(sides, args.rounds, args.hold)
    first = args.cases.split(",")[0]
    print(f"\n{args.shape} dv={dv} {args.dtype} causal={causal} config {config}")
    print(f"{'case':18s} {'ms':>8s} {'/first':>7s}")
    for name in sides:
        print(f"{name:18s} {round_medians(rows, name)[0]:8.4f} {round_ratios(rows, name, first)[0]:7.3f}")
    print("\nmedian (mean) cycles per steady step and warpgroup:")
    names = list(results)
    keys = list(results[names[0]][0])
    print(f"{'phase':26s} " + " ".join(f"{x:>20s}" for x in names))
    for key in keys:
        print(f"{key:26s} " + " ".join(f"{results[x][0][key][0]:9.0f} ({results[x][0][key][1]:7.0f})" for x in names))
    print(f"{'steady records':26s} " + " ".join(f"{results[x][2]:>20d}" for x in names))
    print("\nstep cycles by position in the tile (first six steps, median):")
    for x in names:
        print(f"{x:18s} " + " ".join(f"{v:7.0f}" for v in results[x][1]))


if __name__ == "__main__":
    main()
