"""Command line (also installed as `cute-flash`):

    python -m cute_flash bench [...]   check, then time, against SDPA and flash-attn-4
    python -m cute_flash tune [...]    measure tile configs, write configs/<gpu>.yaml
    python -m cute_flash precompile [--gpu h100] [--arch sm_90a] [--dtypes float32x3h,...]
                                       compile every kernel the GPU's YAML can select into
                                       the disk cache (no GPU needed)
"""

import argparse
import os
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
    tune = sub.add_parser("tune", help="measure candidate tile configs and write configs/<gpu>.yaml")
    tune.add_argument("--output", default=None, help="YAML to write (default: the file the device uses)")
    tune.add_argument("--state", default="tune-state.jsonl", help="measurements so far (resumable)")
    tune.add_argument("--directions", default="fwd,bwd")
    tune.add_argument("--dtypes", default="float16,bfloat16")
    tune.add_argument("--head-dims", default="64,128",
                      help="head dims to tune; D:Dv tunes a forward pair of tiles, e.g. 192:128")
    tune.add_argument("--causal", choices=["both", "true", "false"], default="both")
    tune.add_argument("--shape", default=None, help="B,N,S of the tuning shape (default: the largest case)")
    tune.add_argument("--budget-s", type=float, default=None, help="stop starting measurements after this")
    tune.add_argument("--iters", type=int, default=10)
    tune.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per candidate")
    tune.add_argument("--min-gain", type=float, default=0.02,
                      help="keep the current entry unless a candidate is faster by more than this fraction")
    pre = sub.add_parser("precompile", help="compile every kernel a GPU's YAML can select into the disk cache "
                                            "(works without a GPU)")
    pre.add_argument("--gpu", default="h100", help="which configs/<gpu>.yaml (default: h100)")
    pre.add_argument("--arch", default="sm_90a", help="target architecture (default: sm_90a)")
    pre.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                     help="compile processes (default: half the CPUs, at most 8)")
    pre.add_argument("--dtypes", default=None,
                     help="only the kernel sets of these YAML dtypes, a comma list (e.g. float32x3h,float32x3)")
    return parser


def _bench(args, extra_peers=None) -> int:
    from cute_flash.test_cases import CaseFileError, load_cases

    try:
        cases = load_cases(args.cases)
    except CaseFileError as exc:
        print(f"cute-flash bench: {exc}", file=sys.stderr)
        return 1
    if _no_hopper():
        return EXIT_NO_GPU
    import torch

    from cute_flash import bench

    modes = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    rows = bench.run_bench(cases, modes, getattr(torch, args.dtype), Path(args.out), args.warmup, args.iters,
                           extra_peers=extra_peers)
    return 0 if rows is not None else 1


def _no_hopper() -> bool:
    from cute_flash import bench

    problem = bench.hopper_problem()
    if problem is not None:
        print(f"cute-flash: needs an NVIDIA Hopper GPU (compute capability 9.x); {problem}", file=sys.stderr)
    return problem is not None


def _tune(args) -> int:
    from cute_flash.test_cases import load_cases

    if _no_hopper():
        return EXIT_NO_GPU
    import torch

    from cute_flash import tune
    from cute_flash.config import config_path_for_device

    if args.shape:
        shape = tuple(int(x) for x in args.shape.split(","))
    else:
        shape = max(load_cases(), key=lambda c: c.batch * c.heads * c.seqlen ** 2).shape[:3]
    output = Path(args.output) if args.output else config_path_for_device(
        torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    if not args.output and output.parent == Path(__file__).resolve().parent / "configs":
        # A wheel install: the configs are package data, which a tuning run must not rewrite.
        output = Path.cwd() / "configs" / output.name
        print(f"cute-flash tune: writing {output} (point CUTE_FLASH_CONFIG_DIR at {output.parent} to use it)",
              file=sys.stderr)
    modes = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    head_dims = [tune.head_dim_pair(d) for d in args.head_dims.split(",")]
    return tune.tune(args.directions.split(","), args.dtypes.split(","), head_dims, modes, shape, output,
                     Path(args.state), args.budget_s, args.iters, min_gain=args.min_gain, rounds=args.rounds)


def main(argv=None, extra_peers=None) -> int:
    """`extra_peers` (for perf/compare.py): more implementations for bench to time."""
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args, extra_peers)
    if args.command == "tune":
        return _tune(args)
    if args.command == "precompile":
        from cute_flash.precompile import precompile

        return precompile(args.gpu, args.arch, args.jobs,
                          dtypes=args.dtypes.split(",") if args.dtypes else None)
    return 2


if __name__ == "__main__":
    sys.exit(main())
