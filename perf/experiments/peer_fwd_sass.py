"""Our SM90 forward's main loop beside flash-attn-4's, instruction by instruction (CPU only).

    python perf/experiments/peer_fwd_sass.py [--stack .device/cute-stack.tar.xz] [--head-dim 128]
        [--dtype bfloat16] [--causal] [--window LEFT] [--value-head-dim 128] [--out DIR]

Compiles both kernels for sm_90a without a GPU: ours with the shipped YAML entry, flash-attn-4's
FlashAttentionForwardSm90 (unpacked from the device stack, where it is a benchmark peer only)
with the tile its interface picks for SM90. flash-attn-4's package imports modules that a
CPU box lacks (triton through quack's autotuner, einops); stubs stand in for them, since
compiling the forward never calls them. Writes DIR/{ours,peer}.sass (normalised) and prints
each kernel's main loops (cute_flash.sass.main_loops: length, WGMMA groups) and an opcode
histogram of the last (the unmasked main loop). perf/NOTES.md, twenty-ninth session, item 4.
--window LEFT: a causal sliding window of LEFT keys (ours: the causal entry with window_size
(LEFT, 0); flash-attn-4: its local kernel, with its SM90 tile for local masks); every main
loop's histogram is printed then (masked blocks at the diagonal and at the window's left edge).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
PEER_TILES = {16: (192, 128, True), 32: (192, 128, True), 64: (192, 128, True), 96: (192, 144, False), 128: (128, 128, True), 192: (128, 112, True),
              256: (128, 80, True)}  # D: (tile_m, tile_n, P V from registers), its interface's SM90 dispatch
PEER_PAIR_TILES = {(192, 128): (128, 128, True)}  # (D, Dv): the same, for a value head dim of its own
PEER_LOCAL_TILES = {64: (192, 128, True), 96: (192, 128, False), 192: (128, 96, True),
                    256: (128, 64, True)}  # D: its SM90 tile for local (windowed) masks, where it differs


def peer_tile(head_dim, value_head_dim):
    return PEER_TILES[head_dim] if value_head_dim == head_dim else PEER_PAIR_TILES[(head_dim, value_head_dim)]


def histogram(body):
    counts = collections.Counter()
    for line in body:
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line.strip())
        if m:
            counts[m.group(1)] += 1
    return counts


# Stubs for the modules flash-attn-4's package imports that a CPU box lacks (triton through
# quack's autotuner, einops): compiling its kernels never calls them.
PEER_STUBS = """
import math, sys, types
sys.path.insert(0, {stack!r})
auto = types.ModuleType("quack.autotuner")
auto.autotune = lambda *a, **k: (lambda f: f)
auto.AutotuneConfig = type("AutotuneConfig", (), {{"__init__": lambda self, *a, **k: None}})
sys.modules["quack.autotuner"] = auto
einops = types.ModuleType("einops"); einops.rearrange = einops.repeat = None; sys.modules["einops"] = einops
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32
dtype = {{"bfloat16": BFloat16, "float16": Float16}}[{dtype!r}]
"""


def compile_in_stack(stack: Path, dtype: str, script: str, out: Path, what: str) -> Path:
    """Run `script` (after PEER_STUBS, which also binds `dtype`) against flash-attn-4's
    package unpacked from the device stack into out/stack, with the DSL compiling for sm_90a
    and keeping cubins; return the newest cubin."""
    with tarfile.open(stack) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(("./flash_attn/", "./quack/"))]
        tar.extractall(out / "stack", members=members)
    dump = out / "peer-cubin"
    dump.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump))
    code = PEER_STUBS.format(stack=str(out / "stack"), dtype=dtype) + script
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    cubins = sorted(dump.rglob("*.cubin"), key=lambda p: p.stat().st_mtime)
    if proc.returncode != 0 or not cubins:
        raise RuntimeError(f"compiling flash-attn-4's {what} failed:\n{proc.stderr[-3000:]}")
    return cubins[-1]


def compile_peer(stack: Path, dtype: str, head_dim: int, causal: bool, out: Path, value_head_dim: int,
                 window: int | None = None, tile=None) -> Path:
    """flash-attn-4's SM90 forward; with `window` its local kernel (window (window, 0), causal
    off: its interface's form of a causal window) on `tile` (tile_m, tile_n, P V from registers)."""
    local = window is not None
    windows = [None] * 5 + ([window, 0] if local else [None, None]) + [None]
    script = f"""
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
tile_m, tile_n, rs = {tile or peer_tile(head_dim, value_head_dim)!r}
fwd = FlashAttentionForwardSm90(dtype, {head_dim}, {value_head_dim}, 1, is_causal={causal and not local},
                                is_local={local}, pack_gqa=False,
                                tile_m=tile_m, tile_n=tile_n, num_stages=2, num_threads=(tile_m // 64 + 1) * 128,
                                Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=rs)
def fake(d):
    return cute.runtime.make_fake_tensor(dtype, tuple(cute.sym_int32() for _ in range(3)) + (d,),
                                         stride=tuple(cute.sym_int32(divisibility=8) for _ in range(3)) + (1,),
                                         assumed_align=16)
lse = cute.runtime.make_fake_tensor(Float32, tuple(cute.sym_int32() for _ in range(3)),
                                    stride=(cute.sym_int32(), cute.sym_int32(), 1), assumed_align=4)
stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
cute.compile(fwd, fake({head_dim}), fake({head_dim}), fake({value_head_dim}), fake({value_head_dim}), lse, Float32(1 / math.sqrt({head_dim})),
             *{windows!r}, stream=stream, options="--enable-tvm-ffi")
"""
    return compile_in_stack(stack, dtype, script, out, "forward")


