"""The backward's Python between autograd and its launches, timed on the CPU (no GPU): CPU
tensors, the CUDA queries stubbed, the compiled kernels replaced by no-op callables that take
their arguments, the configs of configs/h100.yaml. What it times is the body of
_AttentionFunction.backward for a one-launch plan (one launch) without the kernel launch itself
and with host allocations of CPU tensors: the glue that a code change in launch_bwd /
work_buffers / torch_helpers adds or removes, a few us each on the GPU machines' slower hosts
(sixty-third session: the body was ~45 us of a ~110 us backward there, cuDNN's ~35-45).

    python perf/experiments/bwd_glue_cpu.py [--calls 20000] [--shape 1,16,1024,64]

Prints us per call of the whole body and of its layers (rounds, medians).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from cute_flash import api, compile_bwd, config, launch_bwd, torch_helpers, work_buffers  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402


def stub_cuda():
    """The CUDA queries the backward's host path makes, answered as on one GPU (device 0, SM
    count 132, stream 7, not capturing), and no-op kernels."""
    table = config.load_config_file(config.default_config_dir() / "h100.yaml")
    config._device_table = lambda device: table
    torch_helpers.current_device_index = lambda: None  # CPU tensors' device.index
    launch_bwd._current_device = lambda: None
    launch_bwd.device_traits = lambda device: ("sm_90a", 132)
    torch._C._cuda_isCurrentStreamCapturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda index: 7

    def noop(*args):
        return None
    compile_bwd.get_backward = lambda *args, **kwargs: (noop, noop, noop)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", default="1,16,1024,64")
    args = parser.parse_args()
    stub_cuda()
    shape = tuple(int(x) for x in args.shape.split(","))
    q, k, v, out, dout = (torch.randn(*shape, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(*shape[:3])
    problem = AttentionProblem.of(True)

    class Ctx:
        saved_tensors = (q, k, v, out, lse, None)
        scale, deterministic, backward_plans = 0.125, False, {}

    ctx = Ctx()
    ctx.problem = problem
    body = lambda: api._AttentionFunction.backward(ctx, dout, None)  # noqa: E731
    body()
    (plan,) = ctx.backward_plans.values()
    assert plan.one_launch, "the shape should plan one launch"
    layers = {
        "Function.backward body": body,
        "launch_bwd.backward": lambda: launch_bwd.backward(q, k, v, out, dout, lse, problem, 0.125,
                                                           plans=ctx.backward_plans),
        "plan.run": lambda: plan.run(q, k, v, out, dout, lse, 0.125),
        "new_gradients": lambda: launch_bwd.new_gradients(q, k, v),
        "_launch": lambda: plan._launch(q, k, v, out, dout, lse, 0.125, None, launch_bwd.new_gradients(q, k, v),
                                        False),
    }
    results = {name: [] for name in layers}
    for r in range(args.rounds):
        for name, fn in (layers.items() if r % 2 == 0 else reversed(layers.items())):
            for _ in range(200):
                fn()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            results[name].append((time.perf_counter() - start) / args.calls * 1e6)
    for name, values in results.items():
        print(f"{name:26s} {statistics.median(values):6.2f} us per call")


if __name__ == "__main__":
    main()
