"""The causal forward with and without a softcap inside a profiler range, for Nsight Compute to
compare pipe utilisation (is the SFU the softcap's bottleneck?). GPU script.

    ncu --profile-from-start off --kernel-name regex:fwd --metrics ... \
        python perf/experiments/ncu_softcap.py [--fma-columns a,b | --fma-columns none]

--fma-columns sets kernels/score_transform.SOFTCAP_FMA_EXP2_COLUMNS before compiling; it is
not part of the compile key, so run with a fresh CUTE_FLASH_CACHE_DIR.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cute_flash  # noqa: E402
from cute_flash.benchmarking import run_in_profiler_range  # noqa: E402
import cute_flash.kernels.score_transform as score_transform  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,32,8192,128")
    parser.add_argument("--fma-columns", default="none")
    args = parser.parse_args()
    if args.fma_columns != "none":
        score_transform.SOFTCAP_FMA_EXP2_COLUMNS = {256: tuple(int(x) for x in args.fma_columns.split(","))}
    else:
        score_transform.SOFTCAP_FMA_EXP2_COLUMNS = {256: None}
    b, n, s, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    runs = (lambda: cute_flash.flash_attention(q, k, v, causal=True),
            lambda: cute_flash.flash_attention(q, k, v, causal=True, softcap=30.0))
    run_in_profiler_range(runs)


if __name__ == "__main__":
    main()
