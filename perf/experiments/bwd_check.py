"""Correctness and speed of the Hopper backward kernels (GPU script).

    python perf/experiments/bwd_check.py                 # full grid + timings
    python perf/experiments/bwd_check.py --quick         # a few cases, no timings
    python perf/experiments/bwd_check.py --no-timing     # full grid only
    python perf/experiments/bwd_check.py --timing-only
    python perf/experiments/bwd_check.py --variants base,det,pds1   # named configs: check + bwd timing table
    python perf/experiments/bwd_check.py --deterministic            # det config: bitwise dq + fwd+bwd timing

For every case: random q, k, v, dout; out and lse from cute_flash's forward; dq, dk, dv from
cute_flash.launch_bwd.backward_with_config into NaN-poisoned buffers; the same gradients
from float64 autograd of the naive attention. Error = max|a - b| / max|b| (absolute when max|b| = 0),
tolerance 1e-2 for fp16 and 2e-2 for bf16. A failing or crashing case is reported and the
run goes on. Then fwd + bwd is timed (CUDA events, warm-up, median) on (4, 64, 8192, 128)
fp16, causal and not, beside torch SDPA (cuDNN and flash backends) and flash_attn.cute if
it is importable. The log goes to stdout and, when $OUT is set, to $OUT/bwd_check.log.

--variants NAME,... : each name is a dataclasses.replace of the YAML bwd config (the one
launch_bwd uses) with the fields in VARIANTS; names in DQ_VARIANTS run the separate dQ
kernel (with those tiles) for every Sq. --shape B,N,S,D changes the timing shape. Every variant is checked on VARIANT_CASES
(both dtypes, D 64/128, causal on/off, lengths 1, 17, 1000, Sq != Sk); deterministic
variants must also give bitwise-identical dq (and dk, dv) over 3 runs. Then the backward
alone of every variant is timed on (4, 64, 8192, 128) fp16, causal and not, and a table
closes the log. --deterministic: a few cases with the deterministic config, then fwd+bwd
deterministic vs not on (4, 64, 8192, 128) fp16.
"""

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from cute_flash.benchmarking import time_ms  # noqa: E402

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
_log_file = None


def log(msg=""):
    print(msg, flush=True)
    if _log_file is not None:
        _log_file.write(msg + "\n")
        _log_file.flush()


def rel_err(actual, expected):
    expected = expected.double()
    diff = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    return diff / scale if scale > 0 else diff


def reference_grads(q, k, v, dout, causal, scale):
    from cute_flash.reference import attention_reference

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = attention_reference(*leaves, causal=causal, softmax_scale=scale)
    (out * dout.double()).sum().backward()
    return [t.grad for t in leaves]


def grid(quick):
    cases = []  # (B, N, Sq, Sk, D, dtype, causal, note)
    dtypes = (torch.float16, torch.bfloat16)
    if quick:
        for dt in dtypes:
            for causal in (False, True):
                cases.append((2, 2, 1000, 1000, 128, dt, causal, ""))
                cases.append((2, 2, 17, 300, 64, dt, causal, ""))
        return cases
    for s in (1, 17, 128, 1000, 4096):
        b, n = (2, 2) if s <= 1000 else (1, 2)
        for d in (64, 128):
            for dt in dtypes:
                for causal in (False, True):
                    cases.append((b, n, s, s, d, dt, causal, ""))
    for sq, sk in ((1, 1000), (1000, 1), (17, 300), (300, 17), (128, 1000), (1000, 128), (4096, 1000), (1000, 4096)):
        for d in (64, 128):
            for dt in dtypes:
                for causal in (False, True):
                    cases.append((1, 3, sq, sk, d, dt, causal, ""))
    for causal in (False, True):
        cases.append((2, 3, 700, 700, 128, torch.float16, causal, "bsnd-view"))
        cases.append((1, 2, 1000, 1000, 64, torch.bfloat16, causal, "logits*5,scale=0.3"))
    return cases


