"""SASS of every shipped kernel, normalised, for checking that a refactor leaves the compiled
code instruction-identical (CPU only: compiles for sm_90a without a GPU).

    python perf/sass_fingerprint.py --out DIR [--jobs 8] [--gpu h100] [--only SUBSTRING]
    python perf/sass_fingerprint.py --compare DIR_A DIR_B

The first form compiles every kernel set that `precompile` would (cute_flash.precompile
.tasks_for: forwards; backwards, deterministic and separate-dQ) in subprocesses, disassembles
each cubin with nvdisasm and writes DIR/<task>--<kernel>.sass with addresses and encodings
stripped and the kernel's mangled symbol replaced by KERNEL (the DSL spells the argument
types into it: grouping arguments renames a kernel without changing an instruction), plus
DIR/manifest.txt (sha256 per file). --only compiles the sets whose label contains SUBSTRING.
The second form says which differ (it normalises both directories' files again, so a
directory written by an older version of this script compares correctly).
"""

import argparse
import hashlib
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cute_flash.compile_bwd import compile_backward_cubins
from cute_flash.config import default_config_dir, load_config_file
from cute_flash.precompile import tasks_for
from cute_flash.sass import compile_forward_cubin, disassemble, instructions


def normalise(sass: str) -> str:
    """Instruction text only (cute_flash.sass.instructions: no /*addr*/ prefixes, no /* 0x... */
    encodings, no blank lines), no mangled kernel symbol. Idempotent."""
    return "\n".join(re.sub(r"kernel_cutlass_\w+", "KERNEL", line) for line in instructions(sass)) + "\n"


def _task_name(task) -> str:
    return re.sub(r"[^A-Za-z0-9=.-]+", "_", task.label())


def _compile(task, work: Path) -> dict:
    """{kernel name: normalised SASS} of one task."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        if task.direction == "fwd":
            tile, value_tile = task.tiles or (None, None)
            cubins = {"forward": compile_forward_cubin(task.dtype, task.head_dim, task.problem, task.config, tmp,
                                                       tile_head_dim=tile, value_head_dim=task.value_head_dim,
                                                       value_tile_head_dim=value_tile)}
        else:
            tile, value_tile = task.tiles or (None, None)
            cubins = compile_backward_cubins(task.dtype, task.head_dim, task.problem, task.config, tmp,
                                             dq_config=task.dq_config, tile_head_dim=tile,
                                             value_head_dim=task.value_head_dim, value_tile_head_dim=value_tile)
        return {name: normalise(disassemble(path)) for name, path in cubins.items()}


def _digest(sass: str) -> str:
    return hashlib.sha256(sass.encode()).hexdigest()[:16]


def fingerprint(out: Path, jobs: int, gpu: str, only: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    # The attention kernels' sets: precompile's other tasks (the KV cache's helpers, the float32
    # operand passes) are small copy kernels this tool does not compile.
    tasks = [t for t in tasks_for(load_config_file(default_config_dir() / f"{gpu}.yaml"))
             if t.direction in ("fwd", "bwd") and only in t.label()]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda t: (t, _compile(t, out)), tasks))
    manifest = []
    for task, kernels in results:
        for name, sass in sorted(kernels.items()):
            path = out / f"{_task_name(task)}--{name}.sass"
            path.write_text(sass)
            manifest.append(f"{_digest(sass)}  {path.name}")
    (out / "manifest.txt").write_text("\n".join(sorted(manifest, key=lambda l: l.split()[1])) + "\n")
    print(f"{len(manifest)} kernels of {len(tasks)} sets -> {out}/manifest.txt")


def compare(a: Path, b: Path) -> int:
    def read(d):
        names = [line.split()[1] for line in (d / "manifest.txt").read_text().splitlines()]
        return {name: _digest(normalise((d / name).read_text())) for name in names}

    left, right = read(a), read(b)
    differ = sorted(n for n in left.keys() & right.keys() if left[n] != right[n])
    only = sorted(left.keys() ^ right.keys())
    for name in differ:
        print(f"differs: {name}")
    for name in only:
        print(f"only in {'A' if name in left else 'B'}: {name}")
    same = len(left.keys() & right.keys()) - len(differ)
    print(f"{same} identical, {len(differ)} differ, {len(only)} in one only")
    return 1 if differ or only else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--only", default="", help="compile only the sets whose label contains this")
    parser.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*map(Path, args.compare)))
    fingerprint(Path(args.out), args.jobs, args.gpu, args.only)


if __name__ == "__main__":
    main()
