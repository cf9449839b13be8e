"""`python -m cute_flash tune`: measure candidate tile configs and write configs/<gpu>.yaml.

For every (dtype, head dim, causal, direction) asked for, each candidate config is compiled
(candidates that do not compile or do not fit shared memory are dropped), checked against a
float32 reference on odd shapes with poisoned outputs (wrong candidates are dropped, loudly),
then timed on the tuning shape (the largest case of test_cases/test.txt by default). The
fastest correct candidate becomes the entry, with what was measured beside it.

Resumable: every measurement is appended to a JSON-lines state file as soon as it is taken,
and a rerun skips what the file already holds. `--budget-s` stops starting new measurements
after that many seconds; the YAML is then written from what has been measured (keys not yet
measured keep their current entry), so a tuning run fits in bounded GPU calls.
"""

import dataclasses
import itertools
import json
import math
import os
import time
from pathlib import Path

import torch
import yaml

from cute_flash.torch_helpers import DENSE_BATCH

from cute_flash.config import (
    BackwardTileConfig,
    TileConfig,
    config_path_for_device,
    load_config_file,
)
from cute_flash.kernels import rules
from cute_flash.kernels.problem import AttentionProblem

TUNED_DIRECTIONS = ("fwd", "bwd")  # bwd_dq is a policy (from which Sq), set by hand
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CHECK_SHAPES = [(1, 2, 17, 17), (1, 2, 1000, 1000), (1, 2, 300, 777), (2, 1, 777, 300)]  # B, N, Sq, Sk


def _buildable(direction, dtype, head_dim, candidates, value_head_dim=None):
    """The candidates that every kernel of the entry can implement (cute_flash.kernels.rules:
    the same rules as the config loader's and the kernel constructors'), without duplicates."""
    return [c for c in dict.fromkeys(candidates)
            if rules.for_entry(direction, dtype, head_dim, c, value_head_dim) is None]


def head_dim_pair(item) -> tuple:
    """(head_dim, value_head_dim or None) of a --head-dims item: 128, or a pair "192:128" (a
    value tile of its own, forward or backward, cute_flash.config)."""
    if isinstance(item, tuple):
        return item
    head_dim, _, value = str(item).partition(":")
    return int(head_dim), (int(value) if value and int(value) != int(head_dim) else None)


# Three-warpgroup tiles' speed per score over the two-warpgroup 128 x 128 tile (TileConfig.
# speed_over_fitted, by head dim, warpgroups and key block): fitted with grid_makespan's fixed cost
# to same-run ratios on H200 grids (perf/NOTES.md, fiftieth to fifty-third sessions), not
# measured by the tuner. (64, 3, 96): causal sequences of at most 2896 (the seqlen 1024 entries).
FITTED_SPEEDS = {(64, 3, 128): 1.24, (64, 3, 96): 1.28, (96, 3, 112): 1.2, (128, 3, 80): 1.06}
# Three-warpgroup tiles on fewer keys than 128 whose calls of few rows, and the grids the model
# gives to two warpgroups, run 128 keys (TileConfig.fitted_block_n): at D = 128 160 registers
# hold only 80 keys' scores; at D = 64 128 x 96 ran 5-7 % slower than 128 x 128.
FITTED_TO_128 = {(3, 80), (3, 96)}


# The TileConfig fields the forward's tile space sets. Every other field of an entry was set by
# hand from same-run measurements (where O is rescaled, clusters of query heads) and rides along
# on each of that entry's candidates: a re-tune must not drop it for the dataclass's default.
SEARCHED_FWD_FIELDS = frozenset(("block_m", "block_n", "num_stages", "num_mma_warpgroups", "pingpong",
                                 "fitted_block_n", "speed_over_fitted"))
# Of the carried fields, those the tuning shape can judge: each is also timed flipped on the
# incumbent (clusters of query heads need grouped heads, which the tuning shape does not have).
TOGGLED_FWD_FIELDS = ("rescale_before_pv", "rescale_every_block")