# Named variants for --variants: fields replaced in the YAML bwd config.
VARIANTS = {
    "base": {},
    "det": {"deterministic": True},
    "pds1": {"num_stages_pds": 1},
    # D = 64 only (checked on the D = 64 cases): FA3's 128-query step, dQ split over rows.
    "d64_m128": {"block_m": 128, "dq_atom_m": 2},
    # D = 128 only: FA3's non-causal step of 80 query rows, dQ^T = K^T dS^T.
    "m80": {"block_m": 80, "dq_swap_ab": True, "dq_stages": 1},
    "m80_pds1": {"block_m": 80, "dq_swap_ab": True, "num_stages_pds": 1, "dq_stages": 1},
    "m64_swap": {"dq_swap_ab": True},
    # dV issued after dS is formed (fewer live registers, less overlap).
    "late_dv": {"dv_after_ds": True},
    "m80_late_dv": {"block_m": 80, "dq_swap_ab": True, "dv_after_ds": True, "dq_stages": 1},
    "m80_late_dv_pds1": {"block_m": 80, "dq_swap_ab": True, "dv_after_ds": True, "num_stages_pds": 1, "dq_stages": 1},
    # D = 64: FA3's 128-query step, which fits without serialised WGMMAs once dV follows dS.
    "d64_m128_late_dv": {"block_m": 128, "dq_atom_m": 2, "dv_after_ds": True},
    "d64_m128_late_dv_pds2": {"block_m": 128, "dq_atom_m": 2, "dv_after_ds": True, "num_stages_pds": 2},
    # Two shared-memory dQ tiles: the consumers do not wait for the previous block's reduction.
    "dq2": {"dq_stages": 2},
    "dq2_det": {"dq_stages": 2, "deterministic": True},
    "dq2_pds1": {"dq_stages": 2, "num_stages_pds": 1},
    "dq2_late_dv": {"dq_stages": 2, "dv_after_ds": True},
}
# Variants that only exist for one head dim: their check cases and timings use only it.
VARIANT_HEAD_DIM = {"d64_m128": 64, "m80": 128, "m80_pds1": 128, "m64_swap": 128, "m80_late_dv": 128, "m80_late_dv_pds1": 128,
                    "d64_m128_late_dv": 64, "d64_m128_late_dv_pds2": 64}

# Variants that compute dQ in the separate kernel (bwd_dq_sm90) from every Sq: the YAML bwd
# config for dK / dV, and these SeparateDqConfig fields.
DQ_VARIANTS = {
    "sep": dict(block_m=128, block_n=128, num_stages=2, num_mma_warpgroups=2),
    "sep_n64": dict(block_m=128, block_n=64, num_stages=2, num_mma_warpgroups=2),
    "sep_n64_s3": dict(block_m=128, block_n=64, num_stages=3, num_mma_warpgroups=2),
    "sep_m64": dict(block_m=64, block_n=128, num_stages=2, num_mma_warpgroups=1),
}
VARIANTS.update({name: {} for name in DQ_VARIANTS})

VARIANT_CASES = [  # (B, N, Sq, Sk, D, dtype, causal, note)
    (2, 2, 1000, 1000, 128, torch.float16, False, ""),
    (2, 2, 1000, 1000, 128, torch.float16, True, ""),
    (2, 2, 1000, 1000, 64, torch.bfloat16, False, ""),
    (2, 2, 1000, 1000, 64, torch.bfloat16, True, ""),
    (2, 2, 1, 1, 128, torch.float16, False, ""),
    (2, 2, 1, 1, 64, torch.bfloat16, True, ""),
    (2, 2, 17, 17, 64, torch.float16, True, ""),
    (2, 2, 17, 17, 128, torch.bfloat16, False, ""),
    (1, 3, 17, 300, 128, torch.float16, False, ""),
    (1, 3, 17, 300, 128, torch.float16, True, ""),
    (1, 3, 300, 17, 64, torch.bfloat16, False, ""),
    (1, 3, 300, 17, 64, torch.bfloat16, True, ""),
    (1, 3, 1, 1000, 128, torch.bfloat16, True, ""),
    (1, 3, 1000, 1, 64, torch.float16, False, ""),
    (1, 3, 1000, 4096, 128, torch.bfloat16, False, ""),
    (1, 3, 1000, 4096, 128, torch.bfloat16, True, ""),
    (1, 3, 4096, 1000, 64, torch.float16, False, ""),
    (1, 3, 4096, 1000, 64, torch.float16, True, ""),
    (1, 2, 4096, 4096, 128, torch.float16, True, ""),
    (1, 2, 4096, 4096, 64, torch.bfloat16, False, ""),
    (2, 3, 700, 700, 128, torch.float16, True, "bsnd-view"),
    (1, 2, 1000, 1000, 128, torch.bfloat16, False, "logits*5,scale=0.3"),
]

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def variant_config(name, dtype, head_dim, causal):
    from cute_flash.config import get_config

    base = get_config(DTYPE_NAMES[dtype], head_dim, causal, "bwd", torch.device("cuda"))
    return dataclasses.replace(base, **VARIANTS[name])


