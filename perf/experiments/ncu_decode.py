"""One decode step of cute_flash's KV cache and one of SDPA cuDNN, each replayed once from a
CUDA graph inside a profiler range, for Nsight Compute to look at the kernels of a B = 1 step
(issue 23: 0.76x cuDNN at 4k slots, perf/NOTES.md twenty-fifth and twenty-sixth sessions).

    ncu --profile-from-start off --sampling-interval 0 --section SourceCounters ... \
        python perf/experiments/ncu_decode.py [--batch 1] [--cache 4096]

The graphs are captured as perf/kvcache.py's steps are (so the step splits its keys as it
does when captured), replayed a few times first.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from kvcache import implementations  # noqa: E402
from peers import as_cuda_graph  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", type=int, default=4096)
    args = parser.parse_args()
    impls = implementations(args.batch, args.cache)
    replays = [as_cuda_graph(impls[name]) for name in ("cute_flash_kvcache", "sdpa_cudnn")]
    for replay in replays:
        for _ in range(5):
            replay()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for replay in replays:
        replay()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
