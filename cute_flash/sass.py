"""Compile kernels for sm_90a without a GPU and read their SASS (development and CI checks).

The CuTe DSL compiles for the arch named in CUTE_DSL_ARCH when no GPU is present; with
CUTE_DSL_KEEP=cubin and CUTE_DSL_DUMP_DIR it leaves the cubin behind. Those variables are read
when the DSL is imported, so compiles run in a child process started with them: one long-lived
child per process (_CompileServer), which dumps into a directory of its own and after each job
moves what appeared there into the job's directory. A child per compile, as before, spent
~5 s importing torch and the DSL each time, about a third of a SASS test on a CI core.
"""

import atexit
import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
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
    """Compile one forward kernel for sm_90a in the compile child; return the cubin's path."""
    job = dict(kind="fwd", dtype=dtype_name, head_dim=head_dim, problem=asdict(problem), config=asdict(config),
               tile_head_dim=tile_head_dim, value_head_dim=value_head_dim, value_tile_head_dim=value_tile_head_dim)
    return _compile_cubin(job, out_dir, timeout)


def compile_operand_pass_cubin(name: str, head_dim: int, tile_head_dim: int, backward: bool, out_dir,
                               timeout=600) -> Path:
    """Compile a float32 operand pass for sm_90a in the compile child: name "halves"
    (kernels/half_operands.py), "tf32" or "tf32x3" (kernels/tf32_operands.py, rounded or
    split), the forward's or with `backward` the backward's; return the cubin's path."""
    job = dict(kind="operands", name=name, head_dim=head_dim, tile_head_dim=tile_head_dim, backward=backward)
    return _compile_cubin(job, out_dir, timeout)


def _compile_cubin(job: dict, out_dir, timeout: float) -> Path:
    """One job compiled in the compile child; the (last) cubin it left in out_dir."""
    out_dir = Path(out_dir).resolve()
    cubins = [p for p in compile_in_child(job, out_dir, timeout) if p.suffix == ".cubin"]
    if not cubins:
        raise RuntimeError(f"compiling {json.dumps(job)} left no cubin in {out_dir}")
    return cubins[-1]


# Job (JSON) -> [(file, sha256 of its bytes)] its compile left, for a job asked for again in
# this process: the SASS tests compile some kernels in two tests (11 of 261 compiles in one CI
# run, 5-10 s each). The hashes tell a file still holding the job's output from one that a
# later job overwrote (the DSL names a cubin after the kernel's argument types, not its config).
_compiled = {}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unchanged(files) -> bool:
    return all(path.exists() and _sha256(path) == digest for path, digest in files)


def compile_in_child(job: dict, out_dir: Path, timeout: float) -> list:
    """Run one compile job (_run_job) in this process's compile child; the files it dumps
    are moved into out_dir, and returned (sorted by name). A job this process compiled before
    is not compiled again while its files are unchanged: they are copied into out_dir.
    RuntimeError with the child's traceback if it fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    key = json.dumps(job, sort_keys=True)
    earlier = _compiled.get(key)
    if earlier is not None and _unchanged(earlier):
        copies = [out_dir / path.name for path, _ in earlier]
        for (path, _), copy in zip(earlier, copies):
            if path != copy:
                shutil.copyfile(path, copy)
        return copies
    files = [out_dir / name for name in _SERVER.run(dict(job, out_dir=str(out_dir)), timeout)]
    _compiled[key] = [(path, _sha256(path)) for path in files]
    return files


class _CompileServer:
    """The compile child of this process, started on first use (and again after a failure
    or every JOBS_PER_CHILD jobs, which bounds what the DSL's compiles leave in memory).
    Jobs go in as JSON lines on its stdin; each answer is one line on a pipe of its own (the
    DSL and ptxas may print to stdout and stderr, which go to a log file). The child keeps the
    environment this process had when it started it."""

    JOBS_PER_CHILD = 40

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None
        self.jobs = 0
        self.scratch = None
        atexit.register(self.stop)

    def run(self, job: dict, timeout: float) -> list:
        """The names of the files the job left in job["out_dir"]."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None or self.jobs >= self.JOBS_PER_CHILD:
                self.stop()
                self.start()
            self.jobs += 1
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.answers], [], [], timeout)
            answer = self.answers.readline() if ready else ""
            if not answer:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(f"compiling {json.dumps(job)} {'timed out' if not ready else 'killed the child'}"
                                   f":\n{log}")
            reply = json.loads(answer)
            if not reply["ok"]:
                raise RuntimeError(f"compiling {json.dumps(job)} failed:\n{reply['error']}\n{self._log_tail()}")
            return reply["files"]

    def start(self) -> None:
        self.scratch = tempfile.mkdtemp(prefix="cute_flash_sass_")
        dump = Path(self.scratch) / "dump"
        dump.mkdir()
        self.log = open(Path(self.scratch) / "log", "w+")
        read_end, write_end = os.pipe()
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump))
        # cwd: `-m` puts the working directory first on sys.path, so the child must start where
        # this process's cute_flash lives (a baseline checkout compared with another one's SASS
        # would otherwise compile whichever package the shell happens to stand in).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cute_flash.sass", "--serve", str(write_end)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, pass_fds=(write_end,),
            cwd=Path(__file__).resolve().parents[1])
        os.close(write_end)
        self.answers = os.fdopen(read_end)
        self.jobs = 0

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.answers.close()
            self.log.close()
            self.proc = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _log_tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]


