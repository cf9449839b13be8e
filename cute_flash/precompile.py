"""`python -m cute_flash precompile`: compile every kernel a GPU's shipped YAML can select into
the on-disk cache (cute_flash.disk_cache), on a machine with or without a GPU.

The CuTe DSL compiles for sm_90a on a CPU (CUTE_DSL_ARCH), so a container image built on a
CPU builder, or a login node, can fill the cache once; a GPU job that finds its kernels there
never compiles (and, with a C compiler present, never imports the DSL). The cache directory
is keyed by the kernel sources, the DSL and TVM-FFI versions and the Python version: precompile
with the same environment that the GPU job will run.

What "every kernel it can select" means, per entry of the file:
* fwd: the forward of that (dtype, head dim, causal, config) (of a pair of tiles, D and Dv),
  and for 16-bit entries the same on one consumer warpgroup (config.rows_fitted: decode steps,
  queries of at most 64 rows) and, for entries with speed_over_fitted, on the two-warpgroup
  tile config.grid_fitted runs on small grids (other fitted configs, e.g. D = 96's two
  warpgroups for 65-128 rows, compile on first use);
* bwd: the backward's kernels, also in their deterministic variant
  (torch.use_deterministic_algorithms), and with each `bwd_dq` entry of the same key whose
  separate dQ kernel can apply (min_seqlen_q > 0);
* KV caches (cute_flash.kvcache, contiguous caches): per non-causal fwd entry the decode
  step's forward (a group's query heads as rows, no mask; on one consumer warpgroup,
  config.rows_fitted: groups of more than 64 heads compile on first use), whole and in split
  parts (grouped rows of one position), per causal one the forward of a prefill over a cache with grouped
  heads, and per (dtype, head dim) the append and split merge kernels. Paged caches and other
  variants (grouped rows of several positions among them) compile on first use.
* float32 fwd entries ("float32": TF32, "float32x3": 3xTF32, "float32x3h": scaled fp16 halves;
  cute_flash.float32): the dense forward and the operand pass (kernels/tf32_operands.py,
  kernels/half_operands.py) of the entry's head dim (other head
  dims served by its tile compile their operand pass on first use); KV caches take 16-bit
  dtypes only. float32 bwd entries (either name): the dK / dV kernel with the bwd_dq entry's
  dQ kernel (one set: nothing to order for the deterministic mode) and the backward's
  operand pass of the entry's head dim.
Kernels are compiled in worker processes (`--jobs`), each task one forward or one backward
set; tasks whose kernels are all cached already are quick (they load and stop).
"""

import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from cute_flash.config import one_launch_config, rows_fitted, takes_clusters, without_clusters
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.rules import DTYPES, FLOAT32_INPUTS, SCALED_HALVES, SPLIT_FLOAT32


@dataclasses.dataclass(frozen=True)
class Task:
    # "fwd", "bwd", "kvcache" (the append and merge kernels), "tf32-operands" or
    # "halves-operands" (a float32 forward's operand pass) or "tf32-bwd-operands" /
    # "halves-bwd-operands" (a float32 backward's).
    direction: str
    dtype: str
    head_dim: int
    problem: AttentionProblem
    config: object
    dq_config: object = None
    # A pair of head dims (v's differs from q's: fwd, bwd) and the native tiles (T, Tv) whose
    # config (above) serves it (cute_flash.head_dims); None: head_dim.
    value_head_dim: int | None = None
    tiles: tuple | None = None

    def label(self) -> str:
        extra = ""
        if self.direction == "bwd":
            extra = " deterministic" if self.config.deterministic else ""
            extra += " in-kernel preprocess" if self.config.preprocess_in_main else ""
            extra += " in-kernel postprocess" if self.config.fused_postprocess else ""
            extra += " separate-dQ" if self.dq_config is not None else ""
        if self.direction == "kvcache":
            return f"kvcache append+merge {self.dtype} D={self.head_dim}"
        if self.direction in ("tf32-operands", "halves-operands"):
            return f"float32 operands {self.dtype} D={self.head_dim}"
        if self.direction in ("tf32-bwd-operands", "halves-bwd-operands"):
            return f"float32 backward operands {self.dtype} D={self.head_dim}"
        mask = "causal" if self.problem.causal else "non-causal"
        extra += " KV cache" if self.problem.cached_keys else ""
        extra += " split" if self.problem.split_keys else ""
        # Tiles aligned to the last query (AttentionProblem.end_aligned): Sq = Sk's forward.
        extra += " end-aligned" if self.problem.tiles_end_aligned else ""
        extra += " one warpgroup" if self.direction == "fwd" and self.config.num_mma_warpgroups == 1 else ""
        dims = f"D={self.head_dim}" + (f" Dv={self.value_head_dim}" if self.value_head_dim else "")
        return f"{self.direction} {self.dtype} {dims} {mask}{extra}"


def forward_tasks(dtype: str, head_dim: int, problem: AttentionProblem, config, **pair) -> list:
    """The forward kernels the host may run for `problem` with an entry's config: with one
    query head per cluster, and with the entry's clusters of heads where the problem takes
    them (config.heads_clustered picks one per call, by the grid's size)."""
    tasks = [Task("fwd", dtype, head_dim, problem, without_clusters(config), **pair)]
    if takes_clusters(config, problem):
        tasks.append(Task("fwd", dtype, head_dim, problem, config, **pair))
    return tasks


