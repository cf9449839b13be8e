"""Host cost of a call through SDPA's flash backend with cute_flash active (cute_flash.sdpa)
against a direct cute_flash.flash_attention call, forward and forward+backward (GPU script).

On a small problem a loop of calls without synchronisation is CPU-bound, so wall time per
call is the host cost; the two paths run the same kernels. Interleaved rounds, median.

    python perf/sdpa_overhead.py [--out DIR] [--profile]
"""

import argparse
import csv
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import cute_flash
from cute_flash import sdpa
from host_overhead import per_call_us  # perf/ is on the path when run as a script


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of each path")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, restore_flash_attention_impl, sdpa_kernel

    shape = (1, 2, 128, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    backend.__enter__()
    # For scale: SDPA's own flash kernels through the same front end, before activation.
    torch_calls = {
        ("forward", "torch_flash_sdpa"): lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                                                 is_causal=True),
        ("forward+backward", "torch_flash_sdpa"): lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True).backward(dout),
    }
    torch_samples = {key: [per_call_us(fn) for _ in range(args.rounds)] for key, fn in torch_calls.items()}
    sdpa.activate()
    calls = {
        ("forward", "direct"): lambda: cute_flash.flash_attention(q.detach(), k.detach(), v.detach(), causal=True),
        ("forward", "sdpa"): lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                                     is_causal=True),
        ("forward+backward", "direct"): lambda: cute_flash.flash_attention(q, k, v, causal=True).backward(dout),
        ("forward+backward", "sdpa"): lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout),
    }
    samples = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, fn in calls.items():
            samples[key].append(per_call_us(fn))
    assert sdpa.last_decision == "ours", sdpa.last_decision
    if args.profile:
        import cProfile
        import pstats

        for key, fn in calls.items():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(1000):
                fn()
            profile.disable()
            torch.cuda.synchronize()
            print(f"--- profile of 1000 calls: {key}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    backend.__exit__(None, None, None)
    restore_flash_attention_impl()
    rows = []
    for what in ("forward", "forward+backward"):
        direct = statistics.median(samples[(what, "direct")])
        through = statistics.median(samples[(what, "sdpa")])
        torch_flash = statistics.median(torch_samples[(what, "torch_flash_sdpa")])
        rows.append(dict(what=what, shape="x".join(map(str, shape)), direct_us=round(direct, 2),
                         sdpa_us=round(through, 2), extra_us=round(through - direct, 2),
                         torch_flash_sdpa_us=round(torch_flash, 2)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sdpa_overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 causal, median of {args.rounds} "
          "interleaved rounds of 1000 calls")
    print("| call | direct cute_flash (us) | cute_flash through SDPA (us) | extra (us) | torch's flash through SDPA "
          "(us) |\n|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['what']} {row['shape']} | {row['direct_us']} | {row['sdpa_us']} | {row['extra_us']} | "
              f"{row['torch_flash_sdpa_us']} |")


if __name__ == "__main__":
    main()
