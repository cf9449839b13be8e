"""The public API under two or more config files in the same rounds (one device call): the
shipped configs/h100.yaml (or --baseline) against one or more candidate YAMLs, on the
maintained benchmarks' batches (issue 22's mixed varlen batch, issue 23's prefill over a cache)
and dense shapes, beside flash-attn-4.

Each cute_flash side runs under its own config table: the config module's tables and lookups
and every plan cache (api, varlen_plan, kvcache_plan, launch_bwd) are swapped in before its
call, so a plan built under one file never serves the other. Timed as fwd_config_pairs.py times
(rotated rounds, flushed, the same hold); ratio = shipped ms / candidate ms per round.

    python perf/experiments/yaml_ab.py --candidate PATH [--cases varlen,prefill1,prefill4,dense:4x32x8192x128x1]
        [--directions fwd,fwdbwd] [--rounds 7] [--lock FILE] [--baseline PATH]

(dense16: the same dense case in float16. docs:DxCAUSAL / docs16:DxCAUSAL: issue 22's document
batch, 65536 tokens, varlen.HEADS heads, at head dim D. A case ending in @CAP runs with softcap CAP.)
"""

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
import cute_flash  # noqa: E402
from cute_flash import api, config, kvcache_plan, launch_bwd, varlen_plan  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds, timing_lock  # noqa: E402

CACHES = ((config, "_device_tables"), (config, "_lookups"), (config, "_tiles"), (api, "_plans"),
          (varlen_plan, "_plans"), (kvcache_plan, "_plans"), (launch_bwd, "_plans"))


class ConfigSide:
    """One config file's tables and plan caches, swapped into the modules around a call."""

    def __init__(self, path):
        table = config.load_config_file(path)
        index = torch.cuda.current_device()
        self.state = {(mod, name): {} for mod, name in CACHES}
        self.state[(config, "_device_tables")][index] = table
        self.state[(config, "_device_tables")][None] = table

    @contextlib.contextmanager
    def active(self):
        saved = {(mod, name): getattr(mod, name) for mod, name in CACHES}
        for (mod, name), value in self.state.items():
            setattr(mod, name, value)
        try:
            yield
        finally:
            for (mod, name), value in saved.items():
                setattr(mod, name, value)

    def wrap(self, fn):
        def call():
            with self.active():
                return fn()
        return call


def case_impls(case):
    """(cute_flash's call, the peer's call or None) of a case name."""
    if case == "varlen":
        import varlen

        impls = varlen.implementations(varlen.document_lengths(65536, 0))
        return impls["cute_flash"], impls.get("flash_attn_4")
    if case.startswith("prefill"):
        import kvcache

        impls = kvcache.prefill_implementations(int(case[7:]))
        return impls["cute_flash_kvcache_append"], impls.get("flash_attn_4")
    case, _, cap = case.partition("@")  # a softcap: dense:...@30, docs:...@30
    variant = dict(softcap=float(cap)) if cap else {}
    if case.startswith(("docs:", "docs16:")):  # docs:DxCAUSAL (bf16; docs16: fp16): issue 22's batch
        import varlen

        dtype = torch.float16 if case.startswith("docs16:") else torch.bfloat16
        d, causal = (int(x) for x in case.split(":", 1)[1].split("x"))
        lengths = varlen.document_lengths(65536, 0)
        longest = max(lengths)
        cu, q, k, v = varlen.packed_inputs(lengths, d, dtype)
        return ((lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=bool(causal),
                                                           **variant)),
                varlen.flash_attn_4_step(q, k, v, cu, longest, causal=bool(causal), **variant))
    if case.startswith(("dense:", "dense16:")):  # dense:BxNxSxDxCAUSAL[xKV_HEADS] (bf16; dense16: fp16)
        dtype = torch.float16 if case.startswith("dense16:") else torch.bfloat16
        b, n, s, d, causal, *kv = (int(x) for x in case.split(":", 1)[1].split("x"))
        nkv = kv[0] if kv else n
        q = torch.randn(b, s, n, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(b, s, nkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        from flash_attn.cute import flash_attn_func

        def fa4():
            out = flash_attn_func(q, k, v, causal=bool(causal), **variant)
            return out[0] if isinstance(out, tuple) else out
        return (lambda: cute_flash.flash_attention(qt, kt, vt, causal=bool(causal), **variant)), fa4
    raise ValueError(f"unknown case {case}")


def directed(fn, direction):
    if fn is None:
        return None
    if direction == "fwd":
        def fwd():
            with torch.no_grad():
                return fn()
        return fwd
    grad = torch.randn_like(fn())
    return lambda: fn().backward(grad)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--candidate", required=True, help="a YAML path, or several (comma-separated)")
    parser.add_argument("--baseline", default=str(ROOT / "configs" / "h100.yaml"),
                        help="the YAML of the side called 'shipped' (default: configs/h100.yaml)")
    parser.add_argument("--cases", default="varlen,prefill1,prefill4")
    parser.add_argument("--directions", default="fwd,fwdbwd")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--lock", default="")
    args = parser.parse_args()
    shipped = ConfigSide(args.baseline)
    candidates = {Path(path).stem if "," in args.candidate else "candidate": ConfigSide(path)
                  for path in args.candidate.split(",")}
    for case in args.cases.split(","):
        ours, peer = case_impls(case)
        for direction in args.directions.split(","):
            if direction == "fwdbwd" and case.startswith("prefill"):
                continue  # a cache's prefill has no backward
            sides = {"shipped": shipped.wrap(directed(ours, direction)),
                     **{name: side.wrap(directed(ours, direction)) for name, side in candidates.items()}}
            if peer is not None:
                sides["fa4"] = directed(peer, direction)
            for side in sides.values():
                side()  # plans and compiles outside the rounds
            torch.cuda.synchronize()
            with timing_lock(args.lock):
                rows = rotated_rounds(sides, args.rounds, args.hold)
            print(f"\n{case} {direction}, {args.rounds} rounds; ratio = shipped ms / this ms in the same round")
            print("\n".join(round_table(rows, lambda name: ("shipped", name), width=10)), flush=True)


if __name__ == "__main__":
    main()
