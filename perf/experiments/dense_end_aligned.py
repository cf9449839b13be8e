"""Dense band forwards with tiles aligned to each sequence's end (SequenceLayout.aligned_to_end)
against aligned to its start: the same problem as top-left (start) and bottom-right (end;
Sq = Sk, so the same mask), direct kernel launches, beside flash-attn-4, rotated rounds.

    python perf/experiments/dense_end_aligned.py [--rounds 7]

Prediction (key blocks computed; /tmp model of the sixtieth session, which took 192 x 80 tiles
for D = 128 where S <= 4096 runs 128 x 128, whose tiles divide S: no change there): 192 x 80
(D = 128 causal) 1.015x at S = 8192 and 16384, 1.059x at 4096, 1.052x at 2048, 1.004x at
32768; 192 x 96 (D = 64 short causal) none at 2048 / 8192.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
from cute_flash import launch_fwd  # noqa: E402
from cute_flash.benchmarking import round_table, rotated_rounds  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import DENSE_BATCH  # noqa: E402

ALL_CASES = [  # (B, N, S, D, window or None: causal)
    (4, 32, 8192, 128, None), (8, 16, 4096, 128, None), (16, 16, 2048, 128, None), (1, 16, 32768, 128, None),
    (2, 32, 8192, 64, None), (1, 16, 32768, 128, 4096),
    (1, 16, 32768, 64, None), (4, 16, 16384, 64, None), (1, 32, 16384, 128, None), (2, 16, 8192, 64, 2048),
    # the seeds' grid (batch 1, 16 heads): 10-13
    (1, 16, 4096, 128, None), (1, 16, 2048, 128, None), (1, 16, 8192, 32, None), (1, 16, 4096, 16, None),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--cases", type=int, nargs="+", default=list(range(len(ALL_CASES))), help="indices into ALL_CASES")
    args = parser.parse_args()
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        flash_attn_func = None
    for b, n, s, d, window in (ALL_CASES[i] for i in args.cases):
        band = dict(causal=True) if window is None else dict(window_size=(window, 0))
        q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qv, kv, vv = (t.transpose(1, 2) for t in (q, k, v))
        sides, outs = {}, {}
        for name, alignment in (("start", "top_left"), ("end", "bottom_right")):
            problem = AttentionProblem.of(band.get("causal", False), band.get("window_size", (-1, -1)), alignment)
            kernel = launch_fwd.kernel_for(q.dtype, d, problem, q.device, (s, s), d, (b, n, n))
            out = torch.empty_like(qv)
            lse = torch.empty((b, n, s), dtype=torch.float32, device="cuda")
            outs[name] = (out, lse)
            sides[name] = (lambda kernel=kernel, out=out, lse=lse: kernel(
                qv, kv, vv, out, lse, None, *DENSE_BATCH, d ** -0.5))
        if flash_attn_func is not None:
            fa_band = dict(causal=True) if window is None else dict(window_size=(window, 0))
            sides["fa4"] = lambda: flash_attn_func(q, k, v, **fa_band)
        with torch.no_grad():
            rows = rotated_rounds(sides, args.rounds, args.hold)
        same = all(torch.equal(a, c) for a, c in zip(outs["start"], outs["end"]))
        print(f"({b}, {n}, {s}, {d}) {band}: end bitwise equal to start: {same}; ratio = start ms / this ms")
        print("\n".join(round_table(rows, lambda name: ("start", name))), flush=True)


if __name__ == "__main__":
    main()