def tasks_for(table) -> list:
    """The forward and backward kernel sets that `table` (a config.ConfigTable) can select,
    without duplicates (a deterministic backward with a separate dQ kernel is the same set
    of kernels as the non-deterministic one, see compile_bwd)."""
    tasks = []
    for entry in table.entries:
        match = (entry.dtype, entry.head_dim, entry.causal)
        key = (entry.dtype, entry.head_dim, AttentionProblem.of(entry.causal))
        if entry.direction == "fwd" and entry.value_head_dim is not None:
            # A pair of tiles (a value tile of its own): the dense forward of that pair.
            tiles = (entry.head_dim, entry.value_head_dim)
            tasks += forward_tasks(*key, entry.config, value_head_dim=entry.value_head_dim, tiles=tiles)
            if entry.dtype == SCALED_HALVES:
                # float32's value chunks (cute_flash.float32.value_chunks) and their operand pass.
                tasks.append(Task("halves-operands", entry.dtype, entry.head_dim, AttentionProblem.of(), None))
        elif entry.direction == "fwd":
            # A 16-bit causal forward with as many queries as keys runs bottom-right, its tiles
            # aligned to the last query (AttentionProblem.end_aligned); top-left where Sq != Sk.
            aligned = key[2].end_aligned(True, entry.dtype in DTYPES)
            for problem in dict.fromkeys((key[2], aligned)):
                tasks += forward_tasks(*key[:2], problem, entry.config)
                if entry.config.speed_over_fitted:  # its two-warpgroup tile on small grids (config.grid_fitted)
                    tasks += forward_tasks(*key[:2], problem, rows_fitted(entry.config, 128))
            if entry.dtype in FLOAT32_INPUTS:  # its operand pass; KV caches take 16-bit dtypes only
                operands = "halves-operands" if entry.dtype == SCALED_HALVES else "tf32-operands"
                tasks.append(Task(operands, entry.dtype, entry.head_dim, AttentionProblem.of(), None))
                continue
            # Over a KV cache: a decode step (non-causal: one row sees every key), whole or in
            # split parts (a group's rows, kvcache._grouped_step), or a prefill with grouped
            # heads (causal, bottom-right).
            # A decode step's rows are a group of query heads (at most 64 rows in the models
            # served: one consumer warpgroup, config.rows_fitted); a prefill's fill the tile.
            # The dense forward on one warpgroup too: flash_attention's (and SDPA's) decode
            # steps without split, and queries of at most 64 rows.
            decode_config = rows_fitted(entry.config, 1)
            tasks += forward_tasks(*key, decode_config)
            for split in (False, True) if not entry.causal else (False,):
                cache = AttentionProblem.of(entry.causal, alignment="bottom_right", grouped=entry.causal,
                                            keys_used=True, cached_keys=True, split_keys=split, grouped_rows=split)
                tasks += forward_tasks(entry.dtype, entry.head_dim, cache,
                                       entry.config if entry.causal else decode_config)
            # flash_attention's decode step with few units, split (api._split_parts): SDPA's
            # non-causal one row, flash-attn's bottom-right causal one.
            dense_split = AttentionProblem.of(entry.causal, alignment="bottom_right", grouped_rows=True,
                                              split_keys=True)
            tasks += forward_tasks(entry.dtype, entry.head_dim, dense_split, decode_config)
            tasks.append(Task("kvcache", entry.dtype, entry.head_dim, AttentionProblem.of(), None))
        elif entry.direction == "bwd":
            separate = [e.config for e in table.entries
                        if e.direction == "bwd_dq" and (e.dtype, e.head_dim, e.causal) == match
                        and e.config.min_seqlen_q > 0]
            if entry.dtype in FLOAT32_INPUTS:
                # float32: the dK / dV kernel with its bwd_dq entry's dQ kernel (no dQ addition
                # to order: one set serves both modes) and the operand pass.
                tasks += [Task("bwd", *key, entry.config, dq) for dq in separate]
                operands = "halves-bwd-operands" if entry.dtype == SCALED_HALVES else "tf32-bwd-operands"
                tasks.append(Task(operands, entry.dtype, entry.head_dim, AttentionProblem.of(), None))
                continue
            # A pair of tiles (a value tile of its own): the backward of that pair.
            pair = dict(value_head_dim=entry.value_head_dim, tiles=(entry.head_dim, entry.value_head_dim)) \
                if entry.value_head_dim is not None else {}
            for deterministic in (False, True):
                config = dataclasses.replace(entry.config, deterministic=deterministic)
                tasks.append(Task("bwd", *key, config, **pair))
                if not deterministic:
                    tasks += [Task("bwd", *key, config, dq, **pair) for dq in separate]
            # A grid run as one launch: the main kernel prepares every head (no preprocess launch) and
            # may convert its dQ (no postprocess launch).
            value = entry.value_head_dim or entry.head_dim
            one_launch = one_launch_config(entry.config, entry.dtype, key[2], entry.head_dim, entry.head_dim, value, 1,
                                           1, 1)
            if one_launch is not entry.config:
                tasks.append(Task("bwd", *key, one_launch, **pair))
    return list(dict.fromkeys(tasks))


