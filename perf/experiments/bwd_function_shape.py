"""What the shape of our autograd Function costs the backward's round trip (sixty-third session).
The fifty-sixth session read a Python Function whose backward returns precomputed gradients at
68-80 us through torch.autograd.grad, but 93-98 with our Function's six inputs and six saved
tensors. Here each variant's backward returns precomputed gradients (no kernel), timed as host
us per torch.autograd.grad over a retained graph, rotated rounds, medians, beside the real
backward, SDPA cuDNN's and one C++ node:

    ours                  cute_flash.flash_attention (the real backward)
    ours, no work         _AttentionFunction with its backward returning precomputed gradients
    6 in, 2 out, 6 saved  a Function shaped as ours: (q, k, v, sink, plan, flag) -> (O, LSE),
                          save_for_backward(q, k, v, O, LSE, sink)
    ... 1 out             the same returning O alone (the LSE saved as an intermediate)
    ... 3 in              (q, k, v) alone as inputs (the others as ctx attributes)
    ... 0 saved           nothing saved (the tensors kept as ctx attributes)
    3 in, 1 out, 0 saved  the leanest Function
    C++ node              addcmul(q, k, v) (one C++ node with three inputs)
    cudnn                 SDPA's cuDNN backend (the real backward)

    python perf/experiments/bwd_function_shape.py [--rounds 7] [--iters 300] [--shape 1,16,1024,64]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import cute_flash  # noqa: E402
from cute_flash import api  # noqa: E402
from host_overhead import per_call_us, rotated_per_call_us  # noqa: E402

GRADS = []  # the precomputed (dq, dk, dv)


def function(inputs: int, outputs: int, saved: bool):
    class Shaped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, *rest):
            out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
            sink = rest[0] if rest else None
            if saved:
                ctx.save_for_backward(q, k, v, out, lse, sink)
            else:
                ctx.tensors = (q, k, v, out, lse, sink)
            ctx.set_materialize_grads(False)
            return (out, lse) if outputs == 2 else out

        @staticmethod
        def backward(ctx, dout, *dlse):
            if saved:
                ctx.saved_tensors
            return (*GRADS, *([None] * (inputs - 3)))

    def call(q, k, v):
        extra = (None, object(), False)[: inputs - 3]
        result = Shaped.apply(q, k, v, *extra)
        return result[0] if outputs == 2 else result
    return call


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--shape", default="1,16,1024,64")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    GRADS[:] = [torch.randn_like(t) for t in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    outputs = {
        "ours": cute_flash.flash_attention(q, k, v, causal=True),
        "6 in, 2 out, 6 saved": function(6, 2, True)(q, k, v),
        "... 1 out": function(6, 1, True)(q, k, v),
        "... 3 in": function(3, 2, True)(q, k, v),
        "... 0 saved": function(6, 2, False)(q, k, v),
        "3 in, 1 out, 0 saved": function(3, 1, False)(q, k, v),
        "C++ node": torch.addcmul(q, k, v),
        "cudnn": peer,
    }
    real_backward = api._AttentionFunction.backward

    def no_work(ctx, dout_, dlse):
        ctx.saved_tensors
        return (*GRADS, None, None, None)

    fns = {name: (lambda o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
           for name, o in outputs.items()}
    api._AttentionFunction.backward = staticmethod(no_work)
    no_work_out = cute_flash.flash_attention(q, k, v, causal=True)
    api._AttentionFunction.backward = staticmethod(real_backward)

    def ours_no_work():
        api._AttentionFunction.backward = staticmethod(no_work)
        try:
            return torch.autograd.grad(no_work_out, (q, k, v), dout, retain_graph=True)
        finally:
            api._AttentionFunction.backward = staticmethod(real_backward)
    fns["ours, no work"] = ours_no_work
    rounds = rotated_per_call_us(fns, args.rounds, args.iters, per_call_us)
    for name, values in rounds.items():
        print(f"{str(shape):20s} {name:24s} {statistics.median(values):8.1f} us per call (host)", flush=True)


if __name__ == "__main__":
    main()
