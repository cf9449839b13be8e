"""Does issue 22's packed forward lose its tail to the head-major grid? The packed forward
grid walks heads one after another (all sequences of head 0, then head 1, ...), so the last
head's longest document starts its heaviest tile when little else is left. Numbering the tiles
in sections of H heads, block number major inside a section (the same tile of H heads side by
side), lets the heaviest tiles of the last heads start earlier. Kernels compiled with
tile_scheduler.PACKED_SECTION_HEADS = H, timed beside flash-attn-4's varlen in rotated rounds.

The kernel hook (tile_scheduler.PACKED_SECTION_HEADS) was removed after the measurement
(perf/NOTES.md, sixtieth session): run this from `git archive 13f1492` (see that note).

    python perf/experiments/varlen_head_sections.py [--seeds 0 1] [--heads 1 2 4 8 32] [--rounds 7] [--causal 1]

Prediction (grid_makespan's replay; the sixtieth session's NOTES entry): the
tail over the perfect split falls from 1.012-1.025 (H = 1) to 1.004-1.006 (H = 4) and
1.001-1.003 (H = 8); unless L2 misses (H heads' keys in flight at once) eat it.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
import cute_flash  # noqa: E402
from cute_flash import compile_fwd, launch_fwd  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.kernels import tile_scheduler  # noqa: E402
from cute_flash.torch_helpers import as_tma_operand, batch_of_one  # noqa: E402
from varlen import document_lengths, flash_attn_4_step, packed_inputs  # noqa: E402


_compiled = {}


def kernel_with_sections(q, k, v, problem, longest, heads):
    """The packed forward kernel the host picks for this batch, compiled with `heads` heads a section."""
    captured = {}
    chosen = compile_fwd.get_forward
    compile_fwd.get_forward = lambda *args: captured.setdefault("args", args)
    try:
        launch_fwd.packed_kernel(q, k, v, problem, longest, longest)
    finally:
        compile_fwd.get_forward = chosen
    key = (heads, captured["args"])
    if key not in _compiled:
        saved = tile_scheduler.PACKED_SECTION_HEADS
        tile_scheduler.PACKED_SECTION_HEADS = heads
        try:
            _compiled[key] = compile_fwd.compile_forward(*captured["args"])
        finally:
            tile_scheduler.PACKED_SECTION_HEADS = saved
    return _compiled[key], captured["args"][3]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--causal", type=int, default=1)
    args = parser.parse_args()
    for seed in args.seeds:
        lengths = document_lengths(65536, seed)
        longest = max(lengths)
        cu, q, k, v = packed_inputs(lengths)
        q, k, v = (t.detach() for t in (q, k, v))
        problem = cute_flash.varlen.packed_problem(q, k, bool(args.causal), -1, -1, False, 0.0, None, None)
        operands = tuple(as_tma_operand(batch_of_one(t)) for t in (q, k, v))
        sides, outs = {}, {}
        for heads in args.heads:
            kernel, config = kernel_with_sections(q, k, v, problem, longest, heads)
            out = torch.full_like(q, float("nan"))
            lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
            sides[f"h{heads}"] = (lambda kernel=kernel, out=out, lse=lse: launch_fwd.launch_packed(
                kernel, operands, out, lse, None, cu, cu, None, None, q.shape[-1] ** -0.5))
            outs[f"h{heads}"] = out
        try:
            sides["fa4"] = flash_attn_4_step(q, k, v, cu, longest, causal=bool(args.causal))
        except Exception as exc:
            print(f"flash-attn-4: {type(exc).__name__}", file=sys.stderr)
        with torch.no_grad():
            rows = rotated_rounds(sides, args.rounds, args.hold)
        first = f"h{args.heads[0]}"
        for name, out in outs.items():
            print(f"{name}: max |out - {first}| = {(out.float() - outs[first].float()).abs().max().item():.3g}"
                  f" finite {bool(out.isfinite().all())}")
        print(f"causal {args.causal} seed {seed}: {len(lengths)} documents, longest {longest}, {config}; "
              f"ratio = {first} ms / this ms")
        print("\n".join(round_table(rows, lambda name: (first, name))))


if __name__ == "__main__":
    main()
