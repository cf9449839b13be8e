"""float32 packed batches (flash_attention_varlen on the scaled halves, every precision) against
the float32 peer nearest to them: SDPA's efficient backend (its only float32 GPU kernel) run
sequence by sequence on the same data, and against cute_flash's own bf16 packed path on the same
lengths (what float32 costs over 16 bits). Forward alone and forward + backward, causal, in
rotated rounds (benchmarking.rotated_rounds); one float64 check of each side first.

    python perf/experiments/float32_packed.py [--dims 64,128] [--heads 16] [--rounds 5]
        [--lengths 4096,2048,1024,1024,512,300,129,17]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.reference import packed_attention_reference  # noqa: E402


def per_sequence_sdpa(q, k, v, cu):
    """SDPA efficient, causal, one (1, N, S, D) call per sequence; the outputs concatenated."""
    outs = []
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        for b in range(cu.shape[0] - 1):
            s, e = int(cu[b]), int(cu[b + 1])
            outs.append(F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                                       is_causal=True)[0].transpose(0, 1))
    return torch.cat(outs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default="4096,2048,1024,1024,512,300,129,17")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    lengths = [int(x) for x in args.lengths.split(",")]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    total, longest = sum(lengths), max(lengths)
    for head_dim in (int(d) for d in args.dims.split(",")):
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(total, args.heads, head_dim, device="cuda") for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        bf16 = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]

        def ours(inputs):
            return cute_flash.flash_attention_varlen(*inputs, cu, cu, longest, longest, causal=True)

        want = packed_attention_reference(*(t.double() for t in (q, k, v)), cu, cu, causal=True)[0]
        for name, got in (("ours", ours(leaves)), ("sdpa", per_sequence_sdpa(*leaves, cu))):
            print(f"check D={head_dim} {name}: {((got.double() - want).norm() / want.norm()).item():.2e}")

        def step(run, inputs, grad_out):
            return lambda: torch.autograd.grad(run(inputs), inputs, grad_out)

        sides = {
            "ours f32 fwd": lambda: ours(leaves),
            "sdpa eff fwd": lambda: per_sequence_sdpa(*leaves, cu),
            "ours bf16 fwd": lambda: ours(bf16),
            "ours f32 f+b": step(ours, leaves, dout),
            "sdpa eff f+b": step(lambda t: per_sequence_sdpa(*t, cu), leaves, dout),
            "ours bf16 f+b": step(ours, bf16, dout.bfloat16()),
        }
        rows = rotated_rounds(sides, args.rounds, 1.0)
        print(f"\npacked causal, {len(lengths)} sequences ({total} tokens), {args.heads} heads, D = {head_dim}; "
              "ratio: to SDPA efficient of the same direction")
        for line in round_table(rows, lambda n: (n, "sdpa eff fwd" if n.endswith("fwd") else "sdpa eff f+b"),
                                width=14):
            print(line, flush=True)


if __name__ == "__main__":
    main()
