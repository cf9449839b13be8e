"""A/B of backward config fields on packed batches and, for equal lengths, the same batch
through the dense path ((B, N, S, D) views of the packed tensors: the same memory), in one
process (GPU script). The backward alone (preprocess, main kernel, postprocess), CUDA events,
L2 flushed, interleaved rounds, medians.

    python perf/experiments/bwd_packed_ab.py --b '{"dv_after_ds": true}' \
        [--a '{}'] [--batches equal1x16384,equal8x2048,mixed] [--tokens 65536] [--causal 1]

Configs a and b are the YAML entry with those fields replaced (launch_bwd's derived config
first). Before timing, each config's gradients are compared with packed config a's (max
abs difference; not 0 even for the same config: dQ's atomic additions come in any order), the
dense ones too for equal lengths.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cute_flash  # noqa: E402
from cute_flash import launch_bwd  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.torch_helpers import TORCH_DTYPE_NAMES  # noqa: E402
from peers import interleaved_medians  # noqa: E402
from varlen import HEAD_DIM, HEADS, packed_inputs  # noqa: E402
from varlen_timeline import batch_lengths  # noqa: E402


def with_fields(fields):
    """launch_bwd._tile_and_config with `fields` replaced in its config (for plans built
    while it is installed)."""
    original = launch_bwd._tile_and_config

    def patched(*args, **kwargs):
        tile, value_tile, config = original(*args, **kwargs)
        return tile, value_tile, dataclasses.replace(config, **fields)
    return original, patched


def steps_for(lengths, causal, variants):
    longest = max(lengths)
    cu, q, k, v = packed_inputs(lengths)
    q, k, v = (t.detach() for t in (q, k, v))
    dout = torch.randn_like(q)
    scale = HEAD_DIM ** -0.5
    with torch.no_grad():
        out, lse = cute_flash.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                     return_lse=True)
    problem = AttentionProblem(causal=causal, packed=True)
    batch = (cu, cu, None, longest, longest)
    dense = len(set(lengths)) == 1
    if dense:
        b = len(lengths)
        qd, kd, vd, outd, doutd = (t.view(b, longest, HEADS, HEAD_DIM).transpose(1, 2)
                                   for t in (q, k, v, out, dout))
        lsed = lse.view(HEADS, b, longest).transpose(0, 1).contiguous()
        dense_problem = AttentionProblem(causal=causal)
    steps, grads = {}, {}
    for name, fields in variants.items():
        original, patched = with_fields(fields)
        launch_bwd._tile_and_config = patched
        try:
            plan = launch_bwd.plan_packed_backward(q, k, v, out, dout, lse, len(lengths), longest, longest, problem,
                                                   False)
            _, _, config = patched(TORCH_DTYPE_NAMES[q.dtype], HEAD_DIM, HEAD_DIM, AttentionProblem(causal=causal),
                                   (longest, longest), q.device, False)
        finally:
            launch_bwd._tile_and_config = original

        def packed_step(plan=plan):
            return plan.run(q, k, v, out, dout, lse, batch, scale, None, False, None)
        steps[f"packed {name}"] = packed_step
        grads[f"packed {name}"] = packed_step()[:3]
        if dense:
            def dense_step(config=config):
                return launch_bwd.backward_with_config(qd, kd, vd, outd, doutd, lsed, dense_problem, scale,
                                                       config)[:3]
            steps[f"dense {name}"] = dense_step
            grads[f"dense {name}"] = tuple(g.transpose(1, 2).reshape(q.shape) for g in dense_step())
    first = next(iter(grads.values()))
    for name, g in grads.items():
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g, first))
        finite = all(bool(torch.isfinite(t).all()) for t in g)
        print(f"  {name:16s} max |grad - {next(iter(grads))}| = {diff:.3e}  finite={finite}", flush=True)
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", default="{}", help="JSON map of config fields of variant a")
    parser.add_argument("--b", required=True, help="JSON map of config fields of variant b")
    parser.add_argument("--batches", default="equal1x16384,equal8x2048,mixed",
                        help="varlen_timeline.batch_lengths' specs: mixed, sorted, reversed, equalBxS")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    variants = {"a": json.loads(args.a), "b": json.loads(args.b)}
    print(f"device {torch.cuda.get_device_name()}; a = {variants['a']}, b = {variants['b']}, causal {args.causal}")
    for spec in args.batches.split(","):
        lengths = batch_lengths(spec, args.tokens, args.seed)
        print(f"### {spec}: {len(lengths)} sequences, {sum(lengths)} tokens, longest {max(lengths)}", flush=True)
        steps = steps_for(lengths, bool(args.causal), variants)
        medians = interleaved_medians(steps, args.rounds, 3)
        for name, ms in medians.items():
            print(f"  {name:16s} {ms:8.3f} ms", flush=True)
        for kind in ("packed", "dense"):
            if f"{kind} a" in medians:
                print(f"  {kind}: b / a = {medians[f'{kind} b'] / medians[f'{kind} a']:.4f}", flush=True)
        if "dense a" in medians:
            print(f"  packed / dense: a {medians['packed a'] / medians['dense a']:.4f}, "
                  f"b {medians['packed b'] / medians['dense b']:.4f}", flush=True)
        steps = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