def forward_candidates(dtype, head_dim, value_head_dim=None, current: TileConfig | None = None):
    """Forward tiles worth timing: 2 or 3 consumer warpgroups, with and without ping-pong.
    With `current` (the entry being re-tuned) it comes first, every tile carries its fields
    outside SEARCHED_FWD_FIELDS, and it is timed with each TOGGLED_FWD_FIELDS flipped.
    (Key blocks other than 128 lost every earlier run at D <= 128 -- except 112 with three
    warpgroups at D = 96, nineteenth session, and 96 on causal D = 64 sequences of at most
    2048, fifty-third session: perf/NOTES.md. The
    persistent grid and the non-overlapped main loop never made a shipped entry and were
    deleted: git history.) Above D = 128 the O accumulator (D / 2 floats per thread) leaves no
    room for a third warpgroup, and Q plus two stages of K and V must fit in shared memory:
    2 warpgroups, key blocks of 64 to 128 (those that do not fit fail to compile and are
    skipped), with and without ping-pong (without it won at D = 256 and causal D = 192,
    twenty-ninth session)."""
    carried = {} if current is None else {
        field.name: getattr(current, field.name) for field in dataclasses.fields(TileConfig)
        if field.name not in SEARCHED_FWD_FIELDS}
    out = [] if current is None else [current]
    space = itertools.product((2, 3), (128,), (True, False)) if head_dim <= 128 else \
        itertools.product((2,), (64, 80, 96, 112, 128), (True, False))
    if head_dim <= 128:
        # FA3's D <= 96 shape: three warpgroups on fewer keys (8-10 % faster at D = 96, perf/NOTES.md),
        # and on 80 keys, what 160 registers hold at D = 128 (4-6 % faster per score, forty-ninth to fifty-first
        # sessions; calls of few rows, and grids whose rounds the model says favour it, run two warpgroups on
        # 128 keys).
        space = [*space, (3, 112, True), (3, 80, True)]
    if head_dim <= 64:
        # Causal D = 64 at S <= 2048: 96 keys, fewer masked scores per tile (fifty-third session).
        space = [*space, (3, 96, True)]
    for warpgroups, block_n, pingpong in space:
        out.append(TileConfig(block_m=64 * warpgroups, block_n=block_n, num_stages=2,
                              num_mma_warpgroups=warpgroups, pingpong=pingpong,
                              fitted_block_n=128 if (warpgroups, block_n) in FITTED_TO_128 else 0,
                              speed_over_fitted=FITTED_SPEEDS.get((head_dim, warpgroups, block_n), 0.0),
                              **carried))
    if current is not None:
        out += [dataclasses.replace(current, **{name: not getattr(current, name)}) for name in TOGGLED_FWD_FIELDS]
    return _buildable("fwd", dtype, head_dim, out, value_head_dim)


