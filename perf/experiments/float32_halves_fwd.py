"""The float32 forward at float32 accuracy on fp16 parts ("float32x3h", scaled halves:
cute_flash.float32.halves_operands, kernels/fwd_sm90.py) against the shipped 3xTF32 one
("float32x3") and SDPA's efficient backend, same run.

First every case is checked against float64 (relative Frobenius error of O, absolute error
of the LSE; odd shapes, Sq != Sk both ways, inputs of a large and a small scale, GQA), then
the timed shapes run in rotated rounds (benchmarking.rotated_rounds: each side once per round,
order rotated, flushed, same hold): the first config's halves with their operand pass ("x3h")
and each config's kernel alone (named by its config), the public call at "highest"
("shipped": 3xTF32 as shipped before the halves, its operand pass and kernel), SDPA
efficient.

    python perf/experiments/float32_halves_fwd.py [--dims 64,128] [--seqlens 4096,8192,16384]
        [--rounds 7] [--configs "128:m128n64s2/m128n32s4,64:m128n128s2"] [--narrow 16,32]
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash import compile_fwd  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.config import TileConfig  # noqa: E402
from cute_flash.float32 import halves_operands  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402


def parse_config(spec):
    """"m128n64s2" (block_m, block_n, stages; two warpgroups per 128 rows), "np" appended: no
    ping-pong."""
    pingpong = not spec.endswith("np")
    m, rest = spec.removesuffix("np")[1:].split("n")
    n, stages = rest.split("s")
    warpgroups = int(m) // 64
    return TileConfig(block_m=int(m), block_n=int(n), num_stages=int(stages), num_mma_warpgroups=warpgroups,
                      pingpong=pingpong and warpgroups > 1)


def parse_configs(text):
    """"128:m128n64s2/m128n32s4,64:m128n128s2": tile head dim -> [(name, TileConfig)], the first
    the one checked."""
    configs = {}
    for item in text.split(","):
        dim, specs = item.split(":")
        configs[int(dim)] = [(spec, parse_config(spec)) for spec in specs.split("/")]
    return configs


def halves_call(config, head_dim, tile, causal, grouped=False):
    problem = AttentionProblem(causal=causal, grouped=grouped)
    kernel = compile_fwd.get_forward("float32x3h", head_dim, problem, config, "sm_90a", tile)

    def kernel_only(ops, q, v_dim):
        out = torch.empty((*q.shape[:3], v_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        kernel(*ops[:3], out, lse, None, *DENSE_BATCH[:4], ops[3], 1 / math.sqrt(head_dim))
        return out, lse

    def call(q, k, v):
        return kernel_only(halves_operands(q, k, v, tile), q, v.shape[-1])

    return call, kernel_only


# The 3xTF32 forward's tiles as shipped before the scaled halves replaced them above D = 16
# (configs/h100.yaml until the forty-fourth session), by tile head dim.
SPLIT_TF32_TILES = {16: "m128n128s2", 32: "m128n64s2", 64: "m128n64s2", 128: "m128n48s1"}


def split_tf32_call(head_dim, causal, grouped=False):
    """The 3xTF32 forward ("float32x3") on its former tile, operand pass and kernel."""
    from cute_flash.float32 import kernel_operands

    tile = min(t for t in SPLIT_TF32_TILES if t >= head_dim)
    config = parse_config(SPLIT_TF32_TILES[tile])
    kernel = compile_fwd.get_forward("float32x3", head_dim, AttentionProblem(causal=causal, grouped=grouped), config,
                                     "sm_90a", tile)

    def call(q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        *ops, _ = kernel_operands("float32x3", q, k, v, tile)
        kernel(*ops, out, lse, None, *DENSE_BATCH, 1 / math.sqrt(head_dim))
        return out, lse

    return call


def reference(q, k, v, causal):
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def check(configs):
    torch.manual_seed(0)
    worst = 0.0
    cases = [(1, 4, 4, 1000, 1000, 1.0), (2, 4, 4, 17, 1000, 1.0), (1, 4, 4, 1000, 17, 1.0), (1, 4, 4, 1, 8191, 1.0),
             (1, 8, 2, 2048, 2048, 1.0), (1, 4, 4, 2048, 2048, 30.0), (1, 4, 4, 2048, 2048, 1e-6),
             (1, 4, 4, 4096, 4096, 1.0)]
    # Each tile at its own width, and a narrower head dim on it (zero columns between D and T).
    runs = [(tile, tile, variants[0][1], cases) for tile, variants in configs.items()]
    runs += [(tile - 24, tile, variants[0][1], cases[:4]) for tile, variants in configs.items()]
    for head_dim, tile, config, tile_cases in runs:
        for causal in (False, True):
            for (b, n, nkv, sq, sk, scale) in tile_cases:
                call, _ = halves_call(config, head_dim, tile, causal, grouped=n != nkv)
                q = torch.randn(b, n, sq, head_dim, device="cuda") * scale
                k = torch.randn(b, nkv, sk, head_dim, device="cuda") * scale
                v = torch.randn(b, nkv, sk, head_dim, device="cuda") * scale
                ref_o, ref_lse = reference(q, k, v, causal)
                finite = torch.isfinite(ref_lse)

                def errors(out, lse):
                    err = ((out.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-300)).item()
                    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
                    return err, lse_err, bool((torch.isfinite(lse) == finite).all())

                err, lse_err, same_inf = errors(*call(q, k, v))
                torch.set_float32_matmul_precision("highest")
                x3_err, x3_lse_err, _ = errors(*split_tf32_call(head_dim, causal, n != nkv)(q, k, v))
                worst = max(worst, err)
                print(f"check D={head_dim} (tile {tile}) causal={int(causal)} B={b} N={n}/{nkv} Sq={sq} Sk={sk} x{scale:g}: "
                      f"O rel {err:.2e} LSE abs {lse_err:.2e} inf-rows-match {same_inf} "
                      f"(x3: {x3_err:.2e} {x3_lse_err:.2e})", flush=True)
                # float32's own rounding of large scores shows in the LSE: bounded by the
                # shipped 3xTF32's error on the same data where that is above the bar.
                assert (err < max(1e-5, 4 * x3_err) and lse_err < max(1e-5, 4 * x3_lse_err)
                        and same_inf), "halves out of float32 accuracy"
    print(f"worst O error {worst:.2e}")


def timed(configs, seqlens, rounds, narrow):
    """Per tile and causal: the first config with and without its operand pass at every
    seqlen, the others' kernels at the middle one; narrow head dims (on the 64-wide tile)
    against the shipped 3xTF32 of their own tile."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    runs = [(tile, tile, variants, seqlens) for tile, variants in configs.items()]
    runs += [(d, 64, configs[64][:1], [seqlens[len(seqlens) // 2]]) for d in narrow if 64 in configs]
    for head_dim, tile, variants, lengths in runs:
        for causal in (False, True):
            for seqlen in lengths:
                torch.manual_seed(1)
                q, k, v = (torch.randn((1, 16, seqlen, head_dim), device="cuda") for _ in range(3))

                x3 = split_tf32_call(head_dim, causal)

                def shipped():
                    return x3(q, k, v)[0]

                def efficient():
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                sides = {"shipped": shipped, "efficient": efficient}
                ops = halves_operands(q, k, v, tile)
                middle = seqlen == lengths[len(lengths) // 2]
                for i, (name, config) in enumerate(variants if middle else variants[:1]):
                    call, kernel_only = halves_call(config, head_dim, tile, causal)
                    if i == 0:
                        sides["x3h"] = (lambda c: lambda: c(q, k, v))(call)
                    sides[name] = (lambda f: lambda: f(ops, q, head_dim))(kernel_only)
                with torch.no_grad():
                    ref = shipped()
                    errs = {n: ((f()[0] - ref).norm() / ref.norm()).item() for n, f in sides.items()
                            if n not in ("shipped", "efficient")}
                    rows = rotated_rounds(sides, rounds, 1.0)
                print(f"\nD={head_dim} (tile {tile}) causal={int(causal)} S={seqlen} (rel. to shipped: "
                      + " ".join(f"{n} {e:.1e}" for n, e in errs.items()) + ")")
                for line in round_table(rows, lambda name: (name, "efficient"), width=14):
                    print(line)
                print("  ratio to shipped:", " ".join(
                    f"{name} {sorted(r[name][0] / r['shipped'][0] for r in rows)[len(rows) // 2]:.3f}"
                    for name in sides), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="128:m128n64s2/m128n64s2np/m128n32s4,64:m128n128s2/m128n64s2/m192n64s2")
    parser.add_argument("--narrow", default="16,32", help="head dims run on the 64-wide tile")
    parser.add_argument("--seqlens", default="4096,8192,16384")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    if not args.skip_check:
        check(configs)
    timed(configs, [int(s) for s in args.seqlens.split(",")], args.rounds,
          [int(d) for d in args.narrow.split(",") if d])


if __name__ == "__main__":
    main()