_SERVER = _CompileServer()


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


def wgmma_batched(sass: str, counts: dict) -> bool:
    """False when ptxas serialised the warpgroup MMAs (C7512, "insufficient register
    resources"): a WARPGROUP.DEPBAR after every HGMMA instead of one per GEMM or two. The
    kernel is then correct but far slower (perf/NOTES.md: the first 80-row backward).
    counts: opcode_counts(sass)."""
    return sass.count("WARPGROUP.DEPBAR") * 2 < counts.get("HGMMA", 0)


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


def _run_job(job: dict) -> None:
    """Compile one job in the compile child: a forward ("fwd"), the backward's kernels ("bwd",
    compile_bwd.compile_backward_cubins) or a float32 operand pass ("operands")."""
    from cute_flash.config import BackwardTileConfig, SeparateDqConfig, TileConfig
    from cute_flash.kernels.problem import AttentionProblem

    if job["kind"] == "operands":
        from cute_flash import compile_bwd, compile_fwd

        head_dim, tile, backward = job["head_dim"], job["tile_head_dim"], job["backward"]
        if job["name"] == "halves":
            compile_fwd.compile_halves_operands(head_dim, tile, backward)
        elif backward:
            compile_bwd.compile_tf32_backward_operands(head_dim, tile, job["name"] == "tf32x3")
        else:
            compile_fwd.compile_tf32_operands(head_dim, tile, job["name"] == "tf32x3")
        return
    problem = AttentionProblem(**job["problem"])
    dims = dict(tile_head_dim=job.get("tile_head_dim"), value_head_dim=job.get("value_head_dim"),
                value_tile_head_dim=job.get("value_tile_head_dim"))
    if job["kind"] == "fwd":
        from cute_flash.compile_fwd import compile_forward

        compile_forward(job["dtype"], job["head_dim"], problem, TileConfig(**job["config"]), **dims)
    else:
        from cute_flash.compile_bwd import compile_backward

        dq = job.get("dq_config")
        compile_backward(job["dtype"], job["head_dim"], problem, BackwardTileConfig(**job["config"]),
                         dq_config=SeparateDqConfig(**dq) if dq else None, **dims)


def _serve(answer_fd: int) -> None:
    """The compile child's loop: a job per stdin line; what the DSL dumped moved into the
    job's out_dir; one JSON answer line per job on answer_fd, naming the files moved."""
    dump = Path(os.environ["CUTE_DSL_DUMP_DIR"])
    with os.fdopen(answer_fd, "w") as answers:
        for line in sys.stdin:
            job = json.loads(line)
            try:
                _run_job(job)
                reply = {"ok": True}
            except Exception:
                reply = {"ok": False, "error": traceback.format_exc()}
            reply["files"] = sorted(path.name for path in dump.iterdir())
            for name in reply["files"]:
                shutil.move(str(dump / name), Path(job["out_dir"]) / name)
            answers.write(json.dumps(reply) + "\n")
            answers.flush()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python -m cute_flash.sass --serve FD (the compile child of cute_flash.sass)")
    _serve(int(sys.argv[2]))
