"""PTX the CuTe DSL does not wrap, as DSL operations (inline asm), and the small
synchronisation patterns the kernels build from it (waits on and release-adds to counts)."""

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _ordered_s32(result, operands: list, asm: str, constraints: str):
    """One inline PTX instruction ordering memory at GPU scope on a global int32 count (with
    side effects: never moved across others or dropped)."""
    return llvm.inline_asm(result, operands, asm, constraints, has_side_effects=True, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def ld_acquire_s32(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """Load with acquire semantics at GPU scope (the dQ turn semaphore)."""
    return Int32(_ordered_s32(T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()], "ld.acquire.gpu.global.b32 $0, [$1];",
                              "=r,l"))


@dsl_user_op
def red_release_add_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None):
    """Atomic add with release semantics at GPU scope (passes the dQ turn on)."""
    _ordered_s32(None, [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
                 "red.release.gpu.global.add.s32 [$0], $1;", "l,r")


@dsl_user_op
def atomic_add_acq_rel_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> Int32:
    """Atomic add with acquire-release semantics at GPU scope; returns the value before the
    add (who brings a count to its target learns it, and sees what the others released)."""
    return Int32(_ordered_s32(T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
                              "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", "=r,l,r"))


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None):
    llvm.inline_asm(
        None, [], f"nanosleep.u32 {int(ns)};", "",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def wait_until_equal(ptr: cute.Pointer, target: Int32):
    """Spin (one thread) until *ptr == target, backing off with nanosleep between polls."""
    seen = ld_acquire_s32(ptr)
    while seen != target:
        nanosleep(64)
        seen = ld_acquire_s32(ptr)


@cute.jit
def _wait_bulk_writes_performed():
    """Every bulk copy and reduction this thread issued is performed in global memory (not
    only read from shared memory), and ordered before this thread's next release: they were
    made by the async proxy, hence the proxy fence after the wait."""
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_proxy("async.global")


@cute.jit
def count_after_bulk_writes(ptr: cute.Pointer):
    """*ptr += 1 (release, GPU scope) once every bulk copy and reduction this thread issued
    is performed in global memory, so whoever acquires the new count also sees those writes."""
    _wait_bulk_writes_performed()
    red_release_add_s32(ptr, Int32(1))


@cute.jit
def count_completing_after_bulk_writes(ptr: cute.Pointer, target: Int32) -> Int32:
    """count_after_bulk_writes with the old count read back: 1 when this add brought *ptr to
    `target` (every other adder released before it: this thread has acquired their writes),
    else 0."""
    _wait_bulk_writes_performed()
    old = atomic_add_acq_rel_s32(ptr, Int32(1))
    completed = Int32(0)
    if old + 1 == target:
        completed = Int32(1)
    return completed


@cute.jit
def count_when_all_stored(counter, barrier_id: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int],
                          is_leader, for_async_proxy: cutlass.Constexpr[bool]):
    """*counter() += 1 (release, GPU scope) once the global stores of all num_threads threads
    at named barrier barrier_id are visible at GPU scope -- with for_async_proxy also to
    async-proxy readers (TMA) of whoever acquires the count. Each thread fences its own
    stores, the barrier gathers the threads, then the leader adds. `counter` is a callable
    returning the pointer, called by the leader only, so that its address arithmetic is not
    kept live by every thread."""
    if const_expr(for_async_proxy):
        cute.arch.fence_proxy("async.global")
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
    if is_leader:
        red_release_add_s32(counter(), Int32(1))


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """gmem[0:num_bytes] += smem[0:num_bytes] (fp32), one non-tensor bulk reduction in the
    issuing thread's bulk async-group (both addresses 16-byte aligned, size a multiple of 16)."""
    llvm.inline_asm(
        None,
        [
            gmem_ptr.toint(loc=loc, ip=ip).ir_value(),
            smem_ptr.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def thread_idx_x_uncached(*, loc=None, ip=None) -> Int32:
    """%tid.x read by a volatile instruction, so the compiler re-reads it where it is used
    instead of keeping an earlier copy (and values derived from it) live across a loop."""
    value = llvm.inline_asm(
        T.i32(), [], "mov.u32 $0, %tid.x;", "=r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


@dsl_user_op
def block_idx_uncached(dim: str, *, loc=None, ip=None) -> Int32:
    """%ctaid.<dim> read by a volatile instruction (see thread_idx_x_uncached): for code
    with few registers that should not keep the block index live across a loop."""
    value = llvm.inline_asm(
        T.i32(), [], f"mov.u32 $0, %ctaid.{dim};", "=r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


@dsl_user_op
def tanh_approx(x, *, loc=None, ip=None):
    """tanh on the SFU (MUFU.TANH, max relative error ~2^-11): the softcap's one extra
    transcendental per score."""
    value = llvm.inline_asm(
        T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Float32(value)


@dsl_user_op
def pack_half2(lo, hi, dtype, *, loc=None, ip=None) -> Int32:
    """Two float32 values rounded to nearest into one 32-bit register of two 16-bit halves
    (fp16 or bf16; lo in the low half), as the WGMMA reads a register A operand: one
    cvt.rn.{f16x2,bf16x2}.f32. The DSL's own conversion of a tensor builds the bf16 pairs in
    other registers than the fragment's, and the moves between them made ptxas serialise the
    P V WGMMAs of every key block that is not 128 wide (perf/NOTES.md, twenty-ninth session)."""
    kind = {cutlass.BFloat16: "bf16x2", cutlass.Float16: "f16x2"}[dtype]
    value = llvm.inline_asm(
        T.i32(), [cutlass.Float32(hi).ir_value(loc=loc, ip=ip), cutlass.Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


# A pack_half2 pair's halves as the float32 values they stand for: one shift, one mask.
_BF16_HALF_ASM = {"low": "shl.b32 $0, $1, 16;", "high": "and.b32 $0, $1, 0xFFFF0000;"}


@dsl_user_op
def bf16_of_pair(packed, half: str, *, loc=None, ip=None):
    """The float32 value of the bf16 in `half` ("low" or "high") of a pack_half2 pair."""
    value = llvm.inline_asm(
        T.f32(), [Int32(packed).ir_value(loc=loc, ip=ip)], _BF16_HALF_ASM[half], "=f,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Float32(value)


@dsl_user_op
def bits_of_float(x, *, loc=None, ip=None) -> Int32:
    """A float32's bits as an int32 (a move, no conversion)."""
    value = llvm.inline_asm(
        T.i32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


@dsl_user_op
def float_of_bits(bits, *, loc=None, ip=None):
    """The float32 whose bits are `bits` (a move, no conversion)."""
    value = llvm.inline_asm(
        T.f32(), [Int32(bits).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Float32(value)


@dsl_user_op
def round_to_tf32(x, *, loc=None, ip=None):
    """x rounded to the nearest TF32 value (ties away from zero; the low 13 mantissa bits
    zero). The TF32 WGMMA drops those bits of a float32 operand, a truncation whose bias (every
    product pulled towards zero) tripled attention's error against rounded operands
    (perf/NOTES.md, eighteenth session)."""
    value = llvm.inline_asm(
        T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "cvt.rna.tf32.f32 $0, $1;", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Float32(value)


# 2^f on [-0.5, 0.5], relative error 2.7e-6 in float32 Horner steps (a near-minimax fit,
# perf/NOTES.md twenty-first session); the constant term first.
EXP2_FMA_COEFFS = (0.9999992847442627, 0.6931218504905701, 0.240247443318367, 0.055917542427778244,
                   0.009569993242621422)


def _ptx_f32(value: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def _exp2_fma_asm() -> str:
    c = [_ptx_f32(v) for v in EXP2_FMA_COEFFS]
    horner = "".join(f"fma.rn.f32 p, p, f, {coeff};\n" for coeff in reversed(c[:-1]))
    return (
        "{\n.reg .f32 y, t, n, f, p;\n.reg .b32 e, b;\n"
        # Below -125 (and -inf) clamps to -125, 2^-125: the smallest n whose 2^n * p stays a
        # normal number.
        "max.f32 y, $1, 0fC2FA0000;\n"
        # 1.5 * 2^23 + y rounds y to an integer n held in t's low mantissa bits.
        "add.rn.f32 t, y, 0f4B400000;\n"
        "sub.rn.f32 n, t, 0f4B400000;\n"
        "sub.rn.f32 f, y, n;\n"
        f"mov.f32 p, {c[-1]};\n"
        + horner
        # n << 23 added to p's exponent field: 2^n * 2^f (t's other bits shift out).
        + "mov.b32 e, t;\nshl.b32 e, e, 23;\nmov.b32 b, p;\nadd.s32 $0, b, e;\n}"
    )


# 2^f on [-0.5, 0.5] to 7.5e-5 relative in float32 Horner steps (a minimax fit of degree 3,
# perf/NOTES.md sixty-fifth session): far below bf16's rounding of P (2^-9) and the softcap's
# tanh.approx (2^-11 on t, ~1e-2 on exp2(c log2(e) t) at c = 30), for exp2_fma_bounded.
EXP2_BOUNDED_COEFFS = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716685295105)
_ROUNDING_MAGIC = 1.5 * 2.0 ** 23  # x + 1.5 * 2^23 rounds x (|x| < 2^22) to an integer in the low mantissa bits


def _exp2_fma_bounded_asm(offset: int) -> str:
    c = [_ptx_f32(v) for v in EXP2_BOUNDED_COEFFS]
    shifted = _ptx_f32(_ROUNDING_MAGIC - offset)
    horner = "".join(f"fma.rn.f32 p, p, f, {coeff};\n" for coeff in reversed(c[:-1]))
    return (
        "{\n.reg .f32 t, m, f, p;\n.reg .b32 e, b;\n"
        # t = 1.5 * 2^23 + n, n = round(y) for y = x * scale - offset: one rounding, exact
        # because 1.5 * 2^23 - offset is an integer.
        f"fma.rn.f32 t, $1, $2, {shifted};\n"
        # m = -(offset + n) (integers below 2^24: exact), f = y - n = x * scale + m.
        f"sub.rn.f32 m, {shifted}, t;\n"
        "fma.rn.f32 f, $1, $2, m;\n"
        f"mov.f32 p, {c[-1]};\n"
        + horner
        # n << 23 added to p's exponent field: 2^n * 2^f (t's other bits shift out).
        + "mov.b32 e, t;\nshl.b32 e, e, 23;\nmov.b32 b, p;\nadd.s32 $0, b, e;\n}"
    )


@dsl_user_op
def exp2_fma_bounded(x, scale, offset: int, *, loc=None, ip=None):
    """2^(x * scale - offset) on the FMA and integer pipes, for exponents known to lie in
    [-125, 64] (bounded scores: OnlineSoftmax with an offset, ScoreTransform.
    bounded_offset_log2), with bf16 P's accuracy (EXP2_BOUNDED_COEFFS). `offset` is a
    compile-time integer, folded with the rounding so that the exponent's product, its rounding
    and the reduced argument take three instructions: seven in all against exp2_fma's ten and
    the SFU path's two (FMUL, MUFU.EX2). No clamp (the range is the caller's), and a NaN x gives
    a finite value, as exp2_fma's clamp does."""
    value = llvm.inline_asm(
        T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip), cutlass.Float32(scale).ir_value(loc=loc, ip=ip)],
        _exp2_fma_bounded_asm(int(offset)), "=f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Float32(value)


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None):
    """2^x on the FMA and integer pipes (no SFU): ~10 instructions against MUFU.EX2's one, for
    kernels whose SFU is the busier unit (the softcap's tanh takes it once more per score,
    kernels/score_transform.py). x >= -125 exact to 2.7e-6 relative; below, and -inf, give
    2^-125, not 0: for unmasked scores only (OnlineSoftmax.step), whose row maximum makes the
    largest term 1, beside which 2^-125 for a smaller one is nothing."""
    value = llvm.inline_asm(
        T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], _exp2_fma_asm(), "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Float32(value)
