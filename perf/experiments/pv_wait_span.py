"""Where ptxas puts the forward's wait for the previous block's P V (CPU only: compiles for
sm_90a without a GPU). For each 16-bit forward entry of a config file (seqlen 8192, one head
dim), and optionally the GQA bottom-right problem: per main loop (masked, unmasked), the
instructions from the wait for S (`WARPGROUP.DEPBAR.LE gsb0, 0x1`) to the wait for P V
(`... 0x0`), with the exp2 (MUFU.EX2) and FFMA among them. A short span means the warpgroup
waits on its P V with little of its softmax done (perf/NOTES.md, thirty-fourth session: 124
instructions in the causal GQA D = 128 loop stalled it; 157 after the softmax change did not).

    python perf/experiments/pv_wait_span.py [--config configs/h100.yaml] [--only bfloat16-128]
        [--grouped]

Compare two trees by running it in each (PYTHONPATH=<tree>: the compile runs in the tree the
imported cute_flash comes from).
"""

import argparse
import re
import tempfile

import yaml

from cute_flash.config import TileConfig
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.sass import compile_forward_cubin, disassemble, main_loops, wgmma_groups


def spans(loop):
    """(instructions, MUFU.EX2, FFMA) from the S wait to the first P V wait after it, or None."""
    start = None
    for i, line in enumerate(loop):
        if "DEPBAR.LE gsb0, 0x1" in line:
            start = i
        elif "DEPBAR.LE gsb0, 0x0" in line and start is not None:
            part = loop[start:i]
            return (i - start, sum("MUFU.EX2" in x for x in part), sum(bool(re.search(r"\bFFMA\b", x)) for x in part))
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/h100.yaml")
    parser.add_argument("--only", default="", help="entries whose dtype-head_dim-mask label contains this")
    parser.add_argument("--grouped", action="store_true", help="the GQA bottom-right problem (a cache's prefill)")
    args = parser.parse_args()
    for entry in yaml.safe_load(open(args.config))["entries"]:
        match = entry["match"]
        if (match["direction"] != "fwd" or match.get("seqlen") not in (8192, None) or "value_head_dim" in match
                or match["dtype"] not in ("float16", "bfloat16")):
            continue
        label = f'{match["dtype"]}-{match["head_dim"]}-{"causal" if match["causal"] else "full"}'
        if args.only not in label:
            continue
        problem = (AttentionProblem.of(match["causal"], alignment="bottom_right", grouped=True) if args.grouped
                   else AttentionProblem.of(match["causal"]))
        with tempfile.TemporaryDirectory() as out:
            sass = disassemble(compile_forward_cubin(match["dtype"], match["head_dim"], problem,
                                                     TileConfig(**entry["config"]), out))
        loops = main_loops(sass)
        print(f"{label}: loops {[len(body) for body in loops]}, WGMMA groups {[wgmma_groups(b) for b in loops]}, "
              f"(span, exp2, FFMA) to the P V wait {[spans(b) for b in loops]}", flush=True)


if __name__ == "__main__":
    main()
