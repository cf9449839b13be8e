"""Our SM90 backward's main loop beside flash-attn-4's, instruction by instruction (CPU only).

    python perf/experiments/peer_bwd_sass.py [--stack .device/cute-stack.tar.xz] [--head-dim 64]
        [--dtype bfloat16] [--causal] [--loop -1] [--out DIR]

The backward analogue of peer_fwd_sass.py. Compiles both main kernels for sm_90a without a GPU:
ours (FlashBackwardSm90, through compile_backward_cubins) with the shipped YAML entry as
launch_bwd.derived_config makes it, and flash-attn-4's FlashAttentionBackwardSm90 (unpacked
from the device stack, where it is a benchmark peer only) with the tile its interface picks
for SM90 (_tile_size_bwd_sm90) and the arguments its _flash_attn_bwd gives cute.compile:
fakes laid out as to_cute_tensor (mark_layout_dynamic) leaves torch tensors, every size and
stride dynamic but the contiguous mode's stride, and None for the varlen, window, semaphore,
block-sparse and cu_total_m_blocks arguments. Both scripts compile flash-attn-4 through
peer_fwd_sass.compile_in_stack (stubs for the modules a CPU box lacks).

Writes DIR/{ours,peer}.sass (normalised) and prints, per kernel, its length, local-memory
traffic (LDL / STL) and main loops (cute_flash.sass.main_loops: instructions, WGMMA groups,
whether the loop masks); then, for the whole kernel and for one main loop of each (--loop, default the last: our unmasked loop,
flash-attn-4's only one, which masks every step), HGMMA counts by shape and A operand
(RS / SS), counts of chosen instruction families (barriers, dQ reductions, exp2, FFMA, F2FP,
LDS / SHFL, ...) and the opcode histogram side by side, largest differences first; last, each
loop's schedule: what runs between its GEMM issues, WGMMA waits and barriers.
"""

import collections
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "perf" / "experiments"))
from peer_fwd_sass import compile_in_stack, histogram, peer_arguments  # noqa: E402

# D: flash-attn-4's _tile_size_bwd_sm90 (tile_m, tile_n, Q / dO / PdS stages, SdP_swapAB,
# dKV_swapAB, dQ_swapAB, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, MMA warpgroups,
# dQ_single_wg), for head dims equal to the value head dim.
PEER_TILES = {
    64: dict(tile_m=128, tile_n=128, Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True, dKV_swapAB=False,
             dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=2, num_wg=2, dQ_single_wg=False),
    96: dict(tile_m=64, tile_n=128, Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True, dKV_swapAB=False,
             dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1, num_wg=2, dQ_single_wg=True),
    128: dict(tile_m=80, tile_n=128, Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True, dKV_swapAB=False,
              dQ_swapAB=True, AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1, num_wg=2, dQ_single_wg=False),
}


def peer_tile(head_dim, causal):
    tile = dict(PEER_TILES[64 if head_dim <= 64 else head_dim])  # its interface: one tile for D <= 64
    if head_dim == 128 and causal:  # causal / local: 64 rows, no dQ swap
        tile.update(tile_m=64, dQ_swapAB=False)
    return tile


# Instruction families counted over the whole kernel and one main loop: (label, regex on a line).
FAMILIES = [
    ("BAR (named)", r"^(?:@!?U?P\w+\s+)?BAR\b"),
    ("SYNCS", r"^(?:@!?U?P\w+\s+)?SYNCS\b"),
    ("WARPGROUP.ARRIVE", r"WARPGROUP\.ARRIVE"),
    ("WARPGROUP.DEPBAR", r"WARPGROUP\.DEPBAR"),
    ("WARPSYNC", r"^(?:@!?U?P\w+\s+)?WARPSYNC\b"),
    ("UBLKRED", r"^(?:@!?U?P\w+\s+)?UBLKRED\b"),
    ("UBLKCP", r"^(?:@!?U?P\w+\s+)?UBLKCP\b"),
    ("UTMALDG", r"^(?:@!?U?P\w+\s+)?UTMALDG\b"),
    ("UTMASTG", r"^(?:@!?U?P\w+\s+)?UTMASTG\b"),
    ("REDG", r"^(?:@!?U?P\w+\s+)?REDG\b"),
    ("RED", r"^(?:@!?U?P\w+\s+)?RED\b"),
    ("ATOMG", r"^(?:@!?U?P\w+\s+)?ATOMG\b"),
    ("MUFU.EX2", r"MUFU\.EX2"),
    ("FFMA", r"^(?:@!?U?P\w+\s+)?FFMA\b"),
    ("FMUL", r"^(?:@!?U?P\w+\s+)?FMUL\b"),
    ("FADD", r"^(?:@!?U?P\w+\s+)?FADD\b"),
    ("F2FP", r"^(?:@!?U?P\w+\s+)?F2FP\b"),
    ("FSEL", r"^(?:@!?U?P\w+\s+)?FSEL\b"),
    ("ISETP", r"^(?:@!?U?P\w+\s+)?ISETP\b"),
    ("R2UR", r"^(?:@!?U?P\w+\s+)?R2UR\b"),
    ("STS", r"^(?:@!?U?P\w+\s+)?STS\b"),
    ("STSM", r"^(?:@!?U?P\w+\s+)?STSM\b"),
    ("LDS", r"^(?:@!?U?P\w+\s+)?LDS\b"),
    ("LDSM", r"^(?:@!?U?P\w+\s+)?LDSM\b"),
    ("SHFL", r"^(?:@!?U?P\w+\s+)?SHFL\b"),
    ("LDL", r"^(?:@!?U?P\w+\s+)?LDL\b"),
    ("STL", r"^(?:@!?U?P\w+\s+)?STL\b"),
]