def peer_arguments(head_dims, default_head_dim: int) -> argparse.ArgumentParser:
    """The options both peer SASS comparisons take: --stack, --head-dim, --dtype, --causal, --out."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--stack", type=Path, default=ROOT / ".device" / "cute-stack.tar.xz")
    parser.add_argument("--head-dim", type=int, default=default_head_dim, choices=sorted(head_dims))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main():
    parser = peer_arguments(PEER_TILES, 128)
    parser.add_argument("--value-head-dim", type=int, default=None, help="v's head dim (default: D)")
    parser.add_argument("--window", type=int, default=None, help="a causal window of this many keys to the left")
    args = parser.parse_args()
    causal = args.causal or args.window is not None
    dv = args.value_head_dim or args.head_dim
    from cute_flash.config import default_config_dir, load_config_file
    from cute_flash.kernels.problem import AttentionProblem
    from cute_flash.sass import compile_forward_cubin, disassemble, main_loops, wgmma_groups
    from sass_fingerprint import normalise

    out = args.out or Path(tempfile.mkdtemp(prefix="peer-sass-"))
    out.mkdir(parents=True, exist_ok=True)
    table = load_config_file(default_config_dir() / "h100.yaml")
    config = table.lookup(args.dtype, args.head_dim, causal, "fwd", value_head_dim=dv)
    window = (args.window, 0) if args.window is not None else (-1, -1)
    ours = compile_forward_cubin(args.dtype, args.head_dim, AttentionProblem.of(causal, window_size=window), config,
                                 out / "ours-cubin", value_head_dim=dv, value_tile_head_dim=dv)
    tile = PEER_LOCAL_TILES.get(args.head_dim) if args.window is not None else None
    peer = compile_peer(args.stack, args.dtype, args.head_dim, causal, out, dv, args.window, tile)
    bodies = {}
    for name, cubin in (("ours", ours), ("peer", peer)):
        sass = normalise(disassemble(cubin))
        (out / f"{name}.sass").write_text(sass)
        bodies[name] = main_loops(sass)
        print(f"{name}: {len(sass.splitlines())} lines; main loops: "
              + ", ".join(f"{len(b)} instructions, {wgmma_groups(b)} WGMMA groups" for b in bodies[name]))
    loops = range(-min(len(bodies["ours"]), len(bodies["peer"])), 0) if args.window is not None else [-1]
    for loop in loops:
        print(f"\nopcodes of main loop {loop} ({config}; flash-attn-4 {tile or peer_tile(args.head_dim, dv)})")
        ours_h, peer_h = histogram(bodies["ours"][loop]), histogram(bodies["peer"][loop])
        for op in sorted(set(ours_h) | set(peer_h), key=lambda o: -(ours_h[o] + peer_h[o])):
            print(f"  {op:12s} {ours_h[op]:5d} {peer_h[op]:5d}")
        print(f"  {'total':12s} {sum(ours_h.values()):5d} {sum(peer_h.values()):5d}")
    print(f"SASS in {out}")


if __name__ == "__main__":
    sys.exit(main())