def variant_dq_config(name):
    from cute_flash.config import SeparateDqConfig

    if name not in DQ_VARIANTS:
        return None
    return SeparateDqConfig(min_seqlen_q=1, **DQ_VARIANTS[name])


def make_inputs(b, n, sq, sk, d, dtype, note):
    if note == "bsnd-view":
        def rand(s):
            return torch.randn(b, s, n, d, device="cuda", dtype=dtype).transpose(1, 2)
    else:
        mult = 5.0 if note.startswith("logits*5") else 1.0

        def rand(s):
            return (torch.randn(b, n, s, d, device="cuda") * mult).to(dtype)
    return rand(sq), rand(sk), rand(sk)


def run_case(case, variant=None):
    """Gradients of one case against float64 autograd. With a variant name, the backward runs
    with that variant's config, and a deterministic variant must reproduce dq, dk, dv bitwise
    over 3 runs (`det` is then that verdict; otherwise whether 2 runs agree, reported only)."""
    from cute_flash import launch_bwd, launch_fwd
    from cute_flash.kernels.problem import AttentionProblem

    b, n, sq, sk, d, dtype, causal, note = case
    config = variant_config(variant or "base", dtype, d, causal)
    dq_config = variant_dq_config(variant)
    q, k, v = make_inputs(b, n, sq, sk, d, dtype, note)
    scale = 0.3 if "scale=0.3" in note else 1.0 / math.sqrt(d)
    out, lse = launch_fwd.forward(q, k, v, AttentionProblem.of(causal), scale)
    dout = torch.randn_like(out)
    grads = tuple(torch.full(t.shape, float("nan"), dtype=dtype, device="cuda") for t in (q, k, v))
    dq, dk, dv = launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                                 config=config, grads=grads, dq_config=dq_config)
    torch.cuda.synchronize()
    expected = reference_grads(q, k, v, dout, causal, scale)
    errs = {}
    finite = True
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        finite = finite and bool(torch.isfinite(got).all())
        errs[name] = rel_err(got, want)
    ok = finite and all(e <= TOLERANCE[dtype] for e in errs.values())
    if config.deterministic:
        deterministic = True
        for _ in range(2):
            again = launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                                    config=config, dq_config=dq_config)
            torch.cuda.synchronize()
            deterministic = deterministic and all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))
        ok = ok and deterministic
        return ok, finite, errs, deterministic
    # dQ summed across CTAs in any order is not bitwise deterministic; report it, do not fail on it.
    dq2, _, _ = launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                                config=config, dq_config=dq_config)
    torch.cuda.synchronize()
    deterministic = torch.equal(dq, dq2)
    return ok, finite, errs, deterministic


def check(quick, cases=None, variant=None):
    cases = grid(quick) if cases is None else cases
    log(f"== correctness{' of variant ' + variant if variant else ''}: {len(cases)} cases"
        + (f" {VARIANTS[variant]}" if variant else ""))
    passed = failed = crashed = 0
    for case in cases:
        b, n, sq, sk, d, dtype, causal, note = case
        name = (f"B={b} N={n} Sq={sq:5d} Sk={sk:5d} D={d:3d} {str(dtype)[6:]:8s} "
                f"{'causal' if causal else 'full  '} {note}")
        t0 = time.time()
        try:
            ok, finite, errs, det = run_case(case, variant)
        except Exception as exc:  # noqa: BLE001 - one bad case must not end the run
            crashed += 1
            log(f"CRASH {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            log("      " + traceback.format_exc().replace("\n", "\n      ")[-2000:])
            torch.cuda.synchronize()
            continue
        passed += ok
        failed += not ok
        err_text = " ".join(f"{k}={v:.2e}" for k, v in errs.items())
        log(f"{'PASS ' if ok else 'FAIL '} {name} {err_text}{'' if finite else ' NON-FINITE'}"
            f" det={'y' if det else 'n'} ({time.time() - t0:.1f}s)")
    log(f"== summary{' ' + variant if variant else ''}: {passed} passed, {failed} failed, "
        f"{crashed} crashed, of {len(cases)}")
    return failed == 0 and crashed == 0, f"{passed}/{len(cases)}" + (f" ({crashed} crashed)" if crashed else "")


def timing():
    from cute_flash import launch_bwd, launch_fwd
    from cute_flash.kernels.problem import AttentionProblem

    b, n, s, d = 4, 64, 8192, 128
    dtype = torch.float16
    log(f"== timing: fwd + bwd, (B, N, S, D) = ({b}, {n}, {s}, {d}) fp16")
    fa_func = None
    try:
        from flash_attn.cute import flash_attn_func as fa_func  # noqa: F811
    except Exception as exc:  # noqa: BLE001
        log(f"   flash_attn.cute not importable: {type(exc).__name__}")
    for causal in (False, True):
        flops = 4 * b * n * s * s * d * 3.5 / (2 if causal else 1)  # fwd + bwd (= 2.5 fwd)
        bwd_flops = flops * 2.5 / 3.5
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(3))
        dout = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        rows = []

        config = variant_config("base", dtype, d, causal)  # the shipped YAML entry

        def ours():
            out, lse = launch_fwd.forward(q, k, v, AttentionProblem.of(causal), scale)
            launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale, config=config)

        out0, lse0 = launch_fwd.forward(q, k, v, AttentionProblem.of(causal), scale)

        def ours_bwd():
            launch_bwd.backward_with_config(q, k, v, out0, dout, lse0, AttentionProblem.of(causal), scale,
                                            config=config)

        rows.append(("cute_flash fwd+bwd", ours, flops))
        rows.append(("cute_flash bwd only", ours_bwd, bwd_flops))

        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for label, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    out.backward(dout)
            rows.append((label + " fwd+bwd", sdpa, flops))

        if fa_func is not None:
            qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
            dout_s = dout.transpose(1, 2).contiguous()

            def fa():
                res = fa_func(qs, ks, vs, causal=causal)
                out = res[0] if isinstance(res, tuple) else res
                out.backward(dout_s)
            rows.append(("flash_attn.cute fwd+bwd", fa, flops))

        for label, fn, fl in rows:
            try:
                ms = time_ms(fn)
                log(f"   {'causal' if causal else 'full  '} {label:26s} {ms:8.3f} ms  {fl / ms / 1e9:7.1f} TFLOP/s")
            except Exception as exc:  # noqa: BLE001
                log(f"   {'causal' if causal else 'full  '} {label:26s} ERROR {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}")
            qg.grad = kg.grad = vg.grad = None
        del q, k, v, dout, qg, kg, vg
        torch.cuda.empty_cache()