def opcode(line):
    m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line.strip())
    return m.group(1) if m else None


def hgmma_shapes(body):
    """'HGMMA.64x128x16.F32.BF16' (shape and types, without operand modifiers) -> count."""
    counts = collections.Counter()
    for line in body:
        m = re.search(r"HGMMA\.(\d+x\d+x\d+)\.(\w+)\.(\w+)", line)
        if m:
            a_regs = "RS" if re.search(r"HGMMA\.[^ ]+\s+R\d+, R\d+", line) else "SS"
            counts[f"{m.group(1)}.{m.group(2)}.{m.group(3)} {a_regs}"] += 1
    return counts


def families(body):
    return {name: sum(bool(re.search(rx, line.strip())) for line in body) for name, rx in FAMILIES}


SCHEDULE_OPS = ("MUFU", "FFMA", "FMUL", "FADD", "FSEL", "ISETP", "F2FP", "LDS", "SHFL", "STSM", "STS")


def schedule(body):
    """A loop body cut at its landmarks (a GEMM's issue (WARPGROUP.ARRIVE) and last HGMMA (gsb0),
    WGMMA waits, named barriers, mbarrier waits and arrives): [(landmark, Counter of the
    opcodes up to the next one)]. Shows which work runs under which GEMM: e.g. the exp2s
    (MUFU) between the wait for S (WGMMA wait <= 1) and the wait for dP (<= 0)."""
    segments, label, counts = [], "top", collections.Counter()
    for line in body:
        s = line.strip()
        m = re.search(r"(?:SYNCS\.PHASECHK\S*|SYNCS\.ARRIVE\S*) .*?(\[[^]]*\])", s)
        if s.startswith("WARPGROUP.ARRIVE"):
            mark = "GEMM issue"
        elif "WARPGROUP.DEPBAR" in s:
            mark = f"WGMMA wait <= {int(s.split()[-2], 16)}"
        elif "HGMMA" in s and "gsb0" in s:
            mark = "GEMM issued " + re.search(r"HGMMA\.(\d+x\d+x\d+)", s).group(1)
        elif re.search(r"\bBAR\.(SYNC|ARV)", s):
            mark = re.sub(r"\s*;$", "", re.sub(r"\.DEFER_BLOCKING", "", s))
        elif m:
            mark = ("mbarrier wait " if "PHASECHK" in s else "mbarrier arrive ") + m.group(1)
        else:
            op = opcode(s)
            if op:
                counts[op] += 1
            continue
        if mark == label and not counts:
            continue  # an mbarrier's try-wait retried inline
        segments.append((label, counts))
        label, counts = mark, collections.Counter()
    segments.append((label, counts))
    return segments


def print_schedule(name, body):
    print(f"\nschedule of {name}'s loop (instructions after each landmark; selected opcodes)")
    for label, counts in schedule(body):
        ops = " ".join(f"{op} {counts[op]}" for op in SCHEDULE_OPS if counts[op])
        print(f"  {label[:44]:44s} {sum(counts.values()):4d}  {ops}")


def compile_peer(stack: Path, dtype: str, head_dim: int, causal: bool, out: Path) -> Path:
    tile = peer_tile(head_dim, causal)
    num_wg, single = tile.pop("num_wg"), tile.pop("dQ_single_wg")
    script = f"""
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.utils import AuxData
bwd = FlashAttentionBackwardSm90(dtype, {head_dim}, {head_dim}, 1, {causal}, is_local=False, deterministic=False,
                                 num_threads={(num_wg + 1) * 128}, V_in_regs=False, dQ_single_wg={single}, **{tile!r})
def fake(dt, rank):
    # to_cute_tensor: from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=rank - 1)
    return cute.runtime.make_fake_tensor(dt, tuple(cute.sym_int32() for _ in range(rank)),
                                         stride=tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,),
                                         assumed_align=16)
q, k, v, do, dk, dv = (fake(dtype, 4) for _ in range(6))  # (b, s, h, d)
lse_log2, dpsum = fake(Float32, 3), fake(Float32, 3)     # (b, h, s_rounded)
dq_accum = fake(Float32, 3)                              # (b, h, s_rounded * d_rounded)
stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
cute.compile(bwd, q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, Float32(1 / math.sqrt({head_dim})),
             None, None, None, None,  # cu_seqlens_q / k, seqused_q / k
             None, None,              # window_size_left / right (causal: both None)
             None, None, None,        # dQ / dK / dV semaphores (not deterministic)
             AuxData(None, None), None, None, stream, options="--enable-tvm-ffi")
"""
    return compile_in_stack(stack, dtype, script, out, "backward")


