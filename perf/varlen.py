"""Speed of packed variable-length batches (cute_flash.flash_attention_varlen) beside the peers
that run them, in the same run: flash-attn-4's varlen entry point, torch's varlen_attn
(torch >= 2.10), cuDNN's ragged attention (aten::_cudnn_attention_forward with cumulative
lengths), and cute_flash's own dense path on the batch padded to its longest sequence.

    python perf/varlen.py --out DIR [--rounds 3] [--tokens 65536] [--seed 0]

The batch: document lengths drawn from a log-normal distribution (median 1024) clipped to
64 ... 16384 until about --tokens tokens; 32 heads, D = 128, bf16, causal; forward and
forward + backward. CUDA events, L2 flushed before each sample, interleaved rounds, the
median of the rounds' medians. Writes DIR/varlen.csv, DIR/varlen.md and DIR/varlen.png.
"""

import argparse
import csv
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import attention_flops  # noqa: E402
from peers import in_grad_mode, interleaved_medians, runnable_steps  # noqa: E402
from bar_plot import grouped_bars  # noqa: E402

BF16 = torch.bfloat16
HEADS, HEAD_DIM = 32, 128


def document_lengths(tokens: int, seed: int) -> list:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(16384, max(64, int(rng.lognormvariate(6.93, 1.2)))))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] < 64:
        lengths.pop()
    return lengths


def packed_inputs(lengths, head_dim=HEAD_DIM, dtype=BF16):
    """(cu_seqlens, q, k, v) of a packed batch with these lengths: fresh random (total, HEADS,
    head_dim) tensors that require gradients (also the experiments' batch)."""
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    q, k, v = (torch.randn(sum(lengths), HEADS, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    return cu, q, k, v


def flash_attn_4_step(q, k, v, cu, longest, cu_k=None, longest_k=None, causal=True, window_size=None, **variant):
    """flash-attn-4's varlen call on the batch (its output alone; the keys' offsets and longest
    length those of the queries unless given; window_size and `variant`, e.g. softcap, passed on
    where given); ImportError where flash-attn-4 is not installed."""
    from flash_attn.cute import flash_attn_varlen_func

    cu_k = cu if cu_k is None else cu_k
    longest_k = longest if longest_k is None else longest_k
    window = {} if window_size is None else dict(window_size=window_size)

    def fa4():
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=longest,
                                     max_seqlen_k=longest_k, causal=causal, **window, **variant)
        return out[0] if isinstance(out, tuple) else out
    return fa4


def implementations(lengths):
    longest = max(lengths)
    cu, q, k, v = packed_inputs(lengths)
    impls = {"cute_flash": lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)}
    try:
        impls["flash_attn_4"] = flash_attn_4_step(q, k, v, cu, longest)
    except Exception as exc:
        print(f"flash-attn-4 varlen not importable ({type(exc).__name__}): not timed", file=sys.stderr)
    try:
        from torch.nn.attention.varlen import varlen_attn

        import inspect

        # Its causal argument changed between torch versions.
        causal = (dict(is_causal=True) if "is_causal" in inspect.signature(varlen_attn).parameters
                  else dict(window_size=(-1, 0)))
        impls["torch_varlen_attn"] = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, **causal)
    except Exception as exc:
        print(f"torch varlen_attn not importable ({type(exc).__name__}): not timed", file=sys.stderr)
    # cuDNN's ragged attention, as torch exposes it (the op nested-tensor SDPA's cuDNN backend
    # runs; torch's varlen_attn does not pick it on its own).
    if hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        impls["cudnn_ragged"] = lambda: torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, longest, longest, True, 0.0, True, False)[0]
    # The dense path on the batch padded to the longest sequence (what a user without varlen runs).
    padded = [torch.zeros(len(lengths), HEADS, longest, HEAD_DIM, device="cuda", dtype=BF16) for _ in range(3)]
    for b, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        for dense, packed in zip(padded, (q, k, v)):
            dense[b, :, :n] = packed[start:start + n].transpose(0, 1).detach()
    for t in padded:
        t.requires_grad_()
    impls["cute_flash_dense_padded"] = lambda: cute_flash.flash_attention(*padded, causal=True)
    return impls


def measure(fn, direction):
    if direction == "fwd":
        return lambda: fn()
    out = fn()
    grad = torch.randn_like(out)
    return lambda: fn().backward(grad)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = document_lengths(args.tokens, args.seed)
    print(f"{len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)}: {lengths}", flush=True)
    flops = sum(attention_flops(1, HEADS, n, n, HEAD_DIM, True) for n in lengths)
    impls = implementations(lengths)
    rows = []
    for direction in ("fwd", "fwd+bwd"):
        steps = {}
        for impl, fn in impls.items():
            try:
                steps[impl] = in_grad_mode(measure(fn, direction), direction != "fwd")
            except Exception as exc:  # a peer that does not take this case
                print(f"{direction} {impl}: skipped ({type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        medians = interleaved_medians(runnable_steps(steps, direction), args.rounds, 5)
        work = flops * (1 if direction == "fwd" else 3.5)
        for impl, ms in medians.items():
            rows.append(dict(direction=direction, impl=impl, ms=round(ms, 4), tflops=round(work / ms / 1e9, 1),
                             documents=len(lengths), tokens=sum(lengths), longest=max(lengths)))
            print(f"{direction:8s} {impl:24s} {ms:9.4f} ms {work / ms / 1e9:7.1f} TFLOP/s", flush=True)
    with open(out_dir / "varlen.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"{len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)}; {HEADS} heads, D = "
             f"{HEAD_DIM}, bf16, causal (TFLOP/s over the causal halves of the documents)", "",
             "| direction | impl | ms | TFLOP/s | its time / cute_flash's |", "|---|---|---|---|---|"]
    for row in rows:
        ours = next(r["ms"] for r in rows if r["direction"] == row["direction"] and r["impl"] == "cute_flash")
        lines.append(f"| {row['direction']} | {row['impl']} | {row['ms']} | {row['tflops']} | "
                     f"{row['ms'] / ours:.2f}x |")
    (out_dir / "varlen.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    impls = sorted({r["impl"] for r in rows})
    directions = ["fwd", "fwd+bwd"]
    grouped_bars(out_dir / "varlen.png", directions,
                 {impl: [next((r["ms"] for r in rows if r["direction"] == d and r["impl"] == impl), None)
                         for d in directions] for impl in impls}, "ms (lower is better)")


if __name__ == "__main__":
    main()
