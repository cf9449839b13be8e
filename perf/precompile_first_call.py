"""Precompile without a GPU, then the first forward+backward of every shipped key in a fresh
process (GPU script).

    python perf/precompile_first_call.py [--jobs 12] [--out DIR] [--cache DIR]

1. `python -m cute_flash precompile` with CUDA_VISIBLE_DEVICES="" (the DSL compiles for
   sm_90a on the CPU) into an empty cache directory.
2. For each (dtype, head dim, causal) of the shipped YAML: a fresh process that imports
   cute_flash and runs its first call, a forward+backward on (1, 4, 1024, D), from that
   cache, timed, with the number of kernels it compiled and whether it imported the DSL.
`import torch` is not counted (a PyTorch user has paid it already).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    dtype, head_dim, causal = getattr(torch, sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "True"
    q, k, v = (torch.randn(1, 4, 1024, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    import cute_flash
    from cute_flash import compile_cache
    t1 = time.perf_counter()
    profile = None
    if len(sys.argv) > 4:
        import cProfile
        profile = cProfile.Profile()
        profile.enable()
    cute_flash.flash_attention(q, k, v, causal=causal).sum().backward()  # the first call: forward+backward
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    if profile:
        import pstats
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
    print(json.dumps(dict(import_s=t1 - t0, first_fwd_bwd_s=t2 - t1,
                          compiled=compile_cache.compile_count,
                          dsl_imported="cutlass" in sys.modules)))
""")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--profile", action="store_true", help="print each child's cProfile of its first call")
    parser.add_argument("--cache", default=None, help="cache directory to fill (must be empty; default: a new one)")
    args = parser.parse_args()
    from cute_flash.config import default_config_dir, load_config_file

    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="cute-flash-precompiled-"))
    if cache.exists() and any(cache.iterdir()):
        sys.exit(f"{cache} is not empty: the measurement needs a cache filled by this run alone")
    env = dict(os.environ, CUTE_FLASH_CACHE_DIR=str(cache))
    pre = subprocess.run([sys.executable, "-m", "cute_flash", "precompile", "--jobs", str(args.jobs)],
                         env=dict(env, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True)
    print(pre.stderr, end="")
    if pre.returncode:
        sys.exit(pre.returncode)
    table = load_config_file(default_config_dir() / "h100.yaml")
    keys = sorted({(e.dtype, e.head_dim, e.causal) for e in table.entries if e.direction == "fwd"})
    rows = []
    for dtype, head_dim, causal in keys:
        child = subprocess.run([sys.executable, "-c", CHILD, dtype, str(head_dim), str(causal)]
                               + (["profile"] if args.profile else []), env=env, capture_output=True, text=True)
        if args.profile:
            print(child.stderr)
        if child.returncode:
            print(child.stderr)
            sys.exit(1)
        rows.append(dict(dtype=dtype, head_dim=head_dim, causal=causal, **json.loads(child.stdout.splitlines()[-1])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precompile_first_call.json").write_text(json.dumps(rows, indent=1))
    print("| key | import cute_flash (s) | first fwd+bwd (s) | kernels compiled | DSL imported |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['dtype']} D={r['head_dim']} {'causal' if r['causal'] else 'non-causal'} | {r['import_s']:.3f} | "
              f"{r['first_fwd_bwd_s']:.3f} | {r['compiled']} | {r['dsl_imported']} |")


if __name__ == "__main__":
    main()
