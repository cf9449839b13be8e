"""Packed batches with grouped key/value heads (issue 22 x issue 21): how far the packed path,
which runs one query head per tile, is from flash-attn-4's varlen (which packs a group's query
heads into a tile's rows) and from our own dense paths on the same tokens.

    python perf/experiments/varlen_gqa.py [--rounds 5]

Cases, bf16, D = 128, 32 query heads over 8 key/value heads:
  decode-like: B sequences of Sq in {1, 4} new queries over Sk cached keys each, packed (bottom-right
  causal), beside flash_attn_with_kvcache on the same rows as a dense cache;
  prefill: issue 22's long-tailed 64k-token batch, causal and not, forward (non-causal also with a
  group as each tile's rows forced, ours_rows_forced) and causal forward + backward.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
import cute_flash  # noqa: E402
from peers import interleaved_medians  # noqa: E402
from varlen import document_lengths, flash_attn_4_step  # noqa: E402

BF16 = torch.bfloat16
N, NKV, D = 32, 8, 128


def cu_of(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()


def decode_case(batch, sq, sk):
    q = torch.randn(batch * sq, N, D, device="cuda", dtype=BF16)
    k = torch.randn(batch * sk, NKV, D, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    cu_q, cu_k = cu_of([sq] * batch), cu_of([sk] * batch)
    steps = {"ours_packed": lambda: cute_flash.flash_attention_varlen(
        q, k, v, cu_q, cu_k, sq, sk, causal=True, alignment="bottom_right")}
    kc, vc, qd = k.view(batch, sk, NKV, D), v.view(batch, sk, NKV, D), q.view(batch, sq, N, D)
    steps["ours_kvcache"] = lambda: cute_flash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sk, causal=True)
    try:
        steps["fa4_varlen"] = flash_attn_4_step(q, k, v, cu_q, sq, cu_k, sk)
    except ImportError:
        pass
    ref = steps["ours_kvcache"]().reshape(batch * sq, N, D).float()
    for name, fn in steps.items():
        err = (fn().reshape(batch * sq, N, D).float() - ref).abs().max().item()
        print(f"  {name}: max |diff| to ours_kvcache {err:.2e}")
    return steps, batch * sk * NKV * D * 2 * 2


def rows_forced(step):
    """step with every grouped packed forward given a group as each tile's rows (the rule of
    launch_fwd.packed_kernel_problem without its band / decode condition)."""
    import dataclasses

    from cute_flash import launch_fwd

    rule = launch_fwd.packed_kernel_problem

    def forced(problem, q, k, max_seqlen_q):
        if problem.grouped and 64 % (q.shape[1] // k.shape[1]) == 0:
            return dataclasses.replace(problem, grouped=False, row_heads=q.shape[1] // k.shape[1])
        return rule(problem, q, k, max_seqlen_q)

    def run():
        launch_fwd.packed_kernel_problem = forced
        try:
            return step()
        finally:
            launch_fwd.packed_kernel_problem = rule
    return run


def prefill_case(seed, causal, backward=False):
    lengths = document_lengths(65536, seed)
    total = sum(lengths)
    q = torch.randn(total, N, D, device="cuda", dtype=BF16, requires_grad=backward)
    k = torch.randn(total, NKV, D, device="cuda", dtype=BF16, requires_grad=backward)
    v = torch.randn(total, NKV, D, device="cuda", dtype=BF16, requires_grad=backward)
    cu = cu_of(lengths)
    longest = max(lengths)
    steps = {"ours_packed": lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest,
                                                                      causal=causal)}
    if not causal:
        steps["ours_rows_forced"] = rows_forced(steps["ours_packed"])
    try:
        steps["fa4_varlen"] = flash_attn_4_step(q, k, v, cu, longest, causal=causal)
    except ImportError:
        pass
    if backward:
        grad = torch.randn(total, N, D, device="cuda", dtype=BF16)
        steps = {name: (lambda fn=fn: fn().backward(grad)) for name, fn in steps.items()}
    return steps, 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="the cases whose label holds this text")
    args = parser.parse_args()
    cases = [(f"decode B={b} Sq={sq} Sk={sk}", lambda b=b, sq=sq, sk=sk: decode_case(b, sq, sk))
             for b, sq, sk in ((64, 1, 4096), (16, 1, 16384), (64, 4, 4096), (16, 4, 16384))]
    cases += [("prefill 64k GQA causal", lambda: prefill_case(0, True)),
              ("prefill 64k GQA full", lambda: prefill_case(0, False)),
              ("prefill 64k GQA causal fwd+bwd", lambda: prefill_case(0, True, True))]
    if args.only:
        cases = [c for c in cases if args.only in c[0]]
    table = []
    for label, make in cases:
        print(label, flush=True)
        with torch.set_grad_enabled("bwd" in label):
            steps, kv_bytes = make()
            medians = interleaved_medians(steps, args.rounds, 10)
        for name, ms in medians.items():
            bw = f"{kv_bytes / ms / 1e9:7.2f} TB/s" if kv_bytes else ""
            table.append(f"{label:30s} {name:14s} {ms:8.4f} ms {bw}  {medians['ours_packed'] / ms:6.2f}x ours_packed")
        print("\n".join(table[-len(medians):]), flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