TIMING_SHAPE = (4, 64, 8192, 128)
TIMING_DTYPE = torch.float16
TIMING_ROUNDS = 7


def variant_timing(names, with_fwd=False):
    """Median ms of the backward alone (and optionally fwd + bwd) of each variant on
    TIMING_SHAPE (--shape) in TIMING_DTYPE (--dtype), causal and not: {(name, causal, what): ms or error text}.
    Also the peak memory the backward allocates beyond its inputs and outputs."""
    from cute_flash import launch_bwd, launch_fwd
    from cute_flash.kernels.problem import AttentionProblem

    b, n, s, d = TIMING_SHAPE
    dtype = TIMING_DTYPE
    results = {}
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for _ in range(3))
        dout = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        out0, lse0 = launch_fwd.forward(q, k, v, AttentionProblem.of(causal), scale)
        calls = {}  # (name, what) -> fn
        for name in names:
            try:
                config = variant_config(name, dtype, d, causal)
            except Exception as exc:  # noqa: BLE001
                results[(name, causal, "bwd")] = f"ERROR {type(exc).__name__}"
                continue

            dq_config = variant_dq_config(name)
            grads = tuple(torch.empty_like(t) for t in (q, k, v))

            def bwd(config=config, dq_config=dq_config, grads=grads):
                launch_bwd.backward_with_config(q, k, v, out0, dout, lse0, AttentionProblem.of(causal), scale,
                                                config=config, dq_config=dq_config, grads=grads)

            def fwd_bwd(config=config, dq_config=dq_config, grads=grads):
                out, lse = launch_fwd.forward(q, k, v, AttentionProblem.of(causal), scale)
                launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(causal), scale,
                                                config=config, dq_config=dq_config, grads=grads)

            try:
                bwd()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base_mem = torch.cuda.memory_allocated()
                bwd()
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
                log(f"   {name:10s} {'causal' if causal else 'full  '} bwd work memory {extra:9.1f} MiB")
            except Exception as exc:  # noqa: BLE001
                log(f"   {name:10s} memory probe failed: {type(exc).__name__}: {exc}")
                results[(name, causal, "bwd")] = f"ERROR {type(exc).__name__}"
                continue
            for what, fn in (("bwd", bwd), ("fwd+bwd", fwd_bwd)) if with_fwd else (("bwd", bwd),):
                calls[(name, what)] = fn
        # Interleaved rounds (every variant once per round, median over rounds): clock and
        # thermal drift over the run then hits all variants alike.
        samples = {key: [] for key in calls}
        for _ in range(TIMING_ROUNDS):
            for key, fn in calls.items():
                if isinstance(samples[key], str):
                    continue
                try:
                    samples[key].append(time_ms(fn, warmup=1, iters=3))
                except Exception as exc:  # noqa: BLE001
                    samples[key] = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    torch.cuda.synchronize()
        for (name, what), got in samples.items():
            results[(name, causal, what)] = got if isinstance(got, str) else statistics.median(got)
            log(f"   {name:10s} {'causal' if causal else 'full  '} {what:8s} "
                f"{_fmt_time(results[(name, causal, what)], causal, what)}")
        del q, k, v, dout, out0, lse0
        torch.cuda.empty_cache()
    return results


