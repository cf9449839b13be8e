"""Backward tile configs for a variant problem (GQA, window, softcap, sink) against each other
and flash-attn-4's backward, in rotated rounds (cute_flash.benchmarking.rotated_rounds: each
side once per round, the order rotated, each sample flushed after the same hold). Ratios are
per round against the config the host derives today (launch_bwd.derived_config: side
"derived"). Every variant is first checked against the float64 reference on a small case of
the same problem.

    python perf/experiments/bwd_variant_configs.py --shape 2,32,16,8192,128 --window 4095 --softcap 50
        [--variants gt_bn128,gt_bn96,shd_bm64] [--rounds 9] [--hold 1.0]

Variants (replacing fields of the YAML's bwd entry; the host's derived config is "derived"):
lean (the 64-query register step), gt_bn<N> (grads_transposed, block_m 64, block_n N), shd_bm64 (split_head_dim, block_n 64),
FIELD=INT[+FIELD=INT...] (fields of the derived config, e.g. num_stages_pds=2+dv_after_ds=0),
tile<T> (the head dims zero-padded to native tile T, on the config the host derives from T's entry).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402

LEAN = dict(dq_atom_m=1, dq_swap_ab=False, dv_after_ds=False, fused_preprocess=False, num_stages_pds=1)


def variant_config(entry, derived, name):
    if name == "derived":
        return derived
    if "=" in name:  # fields of the derived config: "num_stages_pds=2+dv_after_ds=0"
        fields = dict(part.split("=") for part in name.split("+"))
        return dataclasses.replace(derived, **{key: type(getattr(derived, key))(int(value))
                                               for key, value in fields.items()})
    if name == "lean":  # the 64-query register step (the softcap's derived config before grads_transposed)
        return dataclasses.replace(entry, block_m=64, dq_atom_m=1, dq_swap_ab=False, dv_after_ds=False, dq_stages=1,
                                   fused_preprocess=False)
    if name.startswith("gt_bn"):
        return dataclasses.replace(entry, block_m=64, block_n=int(name[5:]), grads_transposed=True,
                                   split_head_dim=False, **LEAN)
    if name == "shd_bm64":
        return dataclasses.replace(entry, block_m=64, block_n=64, split_head_dim=True, grads_transposed=False, **LEAN)
    raise ValueError(f"unknown variant {name}")


def tensors(b, n, nkv, s, d, dtype, seed):
    torch.manual_seed(seed)
    q = torch.randn(b, n, s, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, nkv, s, d, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn(b, n, s, d, device="cuda", dtype=dtype)
    return q, k, v, dout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="2,32,16,8192,128", help="B,N,Nkv,S,D")
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--window", type=int, default=-1, help="left window (causal); -1: none")
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", default="gt_bn128,gt_bn96,shd_bm64")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hold", type=float, default=1.0)
    args = parser.parse_args()
    from flash_attn.cute import flash_attn_func

    from cute_flash import launch_bwd
    from cute_flash.config import get_config
    from cute_flash.kernels import rules
    from cute_flash.kernels.problem import AttentionProblem
    from cute_flash.launch_fwd import forward
    from cute_flash.reference import attention_reference

    b, n, nkv, s, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    causal = bool(args.causal)
    window = (args.window, 0) if causal else (args.window, -1)
    problem = AttentionProblem.of(causal, window, softcap=args.softcap, grouped=nkv < n)
    scale = d ** -0.5
    entry = get_config(args.dtype, d, causal, "bwd", torch.device("cuda"), seqlens=(s, s))
    derived = launch_bwd.derived_config(entry, args.dtype, problem, d, d, False)
    names = ["derived"] + [x for x in args.variants.split(",") if x]
    configs, tiles = {}, {}
    for name in names:
        if name.startswith("tile"):  # the config the host derives from that tile's entry
            tiles[name] = int(name[4:])
            tile_entry = get_config(args.dtype, tiles[name], causal, "bwd", torch.device("cuda"), seqlens=(s, s))
            config = launch_bwd.derived_config(tile_entry, args.dtype, problem, tiles[name], d, False)
        else:
            tiles[name], config = d, variant_config(entry, derived, name)
        why = rules.backward(args.dtype, tiles[name], config)
        if why:
            print(f"{name}: refused by the rules ({why})")
            continue
        configs[name] = config
        print(f"{name}: {config}")

    # Correctness on a smaller case of the same problem (two key/value heads; long enough for
    # the window to bite; the same compile-time problem, so no extra kernels).
    small, ss = problem, (args.window + 500 if args.window >= 0 else 1000)
    q, k, v, dout = tensors(1, 2 * (n // nkv), 2, ss, d, dtype, 1)
    out, lse = forward(q, k, v, small, scale)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*leaves, causal=causal, softmax_scale=scale, window_size=window,
                                 softcap=args.softcap)
    (ref * dout.double()).sum().backward()
    for name, config in list(configs.items()):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        try:
            got = launch_bwd.backward_with_config(q, k, v, out, dout, lse, small, scale, config=config, grads=grads,
                                                  tile_head_dim=tiles[name])
        except ValueError as exc:  # e.g. more shared memory than a block can have
            print(f"{name}: not compiled ({str(exc)[:160]})")
            del configs[name]
            continue
        errs = [((g.double() - r.grad).abs().max() / r.grad.abs().max()).item() for g, r in zip(got, leaves)]
        print(f"{name}: relative error dq / dk / dv {errs[0]:.2e} / {errs[1]:.2e} / {errs[2]:.2e}", flush=True)

    q, k, v, dout = tensors(b, n, nkv, s, d, dtype, 0)
    out, lse = forward(q, k, v, problem, scale)
    sides = {}
    for name, config in configs.items():
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        sides[name] = (lambda c=config, g=grads, t=tiles[name]: launch_bwd.backward_with_config(
            q, k, v, out, dout, lse, problem, scale, config=c, grads=g, tile_head_dim=t))
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    fa_window = dict(window_size=(args.window, 0)) if args.window >= 0 else {}
    fa_dout = dout.transpose(1, 2).contiguous()
    try:  # flash-attn-4's SM90 backward does not take every head dim (e.g. 16, 32)
        fa_out = flash_attn_func(qt, kt, vt, causal=causal, softcap=args.softcap, **fa_window)
        fa_out = fa_out[0] if isinstance(fa_out, tuple) else fa_out
        torch.autograd.grad(fa_out, (qt, kt, vt), fa_dout, retain_graph=True)
        sides["fa4"] = lambda: torch.autograd.grad(fa_out, (qt, kt, vt), fa_dout, retain_graph=True)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run this case is left out
        print(f"fa4: not run ({type(exc).__name__}: {str(exc)[:120]})")
    rows = rotated_rounds(sides, args.rounds, args.hold)
    print(f"backward {args.shape} {args.dtype} causal={causal} window {window} softcap {args.softcap}, {args.rounds} rounds; "
          f"ratio = derived ms / this ms in the same round (above 1: faster than derived)")
    print("\n".join(round_table(rows, lambda name: ("derived", name))))


if __name__ == "__main__":
    main()
