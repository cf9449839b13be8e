"""Spills in the 16-bit kernels the host would run for variant problems (CPU only: compiles for
sm_90a and reads the SASS).

tests/test_sass.py and tests/test_sass_bwd.py check each shipped entry on its plain problem and
a few variant problems; the seventieth session found fp16's plain full-mask softcap forward
spilling on D = 64's and 96's three-warpgroup tiles, a problem no SASS test compiled.

--direction fwd: per shipped 16-bit forward entry, each variant problem below on every tile the
host may run it on (the entry as run, softcap_fitted; its two-warpgroup tile, rows_fitted, where
grid_fitted or few rows pick it; a narrow band's, band_fitted).
--direction bwd: per shipped 16-bit backward entry, each variant problem on the config the host
derives for it (launch_bwd.derived_config), every kernel of the set; also whether ptxas
serialised the WGMMAs (a WARPGROUP.DEPBAR after every HGMMA).

    python perf/experiments/spill_sweep.py --direction fwd [--shard 0/2] [--dtypes float16] [--head-dims 64,96]
        [--packed]

Run shards side by side (one compile at a time each): --shard i/n takes every n-th job.
"""

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cute_flash.compile_bwd import compile_backward_cubins  # noqa: E402
from cute_flash.config import (  # noqa: E402
    band_fitted, default_config_dir, load_config_file, rows_fitted, softcap_fitted, takes_clusters, without_clusters,
)
from cute_flash.kernels.problem import AttentionProblem  # noqa: E402
from cute_flash.kernels.rules import DTYPES  # noqa: E402
from cute_flash.launch_bwd import derived_config  # noqa: E402
from cute_flash.sass import compile_forward_cubin, disassemble, opcode_counts, wgmma_batched  # noqa: E402


def variant_problems(causal: bool, direction: str, packed: bool = False):
    """name -> problem for an entry of this mask; the forward's causal ones also as the host
    aligns them for Sq = Sk (tiles ending at the last query). packed: the same problems over a
    packed batch; the forward's grouped bands also with a group of 4 query heads as each
    tile's rows (launch_fwd.packed_kernel_problem)."""
    problems = _dense_problems(causal, direction)
    if not packed:
        return problems
    out = {}
    for name, problem in problems.items():
        out[f"packed-{name}"] = dataclasses.replace(problem, packed=True)
        if direction == "fwd" and problem.grouped and problem.band:
            out[f"packed-rows4-{name}"] = out[f"packed-{name}"].with_group_in_rows(4)
    return out


def _dense_problems(causal: bool, direction: str):
    if not causal:
        return {
            "softcap": AttentionProblem.of(False, softcap=30.0),
            "softcap-sink-gqa": AttentionProblem.of(False, softcap=30.0, sink=True, grouped=True),
            "band-softcap": AttentionProblem.of(False, (64, 16), softcap=8.0),
            "sink-gqa": AttentionProblem.of(False, sink=True, grouped=True),
        }
    out = {
        "softcap": AttentionProblem.of(True, softcap=30.0),
        "softcap-gqa": AttentionProblem.of(True, softcap=30.0, grouped=True),
        "window-softcap": AttentionProblem.of(True, (4095, 0), softcap=50.0),
        "window-softcap-gqa": AttentionProblem.of(True, (4095, 0), softcap=50.0, grouped=True),
        "everything": AttentionProblem.of(True, (90, 0), "bottom_right", 10.0, True, True),
        "sink-gqa": AttentionProblem.of(True, sink=True, grouped=True),
    }
    if direction == "fwd":
        out.update({f"{name}-end": p.end_aligned(True, True) for name, p in list(out.items()) if not p.bottom_right})
    return out


def tiles(entry, problem, direction):
    """name -> config of each tile the host may run `problem` on for this entry."""
    if direction == "bwd":
        return {"derived": derived_config(entry.config, entry.dtype, problem, entry.head_dim, entry.head_dim, False)}
    run = softcap_fitted(entry.config if takes_clusters(entry.config, problem) else without_clusters(entry.config),
                         problem)
    out = {"entry": run}
    if run.num_mma_warpgroups > 1:
        out["rows128"] = rows_fitted(run, 128)
    narrow = band_fitted(run, problem, entry.head_dim * 2)
    if narrow is not run:
        out["band"] = narrow
    return out


def jobs(direction, dtypes, head_dims, packed=False):
    table = load_config_file(default_config_dir() / "h100.yaml")
    seen = set()
    for entry in table.entries:
        if entry.direction != direction or entry.dtype not in dtypes or entry.head_dim not in head_dims:
            continue
        if entry.dtype not in DTYPES or entry.value_head_dim not in (None, entry.head_dim):
            continue
        for name, problem in variant_problems(entry.causal, direction, packed).items():
            for tile_name, config in tiles(entry, problem, direction).items():
                key = (entry.dtype, entry.head_dim, problem, config)
                if key in seen:
                    continue
                seen.add(key)
                shape = f"{config.block_m}x{config.block_n}/{config.num_mma_warpgroups}wg"
                label = (f"{entry.dtype} D={entry.head_dim} {'causal' if entry.causal else 'full'} "
                         f"seqlen={entry.seqlen} {name} {tile_name} {shape}")
                yield label, entry.dtype, entry.head_dim, problem, config


def findings(direction, dtype, head_dim, problem, config, out_dir):
    """What spills (or serialises its WGMMAs) among the compiled kernels: a list of strings."""
    if direction == "fwd":
        cubins = {"fwd": compile_forward_cubin(dtype, head_dim, problem, config, out_dir)}
    else:
        cubins = compile_backward_cubins(dtype, head_dim, problem, config, out_dir)
    found = []
    for kernel, path in sorted(cubins.items()):
        sass = disassemble(path)
        counts = opcode_counts(sass)
        spills = (counts.get("LDL", 0), counts.get("STL", 0))
        serial = counts.get("HGMMA", 0) > 0 and not wgmma_batched(sass, counts)
        if any(spills) or serial:
            found.append(f"{kernel} LDL {spills[0]} STL {spills[1]}{' SERIALISED' if serial else ''}")
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--head-dims", default="16,32,64,96,128,192,256")
    parser.add_argument("--packed", action="store_true", help="the problems over packed batches (varlen)")
    args = parser.parse_args()
    index, count = (int(x) for x in args.shard.split("/"))
    todo = list(jobs(args.direction, args.dtypes.split(","),
                     [int(x) for x in args.head_dims.split(",")], args.packed))[index::count]
    print(f"shard {args.shard}: {len(todo)} {args.direction} kernels (sets)", flush=True)
    for label, dtype, head_dim, problem, config in todo:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                found = findings(args.direction, dtype, head_dim, problem, config, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a config the rules refuse for this problem
                print(f"{label}: not compiled ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
                continue
        print(f"{label}: {'SPILLS ' + '; '.join(found) if found else 'clean'}", flush=True)


if __name__ == "__main__":
    main()
