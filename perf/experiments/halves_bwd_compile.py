"""CPU compile check of the scaled-halves backward ("float32x3h"): its preprocess, dK / dV kernel
and dQ kernel for sm_90a through compile_bwd.compile_backward_cubins (no GPU), with each
kernel's spills (LDL / STL) and HGMMA shapes from its SASS.

    python perf/experiments/halves_bwd_compile.py "64:m64n128s2w2/dq:m128n64s2" "128:m16n64s1w1/dq:m128n32s2"
        [--causal 0,1] [--grouped]

A spec is head dim, then the dK / dV tile (block_m, block_n, stages, warpgroups) and the dQ
kernel's (block_m, block_n, stages; warpgroups block_m / 64).
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.compile_bwd import compile_backward_cubins  # noqa: E402
from cute_flash.config import BackwardTileConfig, SeparateDqConfig  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.sass import disassemble  # noqa: E402


def parse(spec):
    dim, dkv, dq = spec.split(":", 1)[0], *spec.split(":", 1)[1].split("/dq:")
    m, n, s, w = (int(x) for x in re.fullmatch(r"m(\d+)n(\d+)s(\d+)w(\d+)", dkv).groups())
    config = BackwardTileConfig(block_m=m, block_n=n, num_stages=s, num_stages_do=s, num_stages_pds=1,
                                num_mma_warpgroups=w, dq_atom_m=1)
    m, n, s = (int(x) for x in re.fullmatch(r"m(\d+)n(\d+)s(\d+)", dq).groups())
    dq_config = SeparateDqConfig(min_seqlen_q=1, block_m=m, block_n=n, num_stages=s, num_mma_warpgroups=m // 64)
    return int(dim), config, dq_config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--grouped", action="store_true", help="grouped query heads (GQA)")
    args = parser.parse_args()
    for spec in args.specs:
        head_dim, config, dq_config = parse(spec)
        for causal in (c == "1" for c in args.causal.split(",")):
            with tempfile.TemporaryDirectory() as out:
                cubins = compile_backward_cubins("float32x3h", head_dim, AttentionProblem(causal=causal, grouped=args.grouped), config, out,
                                                 dq_config=dq_config)
                for name, path in cubins.items():
                    sass = disassemble(path)
                    print(f"{spec} causal={int(causal)} {name}: LDL {len(re.findall(r'LDL', sass))} "
                          f"STL {len(re.findall(r'STL', sass))} HGMMA {sorted(set(re.findall(r'HGMMA[.]([^ ]+)', sass)))}",
                          flush=True)


if __name__ == "__main__":
    main()