def _run_task(task: Task, arch: str) -> tuple:
    """In a worker process: load or compile one task's kernels; (compiled count, seconds)."""
    os.environ.setdefault("CUTE_DSL_ARCH", arch)  # read when the DSL is imported
    from cute_flash import compile_bwd, compile_cache, compile_fwd

    start = time.perf_counter()
    before = compile_cache.compile_count
    tile, value_tile = task.tiles or (None, None)
    if task.direction == "fwd":
        compile_fwd.get_forward(task.dtype, task.head_dim, task.problem, task.config, arch, tile, task.value_head_dim,
                                value_tile)
    elif task.direction == "tf32-operands":
        compile_fwd.get_tf32_operands(task.head_dim, task.head_dim, task.dtype == SPLIT_FLOAT32, arch)
    elif task.direction in ("halves-operands", "halves-bwd-operands"):
        compile_fwd.get_halves_operands(task.head_dim, task.head_dim, arch, task.direction == "halves-bwd-operands")
    elif task.direction == "tf32-bwd-operands":
        compile_bwd.get_tf32_backward_operands(task.head_dim, task.head_dim, task.dtype == SPLIT_FLOAT32, arch)
    elif task.direction == "kvcache":
        from cute_flash import compile_kvcache

        compile_kvcache.get_cache_append(task.dtype, task.head_dim, arch)
        compile_kvcache.get_split_merge(task.dtype, task.head_dim, arch)
    else:
        compile_bwd.get_backward(task.dtype, task.head_dim, task.problem, task.config, arch, task.dq_config, True, tile,
                                 task.value_head_dim, value_tile)
    return compile_cache.compile_count - before, time.perf_counter() - start


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "-" * (width - filled) + f"] {done:>{len(str(total))}}/{total}"


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def tasks_of_dtypes(tasks: list, dtypes) -> list:
    """The tasks of these YAML dtypes (None: all of them); a ValueError naming the dtypes the
    tasks have when one of `dtypes` has none."""
    if dtypes is None:
        return tasks
    known = sorted({t.dtype for t in tasks})
    missing = [d for d in dtypes if d not in known]
    if missing:
        raise ValueError(f"no kernel set of dtype {missing[0]!r} (the file has {', '.join(known)})")
    return [t for t in tasks if t.dtype in dtypes]


def precompile(gpu: str, arch: str, jobs: int, out=sys.stderr, dtypes=None) -> int:
    """Fill the disk cache for configs/<gpu>.yaml (with `dtypes`, a list, only those dtypes'
    kernel sets); returns an exit code."""
    from cute_flash import disk_cache
    from cute_flash.config import ConfigError, default_config_dir, load_config_file

    path = default_config_dir() / f"{gpu}.yaml"
    try:
        table = load_config_file(path)
    except ConfigError as exc:
        known = sorted(p.stem for p in default_config_dir().glob("*.yaml"))
        print(f"cute-flash precompile: {exc} (configs here: {', '.join(known) or 'none'})", file=out)
        return 1
    if not disk_cache.enabled():
        print("cute-flash precompile: the disk cache is off (CUTE_FLASH_DISK_CACHE=0); nothing to fill", file=out)
        return 1
    directory = disk_cache.cache_directory(create=True)
    if directory is None:
        print(f"cute-flash precompile: cannot use the cache under {disk_cache.cache_root()} (see the warning)",
              file=out)
        return 1
    try:
        tasks = tasks_of_dtypes(tasks_for(table), dtypes)
    except ValueError as exc:
        print(f"cute-flash precompile: {exc}", file=out)
        return 1
    print(f"cute-flash precompile: {len(tasks)} kernel sets from {path} for {arch} into {directory} "
          f"({jobs} jobs)", file=out)
    start = time.perf_counter()
    compiled = failed = 0
    # spawn: each worker imports the DSL afresh with CUTE_DSL_ARCH set (fork would copy a
    # parent's DSL state, and CUDA must not be forked).
    import multiprocessing

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_task, task, arch): task for task in tasks}
        for done, future in enumerate(as_completed(futures), start=1):
            task = futures[future]
            try:
                count, seconds = future.result()
                compiled += count
                status = f"compiled {count}" if count else "cached"
                print(f"{_bar(done, len(tasks))} {task.label()}: {status} ({seconds:.1f} s)", file=out, flush=True)
            except Exception as exc:  # report every failure, then fail the command
                failed += 1
                print(f"{_bar(done, len(tasks))} {task.label()}: FAILED ({type(exc).__name__}: {exc})", file=out,
                      flush=True)
    total = time.perf_counter() - start
    print(f"cute-flash precompile: {compiled} kernels compiled, {len(tasks) - failed} sets ready, {failed} failed, "
          f"in {total:.1f} s; cache {directory}: {_size(directory) / 2**20:.1f} MiB", file=out)
    return 1 if failed else 0
