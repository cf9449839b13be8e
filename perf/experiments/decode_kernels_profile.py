"""Kernel by kernel: a decode step (Sq = 1, 32 / 8 heads, D = 128, bf16) replayed from CUDA
graphs, cute_flash's split step (forward parts + merge) beside SDPA cuDNN's, torch.profiler;
plus each graph's replay time (CUDA events over back-to-back replays).

    python perf/experiments/decode_kernels_profile.py [--batch 1] [--cache 4096,32768]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from kvcache import implementations  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", default="4096,32768")
    args = parser.parse_args()
    for cache_len in map(int, args.cache.split(",")):
        impls = implementations(args.batch, cache_len)
        for name in ("cute_flash_kvcache", "sdpa_cudnn"):
            step = impls[name]
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(10):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                graph.replay()
            end.record()
            end.synchronize()
            print(f"== B={args.batch} cache={cache_len} {name}: {start.elapsed_time(end) / 200 * 1e3:.2f} us per replay")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    graph.replay()
                torch.cuda.synchronize()
            for event in prof.key_averages():
                if event.device_type == torch.autograd.DeviceType.CUDA and event.count:
                    print(f"   {event.key[:90]:90s} {event.count:5d} x {event.device_time / 1:9.2f} us")


if __name__ == "__main__":
    main()