def side_by_side(title, ours, peer, rows=None):
    print(f"\n{title}")
    print(f"  {'':28s} {'ours':>6s} {'peer':>6s} {'diff':>6s}")
    keys = rows or sorted(set(ours) | set(peer), key=lambda o: (-abs(ours.get(o, 0) - peer.get(o, 0)), o))
    for key in keys:
        a, b = ours.get(key, 0), peer.get(key, 0)
        if rows is None or a or b:
            print(f"  {key:28s} {a:6d} {b:6d} {a - b:+6d}")


def loop_summary(body, wgmma_groups):
    """'<instructions> instructions (<lines> lines), <n> WGMMA groups[, masked]' of a loop body."""
    count = sum(1 for line in body if opcode(line))
    # A mask writes -inf into the scores: FSEL ..., -INF or SEL ..., 0xff800000.
    masked = ", masked" if sum(bool(re.search(r"SEL .*(-INF|0xff800000)", line)) for line in body) >= 16 else ""
    return f"{count} instructions ({len(body)} lines), {wgmma_groups(body)} WGMMA groups{masked}"


def main():
    parser = peer_arguments([16, 32, *PEER_TILES], 64)  # D = 16 / 32 run its D <= 64 tile
    parser.add_argument("--loop", type=int, default=-1,
                        help="which main loop of each kernel to take apart (index; default the last)")
    args = parser.parse_args()
    from cute_flash.compile_bwd import compile_backward_cubins
    from cute_flash.config import default_config_dir, load_config_file
    from cute_flash.kernels.problem import AttentionProblem
    from cute_flash.launch_bwd import derived_config
    from cute_flash.sass import disassemble, main_loops, wgmma_groups
    from sass_fingerprint import normalise

    out = args.out or Path(tempfile.mkdtemp(prefix="peer-bwd-sass-"))
    out.mkdir(parents=True, exist_ok=True)
    problem = AttentionProblem.of(args.causal)
    entry = load_config_file(default_config_dir() / "h100.yaml").lookup(args.dtype, args.head_dim, args.causal, "bwd")
    config = derived_config(entry, args.dtype, problem, args.head_dim, args.head_dim, False)
    ours = compile_backward_cubins(args.dtype, args.head_dim, problem, config, out / "ours-cubin")["main"]
    peer = compile_peer(args.stack, args.dtype, args.head_dim, args.causal, out)
    print(f"ours: {config}\nflash-attn-4: {peer_tile(args.head_dim, args.causal)}\n")

    whole, picked = {}, {}
    for name, cubin in (("ours", ours), ("peer", peer)):
        sass = normalise(disassemble(cubin))
        (out / f"{name}.sass").write_text(sass)
        lines = sass.splitlines()
        whole[name] = lines
        found = main_loops(sass)
        picked[name] = found[args.loop]
        ldl = sum(opcode(line) == "LDL" for line in lines)
        stl = sum(opcode(line) == "STL" for line in lines)
        print(f"{name}: {len(lines)} lines, LDL {ldl}, STL {stl}; main loops:")
        for i, body in enumerate(found):
            print(f"  [{i}] {loop_summary(body, wgmma_groups)}")

    for scope, bodies in (("whole kernel", whole), (f"main loop [{args.loop}]", picked)):
        side_by_side(f"HGMMA shapes ({scope})", hgmma_shapes(bodies["ours"]), hgmma_shapes(bodies["peer"]))
        side_by_side(f"instruction families ({scope})", families(bodies["ours"]), families(bodies["peer"]),
                     rows=[name for name, _ in FAMILIES])
    ours_h, peer_h = histogram(picked["ours"]), histogram(picked["peer"])
    side_by_side(f"opcodes of main loop [{args.loop}] (largest differences first)", ours_h, peer_h)
    print(f"  {'total':28s} {sum(ours_h.values()):6d} {sum(peer_h.values()):6d}")
    for name in ("ours", "peer"):
        print_schedule(name, picked[name])
    print(f"\nSASS in {out}")


if __name__ == "__main__":
    sys.exit(main())