def _fmt_time(ms, causal, what):
    if isinstance(ms, str):
        return ms
    b, n, s, d = TIMING_SHAPE
    flops = 4 * b * n * s * s * d * (2.5 if what == "bwd" else 3.5) / (2 if causal else 1)
    return f"{ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s"


def run_variants(names, with_timing, cases=None, with_fwd=False):
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        log(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        return False
    ok = True
    verdicts = {}
    for name in names:
        variant_cases = cases if cases is not None else VARIANT_CASES
        if name in VARIANT_HEAD_DIM:
            variant_cases = [c for c in variant_cases if c[4] == VARIANT_HEAD_DIM[name]]
        passed, verdicts[name] = check(False, variant_cases, name)
        ok = ok and passed
    timings = {}
    if with_timing:
        log(f"== timing: {TIMING_SHAPE} {DTYPE_NAMES[TIMING_DTYPE]}, {'fwd+bwd and ' if with_fwd else ''}bwd alone")
        try:
            timings = variant_timing(names, with_fwd)
        except Exception:  # noqa: BLE001
            log("timing failed:\n" + traceback.format_exc())
    log("== variants")
    whats = ("bwd", "fwd+bwd") if with_fwd else ("bwd",)
    header = f"   {'variant':10s} {'correct':>8s}"
    for what in whats:
        header += f" {what + ' full ms':>16s} {what + ' causal ms':>18s}"
    log(header + "   fields")
    for name in names:
        row = f"   {name:10s} {verdicts[name]:>8s}"
        for what in whats:
            for causal, width in ((False, 16), (True, 18)):
                ms = timings.get((name, causal, what), "-")
                row += f" {ms:{width}.3f}" if not isinstance(ms, str) else f" {ms[:width]:>{width}s}"
        log(row + f"   {VARIANTS[name]}")
    return ok


def main():
    global _log_file
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--timing-only", action="store_true")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated names among {', '.join(VARIANTS)}")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic config: bitwise-reproducible dq on a few cases, "
                             "fwd+bwd timing deterministic vs not")
    parser.add_argument("--shape", default=None, help="B,N,S,D of the variant timings (default 4,64,8192,128)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                        help="dtype of the variant timings")
    args = parser.parse_args()
    global TIMING_DTYPE
    TIMING_DTYPE = getattr(torch, args.dtype)
    if args.shape:
        global TIMING_SHAPE
        TIMING_SHAPE = tuple(int(x) for x in args.shape.split(","))
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        _log_file = open(Path(out_dir) / "bwd_check.log", "w")
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        return 1
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.variants or args.deterministic:
        ok = True
        if args.deterministic:
            few = [c for c in VARIANT_CASES if c[2] in (1000, 17, 4096) and c[7] == ""][:8]
            ok = run_variants(["det"], with_timing=False, cases=few) and ok
            log("== deterministic vs not, fwd+bwd and bwd alone")
            try:
                timings = variant_timing(["base", "det"], with_fwd=True)
                for causal in (False, True):
                    for what in ("fwd+bwd", "bwd"):
                        base, det = timings.get(("base", causal, what)), timings.get(("det", causal, what))
                        if isinstance(base, float) and isinstance(det, float):
                            log(f"   {'causal' if causal else 'full  '} {what:8s} base {base:8.3f} ms  "
                                f"det {det:8.3f} ms  ({det / base:.2f}x)")
            except Exception:  # noqa: BLE001
                log("timing failed:\n" + traceback.format_exc())
        if args.variants:
            names = [name.strip() for name in args.variants.split(",") if name.strip()]
            ok = run_variants(names, with_timing=not args.no_timing,
                              cases=VARIANT_CASES[:4] if args.quick else None) and ok
        return 0 if ok else 1
    ok = True
    if not args.timing_only:
        ok, _ = check(args.quick)
    if not (args.quick or args.no_timing):
        try:
            timing()
        except Exception:  # noqa: BLE001
            log("timing failed:\n" + traceback.format_exc())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
