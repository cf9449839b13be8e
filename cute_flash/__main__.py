"""Command line: `python -m cute_flash bench [...]` (also installed as `cute-flash`)."""

import argparse
import sys
from pathlib import Path

EXIT_NO_GPU = 2


def _parser():
    parser = argparse.ArgumentParser(prog="cute-flash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="check, then time, cute_flash against SDPA and flash-attn-4")
    bench.add_argument("--cases", default=None, help="case file, one 'B N S D' a line (default: test_cases/test.txt)")
    bench.add_argument("--causal", choices=["both", "true", "false"], default="both")
    bench.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    bench.add_argument("--out", default="bench-out", help="folder for bench.csv (default: bench-out)")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--iters", type=int, default=20)
    return parser


def _bench(args) -> int:
    from cute_flash.test_cases import CaseFileError, load_cases

    try:
        cases = load_cases(args.cases)
    except CaseFileError as exc:
        print(f"cute-flash bench: {exc}", file=sys.stderr)
        return 1
    from cute_flash import bench

    problem = bench.hopper_problem()
    if problem is not None:
        print(f"cute-flash bench: needs an NVIDIA Hopper GPU (compute capability 9.x); {problem}",
              file=sys.stderr)
        return EXIT_NO_GPU
    import torch

    modes = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    rows = bench.run_bench(cases, modes, getattr(torch, args.dtype), Path(args.out), args.warmup, args.iters)
    return 0 if rows is not None else 1


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
