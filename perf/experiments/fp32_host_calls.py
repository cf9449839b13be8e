"""Host us per call of small float32 calls through the public API, beside SDPA's efficient
backend (GPU machine): forward (no grad), backward alone (autograd.grad on a retained graph)
and forward + backward, in rotated rounds (perf/host_overhead.py's per_call_us: a loop of calls
without synchronisation, so a host-bound call reads its host cost). For A/B runs of two trees
run it once per tree, alternately, with PYTHONPATH pointing at each (the lent hosts' speed
varies 2x between machines, so only rows of one call compare).

    python perf/experiments/fp32_host_calls.py [--label new] [--rounds 3] [--iters 200]
        [--shapes 1,16,128,64 ...]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # perf/ (after the tree under test)

import cute_flash  # noqa: E402
from host_overhead import rotated_per_call_us  # noqa: E402


def cases_for(shape):
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float32, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.float32)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def efficient(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(q, k, v):
        return cute_flash.flash_attention(q, k, v, causal=True)

    cases = {}
    for name, fn in (("ours", ours), ("sdpa efficient", efficient)):
        out = fn(q, k, v)

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v)

        cases[f"{name} fwd"] = forward
        cases[f"{name} bwd"] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        cases[f"{name} fwd+bwd"] = lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    return cases


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default=cute_flash.__file__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--shapes", nargs="+", default=["1,16,128,64", "1,16,512,128", "1,16,1024,32"])
    args = parser.parse_args()
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        results = rotated_per_call_us(cases_for(shape), args.rounds, args.iters)
        for label, values in results.items():
            print(f"{args.label:6s} {str(shape):18s} {label:22s} {statistics.median(values):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
