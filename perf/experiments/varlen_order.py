"""How much a packed batch's document order costs (issue 22: longest sequences first). The
same documents packed in the drawn order, longest first and shortest first, timed for
cute_flash and flash-attn-4 in the same interleaved rounds; and the modelled makespan of each
order's forward grid (grid_makespan's replay of tiles in launch order) next to it.

    python perf/experiments/varlen_order.py [--seeds 0 4] [--rounds 7] [--tile 192x80] [--orders drawn ...]

Prediction to test: our packed grid walks heads one after another and, per head, the
sequences in batch order, so a long document late in the batch starts its longest tiles of the
last head when little else is left; longest first should gain what the model says.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
import cute_flash  # noqa: E402
from cute_flash.grid_makespan import TILE_FIXED_KEYS, _makespan  # noqa: E402
from peers import in_grad_mode, interleaved_medians  # noqa: E402
from varlen import HEADS, document_lengths, flash_attn_4_step, measure, packed_inputs  # noqa: E402


def modelled(lengths, block_m, block_n, sms=132):
    """Forward makespan over the perfect split of the same tiles (1.0 = no tail)."""
    costs = []
    for _ in range(HEADS):
        for n in lengths:
            for m in reversed(range(-(-n // block_m))):
                blocks = -(-min(n, (m + 1) * block_m) // block_n)
                costs.append(TILE_FIXED_KEYS * block_m + block_m * block_n * blocks)
    return _makespan(costs, sms) / (sum(costs) / sms)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tile", default="192x80")
    parser.add_argument("--orders", nargs="+", default=["drawn", "longest_first", "shortest_first"])
    args = parser.parse_args()
    block_m, block_n = map(int, args.tile.split("x"))
    for seed in args.seeds:
        drawn = document_lengths(65536, seed)
        orders = {"drawn": drawn, "longest_first": sorted(drawn, reverse=True), "shortest_first": sorted(drawn)}
        orders = {name: orders[name] for name in args.orders}
        print(f"seed {seed}: {len(drawn)} documents, longest {max(drawn)} at {drawn.index(max(drawn))}", flush=True)
        for direction in ("fwd", "fwd+bwd"):
            steps = {}
            for name, lengths in orders.items():
                longest = max(lengths)
                cu, q, k, v = packed_inputs(lengths)
                ours = (lambda q=q, k=k, v=v, cu=cu, longest=longest:
                        cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True))
                steps[f"ours_{name}"] = in_grad_mode(measure(ours, direction), direction != "fwd")
                try:
                    steps[f"fa4_{name}"] = in_grad_mode(measure(flash_attn_4_step(q, k, v, cu, longest), direction),
                                                        direction != "fwd")
                except Exception as exc:
                    print(f"flash-attn-4: {type(exc).__name__}", file=sys.stderr)
            medians = interleaved_medians(steps, args.rounds, 5)
            for name in orders:
                ours, fa4 = medians[f"ours_{name}"], medians.get(f"fa4_{name}", float("nan"))
                print(f"seed {seed} {direction:8s} {name:15s} ours {ours:8.4f} ms ({ours / medians['ours_drawn']:.4f}"
                      f" of drawn)  fa4 {fa4:8.4f} ms  fa4/ours {fa4 / ours:.4f}  model {modelled(orders[name], block_m, block_n):.4f}",
                      flush=True)


if __name__ == "__main__":
    main()
