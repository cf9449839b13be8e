"""One backward of cute_flash and one of flash-attn-4 inside a profiler range, for Nsight
Compute to compare the two main backward kernels (GPU script).

    ncu --profile-from-start off --kernel-name regex:bwd_sm90 --section ... \
        python perf/experiments/ncu_bwd.py [--shape 1,32,8192,128] [--causal]

Both run once before the range (compilation, warm-up). Inputs are fresh random fp16.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,32,8192,128")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--fields", default="{}", help="JSON of bwd config fields to replace, e.g. '{\"block_m\": 80}'")
    args = parser.parse_args()
    b, n, s, d = (int(x) for x in args.shape.split(","))

    import dataclasses
    import json

    from cute_flash import launch_bwd, launch_fwd
    from cute_flash.config import get_config
    from cute_flash.kernels.problem import AttentionProblem

    q, k, v = (torch.randn(b, n, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    out, lse = launch_fwd.forward(q, k, v, AttentionProblem.of(args.causal), scale)

    config = dataclasses.replace(get_config("float16", d, args.causal, "bwd", q.device, seqlens=(s, s)),
                                 **json.loads(args.fields))

    def ours():
        launch_bwd.backward_with_config(q, k, v, out, dout, lse, AttentionProblem.of(args.causal), scale, config=config)

    calls = [ours]
    try:
        from flash_attn.cute import flash_attn_func  # comparison only

        qs, ks, vs = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        out_s = flash_attn_func(qs, ks, vs, causal=args.causal)
        out_s = out_s[0] if isinstance(out_s, tuple) else out_s
        dout_s = dout.transpose(1, 2).contiguous()

        def fa4():
            torch.autograd.grad(out_s, (qs, ks, vs), dout_s, retain_graph=True)
        calls.append(fa4)
    except Exception as exc:  # noqa: BLE001
        print(f"flash-attn-4 not importable: {type(exc).__name__}")
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
