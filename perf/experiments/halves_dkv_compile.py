"""CPU compile check of the dK / dV kernel on scaled halves (branch halves-backward, WIP):
    python perf/experiments/halves_dkv_compile.py D block_m block_n stages nwg causal"""
import os, sys, re, dataclasses
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_FLASH_DISK_CACHE"] = "0"
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cute_flash.compile_cache import (compile_kernel, fake_attention_tensor, fake_backward_scales_tensor,
                                      fake_accum_tensor, fake_count_tensor, fake_offsets_tensor, fake_semaphore_tensor,
                                      fake_stat_tensor, fake_transposed_values_tensor)
from cute_flash.config import BackwardTileConfig
from cute_flash.kernels.bwd_sm90 import CtaCounters, FlashBackwardSm90, QueryTransposes
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.sequences import PackedBatch
D = int(sys.argv[1]); bm, bn, st, nwg = (int(x) for x in sys.argv[2:6]); causal = sys.argv[6] == "1"
fields = {f.name for f in dataclasses.fields(BackwardTileConfig)}
cfg = BackwardTileConfig(block_m=bm, block_n=bn, num_stages=st, num_stages_do=st, num_stages_pds=1,
                         num_mma_warpgroups=nwg, dq_atom_m=1)
dt = Float32 if os.environ.get("X3") else Float16
T = os.environ.get("X3")
k = FlashBackwardSm90(dt, D, AttentionProblem(causal=causal), cfg, with_dq=False, split_operands=True)
op = lambda: fake_attention_tensor(dt, 2 * D)
f32 = lambda: fake_attention_tensor(Float32, D)
fn = compile_kernel(k, op(), op(), op(), f32(), op(), fake_stat_tensor(contiguous_rows=False), fake_stat_tensor(),
                    fake_stat_tensor(), fake_accum_tensor(D), CtaCounters(fake_semaphore_tensor(), fake_count_tensor(),
                    fake_count_tensor()), f32(), f32(), Float32(1.0), Int32(1), Int32(1),
                    PackedBatch(fake_offsets_tensor(), fake_offsets_tensor(), fake_offsets_tensor()),
                    QueryTransposes(*((fake_transposed_values_tensor(Float32, 2 * D),) * 2 if T else (op(), op()))), fake_backward_scales_tensor())
print("compiled", sys.argv[1:])
