"""Host time per call of two source trees of cute_flash, in paired rounds (GPU machine; sixty-eighth
session). A change worth a few microseconds per call cannot be read off runs a minute apart on
a lent host whose speed swings by up to 2x between runs (perf/NOTES.md, sixty-eighth session,
item 1). Here one worker process per tree loads its tree, compiles and warms up, then waits;
the parent asks them in turn for `--calls` calls of one case (A then B, B then A in the next
round), so the two readings of a pair are seconds apart, and reports per case the median of
the pairs' ratios (this tree over the other). SDPA cuDNN runs in both workers as the control:
its ratio shows what the pairing leaves of the host's drift.

    python perf/experiments/host_ab_trees.py --other DIR [--shape 1,16,1024,32] [--rounds 30]
        [--calls 200] [--cases 'fwd;fwd, grad;bwd;fwd+bwd']

DIR: the other tree's root (its cute_flash/ and configs/; e.g. `git worktree add DIR REV`).
Cases (bf16, causal): fwd (no grad), "fwd, grad", bwd (torch.autograd.grad over a retained
graph: the backward alone), fwd+bwd (forward then autograd.grad), each for ours and cuDNN.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
CASES = ("fwd", "fwd, grad", "bwd", "fwd+bwd")


def worker(root: str, shape: tuple) -> None:
    """Serve `case calls` lines on stdin with `{"us": per-call host time}` lines on stdout."""
    sys.path.insert(0, root)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cute_flash

    assert Path(cute_flash.__file__).resolve().is_relative_to(Path(root).resolve()), cute_flash.__file__
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qn, kn, vn = (t.detach() for t in (q, k, v))
    dout = torch.randn_like(qn)

    def cudnn(*t):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)

    def ours(*t):
        return cute_flash.flash_attention(*t, causal=True)

    fns = {}
    for name, attend in (("ours", ours), ("cudnn", cudnn)):
        retained = attend(q, k, v)
        fns[f"{name} fwd"] = lambda attend=attend: attend(qn, kn, vn)
        fns[f"{name} fwd, grad"] = lambda attend=attend: attend(q, k, v)
        fns[f"{name} bwd"] = lambda retained=retained: torch.autograd.grad(retained, (q, k, v), dout,
                                                                           retain_graph=True)
        fns[f"{name} fwd+bwd"] = lambda attend=attend: torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
    for fn in fns.values():  # compile and warm up before the first timed call
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name, calls = line.rsplit(" ", 1)
        fn = fns[name]
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(int(calls)):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        print(json.dumps({"us": elapsed / int(calls) * 1e6}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--other", required=True, help="the other tree's root")
    parser.add_argument("--shape", default="1,16,1024,32")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cases", default=";".join(CASES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.worker:
        return worker(args.worker, shape)
    roots = {"this": str(HERE.parents[2]), "other": str(Path(args.other).resolve())}
    procs = {}
    for label, root in roots.items():
        procs[label] = subprocess.Popen([sys.executable, str(HERE), "--worker", root, "--shape", args.shape,
                                         "--other", root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=root)
    for label, proc in procs.items():
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {label} tree's worker ({roots[label]}) exited before it was ready")

    def ask(label, name):
        proc = procs[label]
        proc.stdin.write(f"{name} {args.calls}\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())["us"]

    cases = [c for c in args.cases.split(";") if c]
    readings = {(who, case, label): [] for who in ("ours", "cudnn") for case in cases for label in roots}
    for r in range(args.rounds):
        order = ("this", "other") if r % 2 == 0 else ("other", "this")
        for case in cases:
            for who in ("ours", "cudnn"):
                for label in order:
                    readings[(who, case, label)].append(ask(label, f"{who} {case}"))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    print(f"{str(shape):20s} {'case':16s} {'this us':>9s} {'other us':>9s} {'this/other':>10s} "
          f"{'(pairs q1-q3)':>15s}")
    for case in cases:
        for who in ("ours", "cudnn"):
            this, other = readings[(who, case, "this")], readings[(who, case, "other")]
            ratios = sorted(a / b for a, b in zip(this, other))
            q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
            print(f"{str(shape):20s} {who + ' ' + case:16s} {statistics.median(this):9.1f} "
                  f"{statistics.median(other):9.1f} {statistics.median(ratios):10.3f} {q1:7.3f}-{q3:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
