"""Spills in the 16-bit forward kernels the host would run for variant problems (CPU only: compiles
for sm_90a and reads the SASS).

tests/test_sass.py checks each shipped entry on its plain problem and a few variant problems;
the seventieth session found fp16's plain full-mask softcap spilling on D = 64's and 96's
three-warpgroup tiles, a problem no SASS test compiled. This sweep compiles, per shipped 16-bit
forward entry, each variant problem below on every tile the host may run it on (the entry as
run, softcap_fitted; its two-warpgroup tile, rows_fitted, where grid_fitted or few rows pick it;
a narrow band's, band_fitted) and prints the LDL / STL counts of those that spill.

    python perf/experiments/fwd_spill_sweep.py [--shard 0/2] [--dtypes float16,bfloat16] [--head-dims 64,96]

Run shards side by side (one compile at a time each): --shard i/n takes every n-th job.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.config import (  # noqa: E402
    band_fitted, default_config_dir, load_config_file, rows_fitted, softcap_fitted, takes_clusters, without_clusters,
)
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.kernels.rules import DTYPES  # noqa: E402
from cute_flash.sass import compile_forward_cubin, disassemble, opcode_counts  # noqa: E402


def variant_problems(causal: bool):
    """name -> problem for an entry of this mask (causal ones also as the host aligns them for Sq
    = Sk: tiles ending at the last query)."""
    if not causal:
        return {
            "softcap": AttentionProblem.of(False, softcap=30.0),
            "softcap-sink-gqa": AttentionProblem.of(False, softcap=30.0, sink=True, grouped=True),
            "band-softcap": AttentionProblem.of(False, (64, 16), softcap=8.0),
            "sink-gqa": AttentionProblem.of(False, sink=True, grouped=True),
        }
    out = {
        "softcap": AttentionProblem.of(True, softcap=30.0),
        "everything": AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True),
        "window-softcap": AttentionProblem.of(True, (4095, 0), softcap=50.0, grouped=True),
        "sink-gqa": AttentionProblem.of(True, sink=True, grouped=True),
    }
    out.update({f"{name}-end": p.end_aligned(True, True) for name, p in list(out.items()) if not p.bottom_right})
    return out


def jobs(dtypes, head_dims):
    table = load_config_file(default_config_dir() / "h100.yaml")
    seen = set()
    for entry in table.entries:
        if entry.direction != "fwd" or entry.dtype not in dtypes or entry.head_dim not in head_dims:
            continue
        if entry.dtype not in DTYPES or entry.value_head_dim not in (None, entry.head_dim):
            continue
        for name, problem in variant_problems(entry.causal).items():
            run = softcap_fitted(entry.config if takes_clusters(entry.config, problem)
                                 else without_clusters(entry.config), problem)
            tiles = {"entry": run}
            if run.num_mma_warpgroups > 1:
                tiles["rows128"] = rows_fitted(run, 128)
            narrow = band_fitted(run, problem, entry.head_dim * 2)
            if narrow is not run:
                tiles["band"] = narrow
            for tile_name, config in tiles.items():
                key = (entry.dtype, entry.head_dim, problem, config)
                if key in seen:
                    continue
                seen.add(key)
                label = f"{entry.dtype} D={entry.head_dim} {'causal' if entry.causal else 'full'} seqlen={entry.seqlen} {name} {tile_name} " \
                        f"{config.block_m}x{config.block_n}/{config.num_mma_warpgroups}wg"
                yield label, entry.dtype, entry.head_dim, problem, config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--head-dims", default="16,32,64,96,128,192,256")
    args = parser.parse_args()
    index, count = (int(x) for x in args.shard.split("/"))
    todo = list(jobs(args.dtypes.split(","), [int(x) for x in args.head_dims.split(",")]))[index::count]
    print(f"shard {args.shard}: {len(todo)} kernels", flush=True)
    for label, dtype, head_dim, problem, config in todo:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                counts = opcode_counts(disassemble(compile_forward_cubin(dtype, head_dim, problem, config, Path(tmp))))
            except Exception as exc:  # noqa: BLE001 - a config the rules refuse for this problem
                print(f"{label}: not compiled ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
                continue
        spills = (counts.get("LDL", 0), counts.get("STL", 0))
        print(f"{label}: {'SPILLS LDL %d STL %d' % spills if any(spills) else 'clean'}", flush=True)


if __name__ == "__main__":
    main()
