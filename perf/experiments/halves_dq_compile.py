"""CPU compile check of the dQ kernel on scaled halves (branch halves-backward, work in progress):
    python perf/experiments/halves_dq_compile.py D block_m block_n stages causal
(with CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=DIR to keep the cubin for nvdisasm)."""
import os, sys, re
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_FLASH_DISK_CACHE"] = "0"
from cutlass import Float16
from cute_flash.compile_cache import compile_kernel, fake_attention_tensor, fake_operand_scales_tensor
from cute_flash.config import SeparateDqConfig
from cute_flash.kernels.bwd_dq_sm90 import FlashBackwardDqSm90
from cute_flash.kernels.problem import AttentionProblem
import cutlass.cute as cute
from cutlass import Float32
D = int(sys.argv[1]); bm, bn, st = (int(x) for x in sys.argv[2:5]); causal = sys.argv[5] == "1"
cfg = SeparateDqConfig(min_seqlen_q=1, block_m=bm, block_n=bn, num_stages=st, num_mma_warpgroups=bm // 64)
k = FlashBackwardDqSm90(Float16, D, AttentionProblem(causal=causal), cfg, split_operands=True)
def padded():
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    return cute.runtime.make_fake_tensor(Float32, shape, stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=16)
def scales5():
    return cute.runtime.make_fake_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), 5), stride=(cute.sym_int64(), 5, 1), assumed_align=4)
ops = [fake_attention_tensor(Float16, 2 * D) for _ in range(4)]
fn = compile_kernel(k, ops[0], ops[1], ops[2], ops[3], padded(), padded(), fake_attention_tensor(Float32, D),
                    fake_attention_tensor(Float16, 2 * D), scales5(), Float32(1.0))
print("compiled", D, bm, bn, st, causal)
