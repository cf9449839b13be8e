"""Spills in the 16-bit backward kernels the host would run for variant problems (CPU only:
compiles for sm_90a and reads the SASS); the backward's counterpart of fwd_spill_sweep.py.

Per shipped 16-bit backward entry, each variant problem below with the config the host derives
for it (launch_bwd.derived_config), its kernels' LDL / STL counts and whether ptxas serialised
the WGMMAs (a WARPGROUP.DEPBAR after every HGMMA). tests/test_sass_bwd.py lists the known
exceptions; this lists every case.

    python perf/experiments/bwd_spill_sweep.py [--shard 0/2] [--dtypes float16,bfloat16] [--head-dims 64,96]
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.compile_bwd import compile_backward_cubins  # noqa: E402
from cute_flash.config import default_config_dir, load_config_file  # noqa: E402
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.kernels.rules import DTYPES  # noqa: E402
from cute_flash.launch_bwd import derived_config  # noqa: E402
from cute_flash.sass import disassemble, opcode_counts  # noqa: E402


def variant_problems(causal: bool):
    if not causal:
        return {
            "softcap": AttentionProblem.of(False, softcap=30.0),
            "softcap-gqa": AttentionProblem.of(False, softcap=30.0, grouped=True),
            "band-softcap": AttentionProblem.of(False, (64, 16), softcap=8.0),
            "sink-gqa": AttentionProblem.of(False, sink=True, grouped=True),
        }
    return {
        "softcap": AttentionProblem.of(True, softcap=30.0),
        "softcap-gqa": AttentionProblem.of(True, softcap=30.0, grouped=True),
        "window-softcap": AttentionProblem.of(True, (4095, 0), softcap=50.0),
        "window-softcap-gqa": AttentionProblem.of(True, (4095, 0), softcap=50.0, grouped=True),
        "everything": AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True),
        "sink-gqa": AttentionProblem.of(True, sink=True, grouped=True),
    }


def jobs(dtypes, head_dims):
    table = load_config_file(default_config_dir() / "h100.yaml")
    seen = set()
    for entry in table.entries:
        if entry.direction != "bwd" or entry.dtype not in dtypes or entry.head_dim not in head_dims:
            continue
        if entry.dtype not in DTYPES or entry.value_head_dim not in (None, entry.head_dim):
            continue
        for name, problem in variant_problems(entry.causal).items():
            config = derived_config(entry.config, entry.dtype, problem, entry.head_dim, entry.head_dim, False)
            key = (entry.dtype, entry.head_dim, problem, config)
            if key in seen:
                continue
            seen.add(key)
            label = f"{entry.dtype} D={entry.head_dim} {'causal' if entry.causal else 'full'} seqlen={entry.seqlen} {name}"
            yield label, entry.dtype, entry.head_dim, problem, config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--head-dims", default="16,32,64,96,128,192,256")
    args = parser.parse_args()
    index, count = (int(x) for x in args.shard.split("/"))
    todo = list(jobs(args.dtypes.split(","), [int(x) for x in args.head_dims.split(",")]))[index::count]
    print(f"shard {args.shard}: {len(todo)} kernel sets", flush=True)
    for label, dtype, head_dim, problem, config in todo:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                cubins = compile_backward_cubins(dtype, head_dim, problem, config, Path(tmp))
                found = []
                for kernel, path in sorted(cubins.items()):
                    sass = disassemble(path)
                    counts = opcode_counts(sass)
                    spills = (counts.get("LDL", 0), counts.get("STL", 0))
                    serial = counts.get("HGMMA", 0) and sass.count("WARPGROUP.DEPBAR") * 2 >= counts["HGMMA"]
                    if any(spills) or serial:
                        found.append(f"{kernel} LDL {spills[0]} STL {spills[1]}{' SERIALISED' if serial else ''}")
            except Exception as exc:  # noqa: BLE001 - a config the rules refuse for this problem
                print(f"{label}: not compiled ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
                continue
        print(f"{label}: {'SPILLS ' + '; '.join(found) if found else 'clean'}", flush=True)


if __name__ == "__main__":
    main()
