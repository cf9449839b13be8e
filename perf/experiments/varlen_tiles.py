"""Which tile issue 22's long-tailed packed batch should run: the forward on the tile the host
picks (launch_fwd.packed_grid + config.grid_fitted: the entry's 192 x 80 on three warpgroups at
D = 128, as for total_q // max_seqlen_q sequences of the longest length) against the fitted
two-warpgroup tile (128 rows) forced, beside flash-attn-4's varlen, same interleaved rounds.

    python perf/experiments/varlen_tiles.py [--seeds 0 1] [--rounds 7]

Prediction to test: the batch's median document is ~1024 tokens; on equal 64 x 1024 batches our
packed forward (128-row tile) beat flash-attn-4's by 6 %, on this batch (192-row tile) it trails
by 1.5-3 %: partial 192-row tiles at every document's end may cost what grid_makespan's
per-tile model does not see.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
import cute_flash  # noqa: E402
from cute_flash import launch_fwd  # noqa: E402
from cute_flash.config import rows_fitted  # noqa: E402
from peers import interleaved_medians  # noqa: E402
from varlen import document_lengths, flash_attn_4_step, packed_inputs  # noqa: E402


def fitted_forced(step):
    chosen = launch_fwd.grid_fitted

    def run():
        launch_fwd.grid_fitted = lambda config, *args: rows_fitted(config, 128)
        try:
            return step()
        finally:
            launch_fwd.grid_fitted = chosen
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        lengths = document_lengths(65536, seed)
        longest = max(lengths)
        cu, q, k, v = packed_inputs(lengths)
        with torch.no_grad():
            ours = lambda: cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)  # noqa: E731
            steps = {"ours": ours, "ours_128_rows": fitted_forced(
                lambda: launch_fwd.forward_packed(q, k, v, cu, cu, None, longest, longest,
                                                  cute_flash.varlen.packed_problem(q, k, True, -1, -1, False, 0.0,
                                                                                   None, None),
                                                  q.shape[-1] ** -0.5)[0])}
            try:
                steps["fa4"] = flash_attn_4_step(q, k, v, cu, longest)
            except ImportError:
                pass
            want = steps["ours"]()
            err = (steps["ours_128_rows"]().float() - want.float()).abs().max().item()
            print(f"seed {seed}: 128-row tile max |diff| {err:.2e}", flush=True)
            medians = interleaved_medians(steps, args.rounds, 5)
        for name, ms in medians.items():
            rows.append(f"seed {seed} {name:14s} {ms:8.4f} ms  {ms / medians['ours']:.4f}x ours")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