def backward_candidates(current: BackwardTileConfig, dtype, head_dim: int, value_head_dim: int | None = None):
    """Backward variants around the current entry (one or two dS buffers, dV before or after dS,
    one or two staged dQ tiles, the exp2s pinned, not, or half of them, the preprocess fused or
    not), FA3's 80-row step where the swapped dQ GEMM allows it (the kernel's rule: head_dim =
    64 per consumer warpgroup), for D = 64 FA3's step of 64 query rows per warpgroup, and above
    D = 128 both ways of sharing a key block. value_head_dim: a value tile of its own (kept
    where the kernel's rules allow it: transposed grads)."""
    base = dataclasses.replace(current, deterministic=False)
    # One dS buffer or num_stages of them, whichever the entry does not have (two won at D <= 64).
    variants = [base, dataclasses.replace(base, num_stages_pds=1 if base.num_stages_pds > 1 else base.num_stages)]
    variants.append(dataclasses.replace(base, dv_after_ds=not base.dv_after_ds))
    # The exp2s pinned above dP^T's wait or not: which wins is per tile and dtype (perf/NOTES.md,
    # fortieth session).
    variants.append(dataclasses.replace(base, exps_above_dp_wait=not base.exps_above_dp_wait, pinned_exp_columns=0))
    # Half of a thread's block_m / 4 exp2 columns pinned, or all where the entry pins part (won
    # at D <= 96: the pinned SFU run no longer outlasts dP^T's GEMM; forty-first and
    # forty-second sessions).
    # Every variant's share is fitted to its step (pinned_share_fitted).
    variants.append(dataclasses.replace(base, exps_above_dp_wait=True,
                                        pinned_exp_columns=0 if base.pinned_exp_columns else base.block_m // 8))
    variants.append(dataclasses.replace(base, dq_stages=3 - base.dq_stages))
    variants.append(dataclasses.replace(base, fused_preprocess=not base.fused_preprocess))
    if base.dq_swap_ab:
        # The 64-row step beside the current 80-row one (dQ GEMM unswapped, dV before dS).
        variants.append(dataclasses.replace(base, block_m=64 * base.dq_atom_m, dq_swap_ab=False, dv_after_ds=False))
    # FA3's 80-row step (dropped by the rule unless head_dim = 64 x num_mma_warpgroups). One dQ
    # tile: two of 80 rows do not fit in shared memory beside the Q / dO rings.
    variants.append(dataclasses.replace(base, block_m=80, dq_atom_m=1, dq_swap_ab=True, dv_after_ds=True,
                                        dq_stages=1))
    if head_dim == 64:
        # FA3's D=64 step: 64 query rows per warpgroup, dQ split over rows (fits with dV after dS;
        # at D=128 the rules allow it but its tiles overflow shared memory, a compile-time check).
        nwg = base.num_mma_warpgroups
        variants.append(dataclasses.replace(base, block_m=64 * nwg, dq_atom_m=nwg, dq_swap_ab=False,
                                            dv_after_ds=True))
    if head_dim > 128:
        # Above D = 128 the consumers share a key block, two ways: split_head_dim (64 keys, dK / dV
        # split along D) or grads_transposed (48 keys per warpgroup, dK^T / dV^T: a third fewer
        # partial-dQ tiles, perf/NOTES.md twenty-seventh session), each with its ring depths
        # (those that do not fit in shared memory fail to compile and are dropped).
        split = dataclasses.replace(base, block_m=64, block_n=64, num_stages_pds=1, dq_atom_m=1, dq_swap_ab=False,
                                    dv_after_ds=False, fused_preprocess=False, split_head_dim=True,
                                    grads_transposed=False)
        variants += [dataclasses.replace(split, num_stages=s, num_stages_do=s) for s in (1, 2)]
        transposed = dataclasses.replace(split, block_n=96, split_head_dim=False, grads_transposed=True)
        # dO two deep too: fits beside a narrower value tile (a pair of tiles), not at D = 192.
        variants += [dataclasses.replace(transposed, num_stages=q, num_stages_do=d)
                     for q, d in ((1, 1), (2, 1), (2, 2))]
    return _buildable("bwd", dtype, head_dim, [pinned_share_fitted(v, base) for v in variants], value_head_dim)


def pinned_share_fitted(config: BackwardTileConfig, entry: BackwardTileConfig) -> BackwardTileConfig:
    """`config`, a variant of `entry` with another step, pinning the entry's share of its exp2
    columns: pinned_exp_columns scaled with block_m, or 0 where the step has no such columns
    (split_head_dim, grads_transposed)."""
    if not config.pinned_exp_columns:
        return config
    if config.split_head_dim or config.grads_transposed:
        return dataclasses.replace(config, pinned_exp_columns=0)
    share = max(1, config.pinned_exp_columns * config.block_m // entry.block_m)
    return dataclasses.replace(config, pinned_exp_columns=share)


def _forward_kernel(dtype_name, head_dim, problem, config, value_head_dim=None):
    from cute_flash.compile_fwd import compile_forward

    return compile_forward(dtype_name, head_dim, problem, config, value_head_dim=value_head_dim,
                           value_tile_head_dim=value_head_dim)


def _backward_runner(problem, config, head_dim, value_head_dim=None):
    """run(q, k, v, out, dout, lse, scale, grads) -> grads, the candidate's backward (on the
    pair of tiles (head_dim, value_head_dim) where a value tile is given)."""
    from cute_flash import launch_bwd, launch_fwd

    def run(q, k, v, out, dout, lse, scale, grads):
        return launch_bwd.backward_with_config(q, k, v, out, dout, lse, problem, scale, config=config, grads=grads,
                                               tile_head_dim=head_dim, value_tile_head_dim=value_head_dim)

    return run, launch_fwd


def _check_forward(kernel, dtype, head_dim, problem, value_head_dim=None):
    from cute_flash.benchmarking import reference_fp32, relative_error, run_poisoned

    worst = 0.0
    for b, n, sq, sk in CHECK_SHAPES:
        q = torch.randn(b, n, sq, head_dim, device="cuda", dtype=dtype)
        k = torch.randn(b, n, sk, head_dim, device="cuda", dtype=dtype)
        v = torch.randn(b, n, sk, value_head_dim or head_dim, device="cuda", dtype=dtype)
        scale = 1 / math.sqrt(head_dim)
        ref, _ = reference_fp32(q, k, v, problem.causal, scale)
        worst = max(worst, relative_error(run_poisoned(kernel, q, k, v, scale)[0], ref))
    return worst


def _check_backward(run, launch_fwd, dtype, head_dim, problem, value_head_dim=None):
    from cute_flash.reference import attention_reference

    worst = 0.0
    for b, n, sq, sk in CHECK_SHAPES:
        q = torch.randn(b, n, sq, head_dim, device="cuda", dtype=dtype)
        k = torch.randn(b, n, sk, head_dim, device="cuda", dtype=dtype)
        v = torch.randn(b, n, sk, value_head_dim or head_dim, device="cuda", dtype=dtype)
        scale = 1 / math.sqrt(head_dim)
        out, lse = launch_fwd.forward(q, k, v, problem, scale)
        dout = torch.randn_like(out)
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        ref_out, _ = attention_reference(*leaves, causal=problem.causal, softmax_scale=scale, dtype=torch.float32)
        ref_out.backward(dout.float())
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        for got, leaf in zip(run(q, k, v, out, dout, lse, scale, grads), leaves):
            want = leaf.grad
            err = ((got.float() - want).norm() / want.norm().clamp_min(1e-6)).item() if torch.isfinite(got).all() \
                else float("inf")
            worst = max(worst, err)
    return worst


def prepare(direction, dtype_name, head_dim, problem, config, shape, value_head_dim=None):
    """Compile and check one candidate (value_head_dim: a value tile of its own); returns
    (record, timed callable or None)."""
    dtype = DTYPES[dtype_name]
    tolerance = (2e-3 if dtype == torch.float16 else 1e-2) * (5 if direction == "bwd" else 1)
    try:
        if direction == "fwd":
            run = _forward_kernel(dtype_name, head_dim, problem, config, value_head_dim)
        else:
            run, launch_fwd = _backward_runner(problem, config, head_dim, value_head_dim)
    except Exception as exc:  # does not compile, or does not fit shared memory / registers
        return dict(status="compile_failed", detail=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"), None
    try:
        err = (_check_forward(run, dtype, head_dim, problem, value_head_dim) if direction == "fwd"
               else _check_backward(run, launch_fwd, dtype, head_dim, problem, value_head_dim))
    except Exception as exc:
        return dict(status="launch_failed", detail=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"), None
    if not err <= tolerance:
        return dict(status="incorrect", error=err), None
    b, n, s, _ = shape
    q, k = (torch.randn(b, n, s, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(b, n, s, value_head_dim or head_dim, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    # Outputs allocated once: the timed call is the kernel alone, not the poisoning fills the
    # checks use.
    if direction == "fwd":
        out = torch.empty((b, n, s, v.shape[-1]), dtype=dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return dict(status="ok", error=err), lambda: run(q, k, v, out, lse, None, *DENSE_BATCH, scale)
    out, lse = launch_fwd.forward(q, k, v, problem, scale)
    dout = torch.randn_like(out)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    return dict(status="ok", error=err), lambda: run(q, k, v, out, dout, lse, scale, grads)


def time_interleaved(calls: dict, iters: int, rounds: int = 3) -> dict:
    """Median ms per candidate, timed in rounds that visit every candidate in turn, so that
    clock and thermal drift during the run are shared rather than charged to one of them."""
    from cute_flash.benchmarking import time_ms

    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(time_ms(call, warmup=2, iters=iters))
    return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}


def _load_state(path: Path) -> dict:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run
            done[(record["key"], record["config"])] = record
    return done


def _entry_key(dtype, head_dim, causal, direction, seqlen, value_head_dim=None):
    dims = f"{head_dim}" + (f"v{value_head_dim}" if value_head_dim else "")
    return f"{dtype}/{dims}/{'causal' if causal else 'full'}/{direction}/s{seqlen}"


def merge_winners(table_entries, winners) -> list:
    """(match, config dict, measured) rows of the new file: each winner, tuned at seqlen S,
    replaces its key's entry at S, or the key's only entry if that one names no seqlen, or
    else joins the key's entries (a key the file has no entry for, e.g. a new head dim, comes
    after the others); entries this run did not tune keep what an earlier run measured for
    them."""
    groups = {}  # key -> [seqlen, config, measured] rows in file order
    for entry in table_entries:
        groups.setdefault(entry.key(), []).append([entry.seqlen, entry.config, entry.measured])
    for (*key, seqlen, value_head_dim), (best, record) in winners.items():
        group = groups.setdefault((*key, value_head_dim), [])
        replaced = _replaced_index([row[0] for row in group], seqlen)
        if replaced is None:
            group.append([seqlen, best, record])
        else:
            group[replaced][:] = [seqlen, best, record]
    out = []
    for (dtype, head_dim, causal, direction, value_head_dim), group in groups.items():
        for seqlen, config, measured in group:
            out.append((_match(dtype, head_dim, causal, direction, value_head_dim, seqlen),
                        dataclasses.asdict(config), measured))
    return out


def _replaced_index(seqlens: list, seqlen) -> int | None:
    """Which of a key's entries (their seqlens, in file order) a winner tuned at `seqlen`
    replaces: the one at that seqlen, or the key's only entry if it names none; None: the
    winner joins them (merge_winners, and tune's note on a replaced entry)."""
    if seqlen in seqlens:
        return seqlens.index(seqlen)
    return 0 if seqlens == [None] else None


def _match(dtype, head_dim, causal, direction, value_head_dim=None, seqlen=None) -> dict:
    """An entry's `match:` mapping, as the file spells it (optional keys left out)."""
    match = dict(dtype=dtype, head_dim=head_dim, causal=causal, direction=direction)
    if value_head_dim is not None:
        match["value_head_dim"] = value_head_dim
    if seqlen is not None:
        match["seqlen"] = seqlen
    return match


def _comment_key(match: dict) -> tuple:
    return tuple(sorted(match.items()))


def entry_comments(text: str) -> dict:
    """A config file's comment lines by entry: {_comment_key(match): (lines before the entry's
    `- match:`, lines inside it)}, and under None the lines after the last entry. The notes
    there say why a field was set by hand and on what evidence; a re-tune writes them back
    (render_yaml) instead of dropping them with the YAML parser. The file's first line, which
    render_yaml writes itself, is not kept."""
    comments, pending, inside = {}, [], None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  - match:"):
            key = _comment_key(yaml.safe_load(line.split("match:", 1)[1]))
            comments[key] = (pending, [])
            pending, inside = [], comments[key][1]
        elif stripped.startswith("#") and line.startswith("    ") and inside is not None:
            inside.append(stripped)
        elif stripped.startswith("#") and line.startswith("  "):
            pending.append(stripped)
            inside = None  # a comment at the entries' indent opens the next entry's notes
    comments[None] = (pending, [])
    return comments


def render_yaml(gpu: str, entries: list, tuned: dict, comments: dict | None = None, notes: dict | None = None) -> str:
    """The config file, one flow-style mapping per line so diffs stay readable. comments
    (entry_comments of the file this one replaces) go back where they were: before an entry, or
    inside it after its config line; notes (_comment_key(match) -> line) go first inside."""
    def flow(mapping):
        return "{" + ", ".join(f"{k}: {json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
                               for k, v in mapping.items()) + "}"

    comments, notes = comments or {}, notes or {}
    written = {_comment_key(match) for match, _, _ in entries}
    lines = ["# Tile configs, written by `python -m cute_flash tune` (format: cute_flash/config.py).",
             f"gpu: {gpu}", f"tuned: {flow(tuned)}", "entries:"]
    for match, config, measured in entries:
        key = _comment_key(match)
        # An entry that named no seqlen takes one when a winner replaces it (merge_winners): its
        # notes follow it.
        unnamed = _comment_key({name: value for name, value in match.items() if name != "seqlen"})
        taken_over = comments.get(unnamed) if unnamed not in written else None
        before, inside = comments.get(key) or taken_over or ([], [])
        lines += [f"  {line}" for line in before]
        lines.append(f"  - match: {flow(match)}")
        lines.append(f"    config: {flow(config)}")
        lines += [f"    {line}" for line in ([notes[key]] if key in notes else []) + inside]
        if measured:
            lines.append(f"    measured: {flow(measured)}")
    lines += [f"  {line}" for line in comments.get(None, ([], []))[0]]
    return "\n".join(lines) + "\n"


def tune(directions, dtypes, head_dims, causal_modes, shape, output: Path, state_path: Path, budget_s, iters,
         log=print, min_gain: float = 0.02, rounds: int = 3) -> int:
    """Tune and write `output`. The current entry stays unless a candidate beats it by more
    than `min_gain` (run-to-run noise on one GPU is a few per cent: a coin flip between two
    equal configs must not churn the file)."""
    untunable = sorted(set(directions) - set(TUNED_DIRECTIONS))
    if untunable:
        raise ValueError(
            f"cannot tune direction(s) {untunable}: the tuner sweeps {list(TUNED_DIRECTIONS)}; bwd_dq entries "
            "(when dQ gets its own kernel) are set by hand from perf/experiments/bwd_check.py measurements"
        )
    started = time.monotonic()
    gpu = torch.cuda.get_device_name()
    source = output if output.exists() else config_path_for_device(gpu, torch.cuda.get_device_capability())
    table = load_config_file(source)
    done = _load_state(state_path)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    out_of_time = False
    winners, notes = {}, {}
    with open(state_path, "a") as state:
        for direction, dtype, dims, causal in itertools.product(directions, dtypes, head_dims, causal_modes):
            head_dim, value_head_dim = head_dim_pair(dims)
            if value_head_dim is not None and direction not in ("fwd", "bwd"):
                log(f"{_entry_key(dtype, head_dim, causal, direction, shape[2], value_head_dim)}: a pair of tiles "
                    "is a forward or backward entry only; skipped")
                continue
            key = _entry_key(dtype, head_dim, causal, direction, shape[2], value_head_dim)
            same_key = [e for e in table.entries if e.key() == (dtype, head_dim, causal, direction, value_head_dim)]
            # A head dim without a forward entry yet gets one (its candidates need no incumbent).
            current = table.lookup(dtype, head_dim, causal, direction, seqlen=shape[2], value_head_dim=value_head_dim,
                                   required=direction != "fwd" and value_head_dim is None)
            if current is None and direction != "fwd":
                # A backward pair without an entry yet starts from the square tile's.
                current = table.lookup(dtype, head_dim, causal, direction, seqlen=shape[2])
            candidates = (forward_candidates(dtype, head_dim, value_head_dim, current) if direction == "fwd"
                          else backward_candidates(current, dtype, head_dim, value_head_dim))
            tuning_shape = (*shape[:3], head_dim) + ((value_head_dim,) if value_head_dim else ())
            results, pending = [], {}
            for config in candidates:
                config_json = json.dumps(dataclasses.asdict(config), sort_keys=True)
                record = done.get((key, config_json))
                if record is None:
                    if budget_s is not None and time.monotonic() - started > budget_s:
                        out_of_time = True
                        break
                    record, call = prepare(direction, dtype, head_dim, AttentionProblem.of(causal), config,
                                           tuning_shape[:4], value_head_dim)
                    record = dict(key=key, config=config_json, shape=list(tuning_shape), **record)
                    if call is not None:
                        pending[config_json] = call
                results.append((config, record))
            if pending and not out_of_time:
                for config_json, ms in time_interleaved(pending, iters, rounds).items():
                    next(r for c, r in results if r["config"] == config_json)["ms"] = round(ms, 4)
            for config, record in results:
                if (key, record["config"]) in done or (record["status"] == "ok" and "ms" not in record):
                    continue  # already in the state file, or not timed (budget): measure next run
                state.write(json.dumps(record) + "\n")
                state.flush()
                done[(key, record["config"])] = record
                log(f"{key} {record['config']}: {record['status']} {record.get('ms', '')} {record.get('detail', '')}")
            results = [(c, r) for c, r in results if r["status"] != "ok" or "ms" in r]
            ok = [(r["ms"], c, r) for c, r in results if r["status"] == "ok"]
            if ok and len(results) == len(candidates):
                ms, best, record = min(ok, key=lambda t: t[0])
                incumbent = [t for t in ok if t[1] == current]
                if incumbent and incumbent[0][0] <= ms * (1 + min_gain):
                    ms, best, record = incumbent[0]
                elif (replaced := _replaced_index([e.seqlen for e in same_key], shape[2])) is not None:
                    # (A winner that joins as a new entry replaced nothing: no note.) The replaced
                    # entry's notes stay (they name the evidence for its hand-set fields, which
                    # every candidate carried); this line says they were written for another tile.
                    was = dataclasses.asdict(same_key[replaced].config)
                    old = ", ".join(f"{name} {value}" for name, value in was.items() if getattr(best, name) != value)
                    notes[_comment_key(_match(dtype, head_dim, causal, direction, value_head_dim, shape[2]))] = (
                        f"# Re-tuned {time.strftime('%Y-%m-%d')} on {'x'.join(map(str, tuning_shape))} "
                        f"({ms:.4g} ms; before: {old}): notes below may describe the earlier config.")
                winners[(dtype, head_dim, causal, direction, shape[2], value_head_dim)] = (best, dict(
                    ms=ms, shape="x".join(map(str, tuning_shape)), candidates=len(candidates),
                    correct=len(ok)))
                log(f"{key}: best {ms:.3f} ms of {len(ok)} correct candidates")
            elif results:
                log(f"{key}: not finished ({len(results)}/{len(candidates)} candidates measured); entry kept")
            if out_of_time:
                break
    entries = merge_winners(table.entries, winners)
    tuned = dict(date=time.strftime("%Y-%m-%d"), gpu=gpu, torch=torch.__version__, iters=iters)
    text = render_yaml(table.gpu, entries, tuned, entry_comments(source.read_text()), notes)
    tmp = output.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    load_config_file(tmp)  # never write a file the loader would refuse
    os.replace(tmp, output)
    log(f"wrote {output} ({len(winners)} entries tuned{'; budget reached' if out_of_time else ''})")
    return 0 if not out_of_time else 3
