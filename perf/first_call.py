"""First-call latency of cute_flash in a fresh process, with a cold and a warm kernel cache
(GPU script).

    python perf/first_call.py [--cache-dir DIR] [--head-dim D]

Runs the same child process three times against one cache directory (emptied first):
cold (compiles and writes the cache), warm, warm. The child times `import cute_flash` and
the first flash_attention call (forward; then forward + backward) separately, checks the
result against SDPA, notes whether the CuTe DSL got imported (a warm cache with linked
kernel libraries never imports it), and prints the numbers. `import torch` is not counted:
a user of a PyTorch library has paid it already.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import cute_flash
    t2 = time.perf_counter()
    head_dim = int(sys.argv[sys.argv.index("--head-dim") + 1])
    q, k, v = (torch.randn(2, 8, 1000, head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    out = cute_flash.flash_attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    dsl_after_fwd = "cutlass" in sys.modules
    from cute_flash import compile_cache
    compiled_fwd = compile_cache.compile_count
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    import cProfile, io, pstats, sys
    profile = cProfile.Profile() if "--profile" in sys.argv else None
    if profile: profile.enable()
    cute_flash.flash_attention(qg, kg, vg, causal=True).sum().backward()
    torch.cuda.synchronize()
    if profile:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        print(text.getvalue(), file=sys.stderr)
    t5 = time.perf_counter()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(json.dumps(dict(import_torch=t1 - t0, import_cute_flash=t2 - t1, first_fwd=t4 - t3,
                          first_bwd=t5 - t4, rel_err=err, compiled_fwd=compiled_fwd,
                          compiled_bwd=compile_cache.compile_count - compiled_fwd, dsl_after_fwd=dsl_after_fwd,
                          dsl_after_bwd="cutlass" in sys.modules)))
""")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "cute_flash_first_call"))
    parser.add_argument("--profile", action="store_true", help="cProfile the first backward (printed per run)")
    parser.add_argument("--head-dim", type=int, default=128, help="of the (2, 8, 1000, D) fp16 causal call")
    args = parser.parse_args()
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    env = dict(os.environ, CUTE_FLASH_CACHE_DIR=args.cache_dir)
    print(f"{'run':6s} {'import cute_flash s':>19s} {'first fwd s':>12s} {'first fwd+bwd s':>16s} "
          f"{'compiled fwd/bwd':>16s} {'DSL imported (fwd/bwd)':>22s} {'rel_err':>9s}")
    for run in ("cold", "warm", "warm"):
        proc = subprocess.run([sys.executable, "-c", CHILD, "--head-dim", str(args.head_dim)]
                              + (["--profile"] if args.profile else []),
                              env=env, capture_output=True, text=True)
        if args.profile:
            print(f"--- {run}: profile of the first backward\n{proc.stderr[-6000:]}")
        if proc.returncode != 0:
            print(f"{run}: failed\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{run:6s} {r['import_cute_flash']:19.2f} {r['first_fwd']:12.2f} {r['first_bwd']:16.2f} "
              f"{r['compiled_fwd']:>8d}/{r['compiled_bwd']:<7d} {str(r['dsl_after_fwd']):>11s}/{str(r['dsl_after_bwd']):<10s} "
              f"{r['rel_err']:9.1e}")


if __name__ == "__main__":
    main()
