"""Compile kernels for sm_90a without a GPU and read their SASS (development and CI checks).

The CuTe DSL compiles for the arch named in CUTE_DSL_ARCH when no GPU is present; with
CUTE_DSL_KEEP=cubin and CUTE_DSL_DUMP_DIR it leaves the cubin behind. Those variables are read
when the DSL is imported, so each compile runs in a fresh subprocess.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path


def find_nvdisasm() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH."""
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
    except ImportError:
        nvidia = None
    if nvidia is not None:
        for root in nvidia.__path__:
            for candidate in Path(root).glob("*/bin/nvdisasm"):
                return str(candidate)
    return shutil.which("nvdisasm")


def compile_forward_cubin(dtype_name, head_dim, problem, config, out_dir, timeout=600, tile_head_dim=None,
                          value_head_dim=None, value_tile_head_dim=None) -> Path:
    """Compile one forward kernel for sm_90a in a subprocess; return the cubin's path."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(out_dir))
    job = json.dumps(dict(dtype=dtype_name, head_dim=head_dim, problem=asdict(problem), config=asdict(config),
                          tile_head_dim=tile_head_dim, value_head_dim=value_head_dim,
                          value_tile_head_dim=value_tile_head_dim))
    # cwd: `-m` puts the working directory first on sys.path, so the child must start where
    # this process's cute_flash lives (a baseline checkout compared with another one's SASS
    # would otherwise compile whichever package the shell happens to stand in).
    proc = subprocess.run(
        [sys.executable, "-m", "cute_flash.sass", job],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[1],
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {job} failed:\n{proc.stdout}\n{proc.stderr}")
    cubins = sorted(out_dir.glob("*.cubin"), key=lambda p: p.stat().st_mtime)
    if not cubins:
        raise RuntimeError(f"compiling {job} left no cubin in {out_dir}")
    return cubins[-1]


def disassemble(cubin: Path) -> str:
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    proc = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True)
    return proc.stdout


def opcode_counts(sass: str) -> dict:
    """Opcode (without modifiers) -> count, e.g. {'HGMMA': 48, 'UTMALDG': 10}."""
    counts = {}
    for match in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def instructions(sass: str) -> list:
    """nvdisasm's text as instruction and label lines, without addresses and encodings."""
    lines = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)
        line = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line).strip()
        if line:
            lines.append(line)
    return lines


def main_loops(sass: str) -> list:
    """The bodies (instruction lines) of an attention kernel's main loops: loops (a label and a
    branch back to it) with a softmax in them (at least 16 exp2 on the SFU), no exit, and no
    other such loop inside (the longer ranges are mbarrier retry loops around them, or a
    persistent kernel's tile loop), in program order."""
    lines = instructions(sass)
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    ranges = []
    for end, line in enumerate(lines):
        m = re.search(r"BRA[^;]*?(\.L_x_\d+)", line)
        start = labels.get(m.group(1), end) if m else end
        body = lines[start:end + 1]
        if start < end and sum("MUFU.EX2" in b for b in body) >= 16 and not any(b.startswith("EXIT") for b in body):
            ranges.append((start, end))
    inner = [r for r in ranges if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in ranges)]
    return [lines[a:b + 1] for a, b in sorted(set(inner))]


def wgmma_groups(body: list) -> int:
    """WGMMA groups a loop body issues: HGMMAs that end a group (gsb0). ptxas issues each
    k-step as a group of its own where it must serialise them (an A operand's registers written
    between them, say): a GEMM should be one group."""
    return sum("HGMMA" in line and "gsb0" in line for line in body)


def _compile_job(job_json: str):
    from cute_flash.compile_fwd import compile_forward
    from cute_flash.config import TileConfig
    from cute_flash.kernels.problem import AttentionProblem

    job = json.loads(job_json)
    compile_forward(job["dtype"], job["head_dim"], AttentionProblem(**job["problem"]), TileConfig(**job["config"]),
                    tile_head_dim=job.get("tile_head_dim"), value_head_dim=job.get("value_head_dim"),
                    value_tile_head_dim=job.get("value_tile_head_dim"))


if __name__ == "__main__":
    _compile_job(sys.argv[1])
