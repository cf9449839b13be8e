"""Packed variable-length batches (cute_flash.varlen): the host-side checks on the CPU, the
kernels on the GPU against the float64 reference per sequence.

Length sets include empty sequences, one-row ones, tails and one long among many short;
Sq != Sk per sequence both ways. Outputs come from the caching allocator after a NaN-filled
block of the same size was freed, so a row the kernel forgot to write is NaN, not a stale
right answer. `python tests/test_varlen.py --prewarm` compiles the cases' kernels in parallel."""

import dataclasses
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cute_flash
from cute_flash.kernels.problem import AttentionProblem
from cute_flash.kernels.seqlen_pad import packed_padded_rows
from cute_flash.reference import packed_attention_reference
from cute_flash.varlen import check_packed_values, validate_packed

FP16, BF16 = torch.float16, torch.bfloat16
FWD_TOLERANCE = {FP16: 3e-3, BF16: 1.2e-2}
BWD_TOLERANCE = {FP16: 1e-2, BF16: 2.5e-2}
LSE_TOLERANCE = 2e-3

# (id, query lengths, key lengths)
LENGTH_SETS = [
    ("mixed", [300, 0, 1, 17, 129, 1000], [300, 5, 0, 1000, 64, 129]),
    ("one-long-many-short", [2000] + [3] * 12 + [64], [2000] + [7] * 12 + [200]),
    ("single", [777], [777]),
]
# (id, keyword arguments, kv heads of 4 query heads)
VARIANTS = [
    ("full", dict(), 4),
    ("causal-gqa", dict(causal=True), 2),
    ("causal-bottom-right", dict(causal=True, alignment="bottom_right"), 4),
    ("window-softcap-sink", dict(window_size=(64, 16), softcap=8.0, sink=True), 1),
]
HEAD_DIMS = [(BF16, 128), (FP16, 64)]


def packed_inputs(dtype, head_dim, kv_heads, lens_q, lens_k, sink, heads=4):
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    q = torch.randn(sum(lens_q), heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), kv_heads, head_dim, device="cuda", dtype=dtype)
    sinks = torch.randn(heads, device="cuda", dtype=torch.float32) if sink else None
    return q, k, v, cu_q, cu_k, sinks


def poison_allocator(*tensors_like):
    """Leave NaN-filled blocks in the caching allocator where the next allocations of these
    shapes will land."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in tensors_like]
    del blocks


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def reference_leaves(leaves):
    """float64 copies of the inputs that collect the reference's gradients."""
    return [t.detach().double().requires_grad_() for t in leaves]


def check_gradients(got, ref_leaves, tolerance):
    """dq, dk, dv against the reference's (already backpropagated into ref_leaves)."""
    for name, g, leaf in zip(("dq", "dk", "dv"), got, ref_leaves):
        assert rel_err(g, leaf.grad) < tolerance, f"{name}: {rel_err(g, leaf.grad):.3e}"


def check_forward(out, lse, want, want_lse, dtype):
    assert torch.isfinite(out).all(), "every row written, none NaN"
    assert rel_err(out, want) < FWD_TOLERANCE[dtype]
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf exactly where the row sees no key"
    assert (out.transpose(0, 1)[~finite] == 0).all(), "rows that see no key are exact zeros"
    if finite.any():
        assert (lse[finite].double() - want_lse[finite]).abs().max().item() < LSE_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", range(len(LENGTH_SETS)), ids=[s[0] for s in LENGTH_SETS])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("hd", range(len(HEAD_DIMS)), ids=[f"{str(d)[6:]}-D{h}" for d, h in HEAD_DIMS])
def test_forward_and_gradients(hd, variant, lengths):
    dtype, head_dim = HEAD_DIMS[hd]
    _, kwargs, kv_heads = VARIANTS[variant]
    _, lens_q, lens_k = LENGTH_SETS[lengths]
    kwargs = dict(kwargs)
    q, k, v, cu_q, cu_k, sink = packed_inputs(dtype, head_dim, kv_heads, lens_q, lens_k, kwargs.pop("sink", False))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sink is not None
                                                                else [])
    poison_allocator((q.shape, dtype), ((q.shape[1], q.shape[0]), torch.float32))
    out, lse = cute_flash.flash_attention_varlen(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                                 sink=leaves[3] if sink is not None else None, validate=True,
                                                 **kwargs)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves[:3], cu_q, cu_k,
                                                sink=ref_leaves[3] if sink is not None else None, **kwargs)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    check_forward(out, lse, want.detach(), want_lse.detach(), dtype)

    dout = torch.randn_like(out)
    # The gradients and the dQ accumulator (zeroed by the preprocess only over the rows its
    # sequences' dQ blocks cover) come from NaN-filled blocks.
    accumulator = ((1, q.shape[1], packed_padded_rows(q.shape[0], len(lens_q)), head_dim), torch.float32)
    poison_allocator(*((t.shape, t.dtype) for t in (q, k, v)), accumulator)
    got = torch.autograd.grad(out, leaves, dout)
    (want * dout.double()).sum().backward()
    for name, g, leaf in zip(("dq", "dk", "dv", "dsink"), got, ref_leaves):
        assert g.shape == leaf.shape and torch.isfinite(g).all(), name
        ref = leaf.grad
        if name == "dsink":
            # A sum of terms of either sign (see tests/test_variants.py): bounded by their size too.
            terms = torch.exp(leaf.detach().view(-1, 1) - want_lse.detach()).nan_to_num() * \
                (dout.double() * want.detach()).sum(-1).abs().transpose(0, 1)
            bound = BWD_TOLERANCE[dtype] * max(ref.norm().item(), 0.1 * terms.sum(dim=1).norm().item())
            assert (g.double() - ref).norm().item() <= bound, f"dsink: {(g.double() - ref).norm().item():.3e}"
        else:
            assert rel_err(g, ref) < BWD_TOLERANCE[dtype], f"{name}: {rel_err(g, ref):.3e}"


# (dtype, query lengths, key lengths): a packed batch whose longest sequence takes D = 128's
# S = 8192 entries (above 5792) with more than 128 query rows: tails, empty ones, Sq != Sk.
# (D = 64's entries serve every length.)
THREE_WARPGROUP_LENGTHS = [(BF16, [300, 0, 17, 200], [6000, 5, 1000, 129]), (FP16, [6000, 3, 130], [129, 40, 0])]


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", range(len(THREE_WARPGROUP_LENGTHS)), ids=["long-keys", "long-queries"])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("head_dim", [64, 96, 128], ids=lambda d: f"d{d}")
def test_three_warpgroup_tiles(entry_tiles_on_every_grid, head_dim, variant, lengths):
    """A packed batch on the entries' three-warpgroup tiles (D = 64 on 128-key blocks, D = 96 on
    112, D = 128 on 80; with a softcap some on their own key block; config.grid_fitted off;
    D = 64's narrow bands on one warpgroup), forward on poisoned outputs and gradients against
    float64."""
    from test_variants import long_sequence_tile

    dtype, lens_q, lens_k = THREE_WARPGROUP_LENGTHS[lengths]
    _, kwargs, kv_heads = VARIANTS[variant]
    kwargs = dict(kwargs)
    q, k, v, cu_q, cu_k, sink = packed_inputs(dtype, head_dim, kv_heads, lens_q, lens_k, kwargs.pop("sink", False))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    poison_allocator((q.shape, dtype), ((q.shape[1], q.shape[0]), torch.float32))
    out, lse = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                                 sink=sink, **kwargs)
    ran = entry_tiles_on_every_grid[-1]
    assert (ran.num_mma_warpgroups, ran.block_n) == long_sequence_tile(head_dim, kwargs, dtype), (
        f"the call ran {ran}, not the three-warpgroup tile (or a narrow band's)")
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, sink=None if sink is None else sink.double(),
                                                **kwargs)
    check_forward(out, lse, want.detach(), want_lse.detach(), dtype)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    (want * dout.double()).sum().backward()
    check_gradients(got, ref_leaves, BWD_TOLERANCE[dtype])


# float32 packed batches: forward and gradients on the scaled halves at every precision (cute_flash.float32),
# the float32 bar against float64.
FLOAT32_TOLERANCE = 1e-5


def float32_packed_inputs(head_dim, variant, lengths):
    """float32 packed inputs of VARIANTS[variant] on LENGTH_SETS[lengths] whose heads differ
    in magnitude: q and v take a kv head's 2^-40, 1e-5, 3e3 or 2^40, k its reciprocal, so that
    the scores keep their order (scores of order 1e4 lose float32's own accuracy in the
    exponent, whatever the kernel). (q, k, v, cu_q, cu_k, sink, the call's keyword arguments,
    lens_q, lens_k)."""
    _, kwargs, kv_heads = VARIANTS[variant]
    _, lens_q, lens_k = LENGTH_SETS[lengths]
    kwargs = dict(kwargs)
    q, k, v, cu_q, cu_k, sink = packed_inputs(torch.float32, head_dim, kv_heads, lens_q, lens_k,
                                              kwargs.pop("sink", False))
    magnitudes = torch.tensor([2.0 ** -40, 1e-5, 3e3, 2.0 ** 40], device="cuda")[:kv_heads].view(1, kv_heads, 1)
    q = q * magnitudes.repeat_interleave(4 // kv_heads, dim=1)
    return q, k / magnitudes, v * magnitudes, cu_q, cu_k, sink, kwargs, lens_q, lens_k


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("lengths", range(len(LENGTH_SETS)), ids=[s[0] for s in LENGTH_SETS])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 128])
def test_float32_forward_on_the_scaled_halves(head_dim, variant, lengths, precision):
    """Every variant and length set in float32, the heads of very different magnitudes (one
    power of two per head spans the whole packed tensor: float32_packed_inputs), into outputs
    the allocator last held NaN in; each head against float64 on its own, so that a large head
    cannot hide a small one's error."""
    q, k, v, cu_q, cu_k, sink, kwargs, lens_q, lens_k = float32_packed_inputs(head_dim, variant, lengths)
    poison_allocator(((q.shape[0], 4, head_dim), torch.float32))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        out, lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink,
                                                     return_lse=True, **kwargs)
    finally:
        torch.set_float32_matmul_precision(previous)
    want, want_lse = packed_attention_reference(q, k, v, cu_q, cu_k, sink=sink, **kwargs)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    for head in range(4):
        assert rel_err(out[:, head], want[:, head]) < FLOAT32_TOLERANCE, (head, rel_err(out[:, head], want[:, head]))
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse[finite].double() - want_lse[finite]).abs().max().item() < FLOAT32_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [136, 256])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
def test_float32_forward_in_value_chunks(head_dim, variant):
    """Above D = 128 the packed float32 forward runs P V in 128-column chunks of V and O
    (float32.value_chunks), every variant, each head against float64 (its gradients:
    test_float32_gradients_on_the_scaled_halves)."""
    q, k, v, cu_q, cu_k, sink, kwargs, lens_q, lens_k = float32_packed_inputs(head_dim, variant, 0)
    poison_allocator(((q.shape[0], 4, head_dim), torch.float32))
    out, lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink,
                                                 return_lse=True, **kwargs)
    want, want_lse = packed_attention_reference(q, k, v, cu_q, cu_k, sink=sink, **kwargs)
    for head in range(4):
        assert rel_err(out[:, head], want[:, head]) < FLOAT32_TOLERANCE, (head, rel_err(out[:, head], want[:, head]))
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - want_lse[finite]).abs().max().item() < FLOAT32_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, value_head_dim", [(64, 32), (40, 128), (100, 24)])
def test_float32_value_head_dim_of_its_own(head_dim, value_head_dim):
    """float32 packed rows whose v has a head dim of its own: padded with q and k to the wider
    (the operand pass takes one), forward and gradients against float64, O at v's width."""
    lens = [300, 1, 17, 129]
    q, k, _, cu_q, cu_k, _ = packed_inputs(torch.float32, head_dim, 2, lens, lens, False)
    v = torch.randn(k.shape[0], 2, value_head_dim, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens), max(lens), causal=True)
    assert out.shape == (q.shape[0], 4, value_head_dim)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = reference_leaves(leaves)
    want, _ = packed_attention_reference(*ref_leaves, cu_q, cu_k, causal=True)
    assert rel_err(out, want) < FLOAT32_TOLERANCE
    (want * dout.double()).sum().backward()
    for name, g, leaf in zip(("dq", "dk", "dv"), got, ref_leaves):
        assert g.shape == leaf.shape and rel_err(g, leaf.grad) < FLOAT32_TOLERANCE, name


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("lengths", range(len(LENGTH_SETS)), ids=[s[0] for s in LENGTH_SETS])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("head_dim", [8, 40, 128, 200, 256])
def test_float32_gradients_on_the_scaled_halves(head_dim, variant, lengths, precision):
    """Gradients of float32 packed batches (the scaled halves' backward at every precision, dQ
    from its own kernel over the packed grid): heads of very different magnitudes as in the
    forward's test, and an upstream gradient of its own magnitude per head; each head's dq, dk,
    dv (and the sink's gradient) against float64, into gradients the allocator last held NaN in."""
    q, k, v, cu_q, cu_k, sink, kwargs, lens_q, lens_k = float32_packed_inputs(head_dim, variant, lengths)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sink is not None
                                                                else [])
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        out = cute_flash.flash_attention_varlen(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k),
                                                sink=leaves[3] if sink is not None else None, **kwargs)
        dout = torch.randn_like(out) * torch.tensor([1e4, 1.0, 2.0 ** -30, 1e-3], device="cuda").view(1, 4, 1)
        poison_allocator(*((t.shape, t.dtype) for t in (q, k, v)))
        got = torch.autograd.grad(out, leaves, dout)
    finally:
        torch.set_float32_matmul_precision(previous)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves[:3], cu_q, cu_k,
                                                sink=ref_leaves[3] if sink is not None else None, **kwargs)
    (want * dout.double()).sum().backward()
    for name, g, leaf in zip(("dq", "dk", "dv", "dsink"), got, ref_leaves):
        assert g.shape == leaf.shape and g.dtype == torch.float32 and torch.isfinite(g).all(), name
        ref = leaf.grad
        if name == "dsink":
            terms = torch.exp(leaf.detach().view(-1, 1) - want_lse.detach()).nan_to_num() * \
                (dout.double() * want.detach()).sum(-1).abs().transpose(0, 1)
            bound = FLOAT32_TOLERANCE * max(ref.norm().item(), 0.1 * terms.sum(dim=1).norm().item())
            assert (g.double() - ref).norm().item() <= bound, f"dsink: {(g.double() - ref).norm().item():.3e}"
            continue
        for head in range(g.shape[1]):
            err = rel_err(g[:, head], ref[:, head])
            assert err < FLOAT32_TOLERANCE, f"{name} head {head}: {err:.3e}"


@pytest.mark.gpu
def test_seqused_k_and_flash_attn_names():
    """seqused_k limits each sequence's keys; flash_attn_varlen_func aligns causal bottom-right."""
    lens_q, lens_k = [5, 300, 1, 40], [100, 300, 64, 40]
    q, k, v, cu_q, cu_k, _ = packed_inputs(BF16, 128, 2, lens_q, lens_k, False)
    used = torch.tensor([50, 300, 0, 17], dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 seqused_k=used, return_lse=True)
    want, want_lse = packed_attention_reference(q, k, v, cu_q, cu_k, seqused_k=used, causal=True,
                                                alignment="bottom_right")
    check_forward(out, lse, want, want_lse, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (FP16, 96), (torch.float32, 64), (torch.float32, 128)])
def test_keys_past_seqused_k_are_never_read(dtype, head_dim):
    """The key rows past seqused_k hold NaN (a cache's free slots): masked scores, zeroed
    values in the one block that reaches them (kernels/fwd_sm90.py) and, for float32, the
    operand scales over the rows in use only (float32.keys_in_use_tops): the reference's
    result over the rows in use."""
    lens_q, lens_k = [5, 300, 1, 40, 3], [100, 300, 64, 40, 0]
    q, k, v, cu_q, cu_k, _ = packed_inputs(dtype, head_dim, 2, lens_q, lens_k, False)
    used = [50, 299, 0, 17, 0]
    for start, n, total in zip(cu_k.tolist(), used, lens_k):
        k[start + n:start + total], v[start + n:start + total] = float("nan"), float("nan")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 alignment="bottom_right", seqused_k=seqused, return_lse=True)
    want, want_lse = packed_attention_reference(q, k, v, cu_q, cu_k, seqused_k=seqused, causal=True,
                                                alignment="bottom_right")
    if dtype == torch.float32:
        assert torch.isfinite(out).all() and rel_err(out, want) < FLOAT32_TOLERANCE
    else:
        check_forward(out, lse, want, want_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (FP16, 64), (torch.float32, 64), (torch.float32, 128)])
def test_gradients_past_seqused_k(dtype, head_dim):
    """Gradients with seqused_k and NaN in the key rows past it: the dK / dV and dQ kernels
    zero those rows in shared memory before dP = dO V^T and dQ = dS K read them
    (kernels/stale_keys.py), and their own dk, dv rows are exact zeros (they never reach the
    output); float32 takes its operand scales over the rows in use (as its forward)."""
    lens_q, lens_k = [5, 300, 1, 40, 3], [100, 300, 64, 40, 0]
    q, k, v, cu_q, cu_k, _ = packed_inputs(dtype, head_dim, 2, lens_q, lens_k, False)
    used = [50, 299, 0, 17, 0]
    unused = torch.zeros(k.shape[0], dtype=torch.bool, device="cuda")
    for start, n, total in zip(cu_k.tolist(), used, lens_k):
        unused[start + n:start + total] = True
    k[unused], v[unused] = float("nan"), float("nan")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=True, alignment="bottom_right")
    out = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused, **kwargs)
    ref_leaves = reference_leaves(leaves)
    want, _ = packed_attention_reference(*ref_leaves, cu_q, cu_k, seqused_k=seqused, **kwargs)
    dout = torch.randn_like(out)
    (want * dout.double()).sum().backward()
    grads = torch.autograd.grad(out, leaves, dout)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[1][unused] == 0).all() and (grads[2][unused] == 0).all()
    check_gradients(grads, ref_leaves, 2 * FLOAT32_TOLERANCE if dtype == torch.float32 else BWD_TOLERANCE[dtype])


@pytest.mark.gpu
def test_the_direct_launch_equals_the_op():
    """Without gradients an eager call launches the kernel directly: the same result as the op
    (what torch.compile and autograd run), bitwise."""
    lens_q, lens_k = [17, 0, 300, 129], [40, 5, 300, 129]
    q, k, v, cu_q, cu_k, sink = packed_inputs(FP16, 64, 2, lens_q, lens_k, True)
    with torch.no_grad():
        out, lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=True, softcap=5.0,
                                                     sink=sink, return_lse=True)
    scale = 64 ** -0.5
    want, want_lse = torch.ops.cute_flash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, None, 300, 300, True, scale,
                                                                      -1, -1, False, 5.0, sink, False)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
def test_eager_gradients_equal_the_ops():
    """With gradients an eager call runs its own autograd Function (no op dispatch): the same
    outputs and gradients (sink's included) as the op's registered autograd, which
    torch.compile runs, bitwise in deterministic mode."""
    lens_q, lens_k = [17, 0, 300, 129], [40, 5, 300, 129]
    q, k, v, cu_q, cu_k, sink = packed_inputs(BF16, 64, 2, lens_q, lens_k, True)
    leaves = [t.requires_grad_() for t in (q, k, v, sink)]
    out, lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=True, softcap=5.0, sink=sink,
                                                 return_lse=True, deterministic=True)
    want, want_lse = torch.ops.cute_flash.flash_attention_varlen_fwd(q, k, v, cu_q, cu_k, None, 300, 300, True,
                                                                      64 ** -0.5, -1, -1, False, 5.0, sink, True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    expected = torch.autograd.grad((want, want_lse), leaves, (dout, dlse))
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, expected):
        assert torch.equal(a, b), name


def _packed_call(q, k, v, cu_q, cu_k, sink, validate, **kwargs):
    """out, lse and the gradients of one packed call (validate=True takes the general path,
    which checks the offsets' values; without it eager calls take the recorded plans)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v) + (() if sink is None else (sink,))]
    out, lse = cute_flash.flash_attention_varlen(*leaves[:3], cu_q, cu_k, 300, 300, return_lse=True,
                                                 sink=None if sink is None else leaves[3], deterministic=True,
                                                 validate=validate, **kwargs)
    torch.manual_seed(5)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    return (out, lse, *torch.autograd.grad((out, lse), leaves, (dout, dlse)))


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(causal=True),
                                    dict(window_size=(30, 7), softcap=4.0, alignment="bottom_right")],
                         ids=["causal", "window-softcap"])
def test_plans_equal_the_general_path(kwargs):
    """The eager plans (cute_flash.varlen_plan, launch_bwd's packed plans) launch what the
    general path launches: outputs and gradients bitwise equal, on the plan's first call and
    on a later one (grouped heads and a sink too)."""
    lens_q, lens_k = [17, 0, 300, 129], [40, 5, 300, 129]
    q, k, v, cu_q, cu_k, sink = packed_inputs(BF16, 64, 2, lens_q, lens_k, True)
    want = _packed_call(q, k, v, cu_q, cu_k, sink, True, **kwargs)
    for _ in range(2):
        got = _packed_call(q, k, v, cu_q, cu_k, sink, False, **kwargs)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), got, want):
            assert torch.equal(a, b), name


@pytest.mark.gpu
def test_plans_tell_apart_which_input_is_misaligned():
    """q, then k, then v 6 bytes past an aligned address, the signature otherwise the same:
    each call copies what TMA cannot read (bitwise the general path's results)."""
    lens = [17, 300, 129]
    q, k, v, cu_q, cu_k, _ = packed_inputs(FP16, 64, 4, lens, lens, False)
    for where in range(3):
        tensors = [q, k, v]
        flat = torch.empty(tensors[where].numel() + 3, dtype=FP16, device="cuda")
        flat[3:].copy_(tensors[where].flatten())
        tensors[where] = flat[3:].view(tensors[where].shape)
        want = _packed_call(*tensors, cu_q, cu_k, None, True, causal=True)
        got = _packed_call(*tensors, cu_q, cu_k, None, False, causal=True)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), f"{name} with input {where} misaligned"


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window_size=(100, 100))], ids=["causal", "window"])
def test_deterministic_backward_is_bitwise_reproducible(kwargs):
    lens = [700, 0, 33, 1000]
    q, k, v, cu_q, cu_k, _ = packed_inputs(BF16, 128, 2, lens, lens[::-1], False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens), max(lens), deterministic=True, **kwargs)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    ref_leaves = reference_leaves(leaves)
    want, _ = packed_attention_reference(*ref_leaves, cu_q, cu_k, **kwargs)
    (want * dout.double()).sum().backward()
    check_gradients(first, ref_leaves, BWD_TOLERANCE[BF16])


OTHER_HEAD_DIMS = [(BF16, 16), (FP16, 32), (BF16, 96), (FP16, 192), (BF16, 256), (FP16, 72), (BF16, 20)]


@pytest.mark.gpu
@pytest.mark.parametrize("hd", range(len(OTHER_HEAD_DIMS)), ids=[f"{str(d)[6:]}-D{h}" for d, h in OTHER_HEAD_DIMS])
def test_other_head_dims(hd):
    """Native tiles 16, 32, 96, 192, 256, a head dim on a wider tile (72) and one TMA cannot
    describe (20: padded copy): forward and gradients."""
    dtype, head_dim = OTHER_HEAD_DIMS[hd]
    lens_q, lens_k = [5, 0, 300, 77], [40, 3, 129, 200]
    q, k, v, cu_q, cu_k, _ = packed_inputs(dtype, head_dim, 2, lens_q, lens_k, False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 alignment="bottom_right", return_lse=True)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, causal=True, alignment="bottom_right")
    assert out.shape == q.shape
    check_forward(out.detach(), lse, want.detach(), want_lse.detach(), dtype)
    dout = torch.randn_like(out)
    (want * dout.double()).sum().backward()
    check_gradients(torch.autograd.grad(out, leaves, dout), ref_leaves, BWD_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_tiles_of_long_sequences_store_only_their_own_rows(entry_tiles_on_every_grid, alignment):
    """D = 16's 192-row tile stores O by rows in a packed batch: its passes once covered rows
    up to 255, and every tile but a sequence's last wrote 64 rows of values read past O's
    shared-memory tile into the next tile's rows. A window (wider than band_fitted's narrow
    bands, which run 64-row tiles) gives every tile about the same work, so the tiles finish
    in any order; each element against float64 (an O(1) value in the wrong rows is far above
    bf16's error), sequences of several tiles and a partial one."""
    lens = [700, 450, 1000, 193]
    q, k, v, cu_q, cu_k, _ = packed_inputs(BF16, 16, 4, lens, lens, False)
    out, lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens), window_size=(300, 0),
                                                 alignment=alignment, return_lse=True)
    assert entry_tiles_on_every_grid[-1].block_m == 192
    want, want_lse = packed_attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                window_size=(300, 0), alignment=alignment)
    check_forward(out, lse, want, want_lse, BF16)
    assert (out.double() - want).abs().max().item() < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, value_head_dim", [(BF16, 192, 128), (FP16, 64, 128), (BF16, 128, 20)])
def test_value_head_dim_of_its_own(dtype, head_dim, value_head_dim):
    """v (and O) of another head dim in a packed batch (DeepSeek's (192, 128) prefill; 20: a
    padded copy of v alone), GQA and bottom-right causal: forward and gradients."""
    lens_q, lens_k = [5, 0, 300, 77], [40, 3, 129, 200]
    q, k, _, cu_q, cu_k, _ = packed_inputs(dtype, head_dim, 2, lens_q, lens_k, False)
    v = torch.randn(k.shape[0], 2, value_head_dim, device="cuda", dtype=dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 alignment="bottom_right", return_lse=True)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, causal=True, alignment="bottom_right")
    assert out.shape == (q.shape[0], q.shape[1], value_head_dim)
    check_forward(out.detach(), lse, want.detach(), want_lse.detach(), dtype)
    dout = torch.randn_like(out)
    (want * dout.double()).sum().backward()
    check_gradients(torch.autograd.grad(out, leaves, dout), ref_leaves, BWD_TOLERANCE[dtype])


def paged_keys(k, v, lens_k, page_size, spare_pages, seed):
    """Packed keys k, v (total_k, Nkv, D) cut into pages of page_size rows scattered in a random
    order among spare_pages more (random rows: what no sequence owns): (k_pages, v_pages,
    block_table (B, max_pages) int32, the columns past a sequence's pages 0)."""
    generator = torch.Generator().manual_seed(seed)
    pages_of = [-(-n // page_size) for n in lens_k]
    total = sum(pages_of) + spare_pages
    order = torch.randperm(total, generator=generator).tolist()
    shape = (total, page_size, *k.shape[1:])
    k_pages, v_pages = torch.randn(shape, dtype=k.dtype, device=k.device), torch.randn(
        (total, page_size, *v.shape[1:]), dtype=v.dtype, device=v.device)
    table = torch.zeros((len(lens_k), max(max(pages_of), 1)), dtype=torch.int32)
    start, next_page = 0, 0
    for b, n in enumerate(lens_k):
        for p in range(pages_of[b]):
            page = order[next_page]
            next_page += 1
            rows = slice(start + p * page_size, start + min((p + 1) * page_size, n))
            k_pages[page, : rows.stop - rows.start], v_pages[page, : rows.stop - rows.start] = k[rows], v[rows]
            table[b, p] = page
        start += n
    return k_pages, v_pages, table.to(k.device)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("dtype, head_dim, value_head_dim", [(BF16, 128, 128), (FP16, 64, 64), (BF16, 192, 128)])
def test_keys_in_pages_equal_packed_keys(page_size, dtype, head_dim, value_head_dim):
    """A paged KV cache through block_table (chunked prefill over vLLM's layout): the same bits
    as the packed keys holding the same rows, and the reference; lengths 0, 1, tails."""
    lens_q, lens_k = [5, 0, 300, 77, 1], [40, 3, 700, 200, 0]
    q, k, _, cu_q, cu_k, _ = packed_inputs(dtype, head_dim, 2, lens_q, lens_k, False)
    v = torch.randn(k.shape[0], 2, value_head_dim, device="cuda", dtype=dtype)
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = paged_keys(k, v, lens_k, page_size, 3, seed=page_size)
    kwargs = dict(causal=True, alignment="bottom_right", return_lse=True)
    want, want_lse = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kwargs)
    out, lse = cute_flash.flash_attention_varlen(q, k_pages, v_pages, cu_q, None, max(lens_q), max(lens_k),
                                                 seqused_k=used, block_table=table, validate=True, **kwargs)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, ref_lse = packed_attention_reference(q, k, v, cu_q, cu_k, causal=True, alignment="bottom_right")
    check_forward(out, lse, ref, ref_lse, dtype)
    # flash-attn's names, and a sequence using fewer keys than its pages hold.
    fewer = used.clone()
    fewer[2] = 650
    same = cute_flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, None, max(lens_q), max(lens_k), causal=True,
                                             seqused_k=fewer, block_table=table)
    ref, _ = packed_attention_reference(q, k, v, cu_q, cu_k, seqused_k=fewer, causal=True, alignment="bottom_right")
    assert rel_err(same, ref) < FWD_TOLERANCE[dtype]


def test_keys_in_pages_host_checks():
    q = torch.randn(10, 4, 64, dtype=BF16)
    pages = torch.randn(5, 16, 2, 64, dtype=BF16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    used = torch.tensor([20, 3], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    assert validate_packed(q, pages, pages, cu_q, None, 6, 20, None, used, table) == 0.125
    cases = [
        (dict(seqused_k=None), "need seqused_k"),
        (dict(k=pages.flatten(0, 1)), "k must be pages"),
        (dict(block_table=table.long()), "block_table must be an int32"),
        (dict(block_table=table[:1]), r"shape \(2, max_pages"),
        (dict(k=torch.randn(5, 12, 2, 64, dtype=BF16), v=torch.randn(5, 12, 2, 64, dtype=BF16)), "multiple of 8"),
        (dict(k=pages.transpose(0, 1).contiguous().transpose(0, 1)), "one after the other"),
        (dict(v=pages[:, :, :1]), "same pages and heads"),
    ]
    base = dict(q=q, k=pages, v=pages, cu_seqlens_q=cu_q, cu_seqlens_k=None, max_seqlen_q=6, max_seqlen_k=20,
                softmax_scale=None, seqused_k=used, block_table=table)
    for change, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            validate_packed(**dict(base, **change))
    from cute_flash.varlen import check_paged_values

    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 7 is outside the 5 pages"):
        check_paged_values(used, torch.tensor([[0, 1], [7, 0]], dtype=torch.int32), 5, 16)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 40 is outside \[0, 32\]"):
        check_paged_values(torch.tensor([40, 3], dtype=torch.int32), table, 5, 16)
    leaf = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="no gradients"):
        cute_flash.flash_attention_varlen(leaf, pages, pages, cu_q, None, 6, 20, seqused_k=used, block_table=table)


@pytest.mark.gpu
def test_gradient_through_the_lse():
    """A loss on the returned LSE too: dlse enters delta at each token's padded row."""
    lens_q, lens_k = [3, 200, 0, 77], [50, 100, 9, 77]
    q, k, v, cu_q, cu_k, _ = packed_inputs(BF16, 128, 4, lens_q, lens_k, False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 alignment="bottom_right", return_lse=True)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, causal=True, alignment="bottom_right")
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dlse[~torch.isfinite(want_lse.detach())] = 0  # rows that see nothing: LSE -inf
    got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    finite = torch.isfinite(want_lse.detach())
    ((want * dout.double()).sum() + (want_lse[finite] * dlse.double()[finite]).sum()).backward()
    check_gradients(got, ref_leaves, BWD_TOLERANCE[BF16])


@pytest.mark.gpu
def test_matches_the_dense_path_per_sequence():
    """Each sequence's rows equal flash_attention on that sequence alone, bitwise: a packed
    tile holds the same rows of its sequence and walks the same keys (one length, so that the
    dense calls pick the packed call's tile config)."""
    lens = [384, 384, 384]  # one length: the dense calls pick the same tile config
    q, k, v, cu_q, cu_k, _ = packed_inputs(FP16, 128, 4, lens, lens, False)
    out = cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=True)
    for b, (start, end) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        dense = cute_flash.flash_attention(*(t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                           causal=True)
        assert torch.equal(out[start:end], dense[0].transpose(0, 1)), f"sequence {b}"


@pytest.mark.gpu
def test_many_sequences():
    """1100 short sequences (lengths 0 ... 40): the tile scheduler's search over the sequences
    takes three rounds; forward and gradients."""
    gen = torch.Generator().manual_seed(3)
    lens_q = torch.randint(0, 41, (1100,), generator=gen).tolist()
    lens_k = torch.randint(0, 41, (1100,), generator=gen).tolist()
    q, k, v, cu_q, cu_k, _ = packed_inputs(FP16, 64, 2, lens_q, lens_k, False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 alignment="bottom_right", return_lse=True)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, causal=True, alignment="bottom_right")
    check_forward(out, lse, want.detach(), want_lse.detach(), FP16)
    dout = torch.randn_like(out)
    (want * dout.double()).sum().backward()
    check_gradients(torch.autograd.grad(out, leaves, dout), ref_leaves, BWD_TOLERANCE[FP16])


# A group's query heads as each tile's rows (launch_fwd.packed_kernel_problem): (id, query
# lengths, key lengths, query heads, key/value heads, keyword arguments). Decode-like batches
# (at most 16 queries per sequence, any mask) and bands; groups of 2 to 16 (16 over 192 rows:
# 12 positions a tile, O's per-row stores in passes of 16 rows), empty sequences, tails.
GROUP_ROW_CASES = [
    ("decode-full-g4", [1, 1, 0, 3, 16, 1, 2], [4000, 17, 5, 1000, 300, 0, 129], 8, 2, dict()),
    ("decode-bottom-right-g8", [1, 4, 16, 0, 7], [1000, 129, 16, 40, 3], 16, 2,
     dict(causal=True, alignment="bottom_right")),
    ("decode-window-softcap-sink-g16", [16, 1, 5, 9], [700, 33, 2000, 8], 32, 2,
     dict(window_size=(100, 0), alignment="bottom_right", softcap=8.0, sink=True)),
    ("prefill-causal-g8", [300, 0, 17, 1000, 1], [300, 5, 1000, 1000, 64], 16, 2, dict(causal=True)),
    ("prefill-window-sink-g4", [777, 129, 40], [777, 300, 1], 8, 2, dict(window_size=(64, 16), sink=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(GROUP_ROW_CASES)), ids=[c[0] for c in GROUP_ROW_CASES])
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (FP16, 64), (BF16, 72), (BF16, 16)],
                         ids=["bf16-D128", "fp16-D64", "bf16-D72", "bf16-D16"])
def test_a_group_as_each_tiles_rows(dtype, head_dim, case):
    """Packed batches with grouped heads run a group's query heads as a tile's rows (their
    kernel's problem says so): forward on poisoned outputs against the float64 reference,
    every row and LSE, and the gradients (the backward's grouped kernels on that O and LSE)."""
    from cute_flash import launch_fwd

    _, lens_q, lens_k, heads, kv_heads, kwargs = GROUP_ROW_CASES[case]
    kwargs = dict(kwargs)
    q, k, v, cu_q, cu_k, sink = packed_inputs(dtype, head_dim, kv_heads, lens_q, lens_k, kwargs.pop("sink", False),
                                              heads=heads)
    problem = AttentionProblem.of(kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                                  kwargs.get("alignment", "top_left"), kwargs.get("softcap", 0.0), sink is not None,
                                  True, packed=True)
    assert launch_fwd.packed_kernel_problem(problem, q, k, max(lens_q)).row_heads == heads // kv_heads
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sink is not None
                                                                else [])
    poison_allocator((q.shape, dtype), ((q.shape[1], q.shape[0]), torch.float32))
    out, lse = cute_flash.flash_attention_varlen(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                                 sink=leaves[3] if sink is not None else None, **kwargs)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves[:3], cu_q, cu_k,
                                                sink=ref_leaves[3] if sink is not None else None, **kwargs)
    check_forward(out, lse, want.detach(), want_lse.detach(), dtype)
    with torch.no_grad():  # the direct launch (no autograd) takes the same kernel
        assert torch.equal(cute_flash.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink, **kwargs), out.detach())
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves[:3], dout)
    (want * dout.double()).sum().backward()
    check_gradients(got, ref_leaves, BWD_TOLERANCE[dtype])


def test_which_packed_calls_run_a_group_as_rows():
    """launch_fwd.packed_kernel_problem: grouped 16-bit heads with a group dividing 64, for
    decode-like batches (at most 16 queries per sequence) or a band; otherwise the problem as
    given (one query head per tile), which the backward always keeps."""
    from cute_flash.launch_fwd import packed_kernel_problem

    q, k = torch.empty(100, 32, 128, dtype=BF16, device="meta"), torch.empty(100, 8, 128, dtype=BF16, device="meta")
    full = AttentionProblem.of(False, grouped=True, packed=True)
    causal = AttentionProblem.of(True, grouped=True, packed=True)
    window = AttentionProblem.of(False, (128, 128), grouped=True, packed=True)
    rows = packed_kernel_problem(full, q, k, 16)
    assert rows.row_heads == 4 and not rows.grouped and rows.packed and full.grouped
    assert packed_kernel_problem(full, q, k, 17) is full
    assert packed_kernel_problem(causal, q, k, 4096).row_heads == 4
    assert packed_kernel_problem(window, q, k, 4096).row_heads == 4
    assert packed_kernel_problem(full, q, k[:, :1], 1).row_heads == 32
    equal_heads = AttentionProblem.of(True, packed=True)
    assert packed_kernel_problem(equal_heads, q, q, 1) is equal_heads
    assert packed_kernel_problem(causal, q, k[:, :3], 1) is causal  # (a group of 32 / 3 heads: validation refuses)
    assert packed_kernel_problem(causal, q[:, :24], k, 1) is causal  # a group of 3 does not divide 64
    assert packed_kernel_problem(causal, q.float(), k.float(), 1) is causal  # float32 runs its own kernels


# Band tiles aligned to each sequence's end (kernels/sequences.SequenceLayout.aligned_to_end):
# (name, query lengths, key lengths or None (one offsets tensor for both), kv heads, kwargs). The
# first sequence's first tile starts before row 0 (TMA's zero fill), a later one's inside the
# previous sequence's rows.
END_ALIGNED_CASES = [
    ("causal-one-offsets-tensor", [1000, 17, 0, 1, 385, 2000, 192], None, 4, dict(causal=True)),
    ("window-one-offsets-tensor", [777, 300, 5, 1500], None, 4, dict(window_size=(300, 0))),
    ("causal-bottom-right-keys-of-their-own", [700, 5, 300, 1, 1000], [1000, 5, 100, 40, 1500], 4,
     dict(causal=True, alignment="bottom_right")),
    ("window-both-sides-bottom-right", [500, 193, 64], [600, 100, 64], 4,
     dict(window_size=(64, 16), alignment="bottom_right", softcap=8.0, sink=True)),
    ("causal-gqa-rows-one-offsets-tensor", [900, 33, 1], None, 1, dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(END_ALIGNED_CASES)), ids=[c[0] for c in END_ALIGNED_CASES])
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (FP16, 64)], ids=["bf16-D128", "fp16-D64"])
def test_band_tiles_end_at_each_sequence(dtype, head_dim, case):
    """Packed band forwards under bottom-right alignment, and top-left ones whose queries and
    keys share one offsets tensor (launch_fwd.end_aligned_problem), run tiles that end at each
    sequence's last query: every row and LSE against the float64 reference, O written into a
    poisoned buffer whose rows before and after the batch stay untouched (the first tile's
    rows before row 0 are never stored), the gradients (the backward keeps the problem)."""
    from cute_flash import launch_fwd

    _, lens_q, lens_k, kv_heads, kwargs = END_ALIGNED_CASES[case]
    kwargs = dict(kwargs)
    q, k, v, cu_q, cu_k, sink = packed_inputs(dtype, head_dim, kv_heads, lens_q, lens_k or lens_q,
                                              kwargs.pop("sink", False))
    if lens_k is None:
        cu_k = cu_q  # one tensor: every sequence has as many queries as keys
    lens_k = lens_k or lens_q
    problem = cute_flash.varlen.packed_problem(q, k, kwargs.get("causal", False), *kwargs.get("window_size", (-1, -1)),
                                               kwargs.get("alignment") == "bottom_right", kwargs.get("softcap", 0.0),
                                               sink, None)
    equal = launch_fwd.equal_offsets(cu_q, cu_k, None, None)
    assert launch_fwd.packed_kernel_problem(problem, q, k, max(lens_q), equal).bottom_right
    guard = 64
    buffer = torch.full((guard + q.shape[0] + guard, q.shape[1], head_dim), float("nan"), dtype=dtype, device="cuda")
    out, lse = launch_fwd.forward_packed(q, k, v, cu_q, cu_k, None, max(lens_q), max(lens_k), problem,
                                         head_dim ** -0.5, sink=sink, out=buffer[guard:guard + q.shape[0]])
    assert buffer[:guard].isnan().all() and buffer[guard + q.shape[0]:].isnan().all()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = reference_leaves(leaves)
    ref_sink = None if sink is None else sink.double()
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, sink=ref_sink, **kwargs)
    check_forward(out, lse, want.detach(), want_lse.detach(), dtype)
    poison_allocator((q.shape, dtype), ((q.shape[1], q.shape[0]), torch.float32))
    got_out = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink, **kwargs)
    assert torch.equal(got_out.detach(), out)
    dout = torch.randn_like(got_out)
    got = torch.autograd.grad(got_out, leaves, dout)
    (want * dout.double()).sum().backward()
    check_gradients(got, ref_leaves, BWD_TOLERANCE[dtype])


def test_which_packed_calls_align_band_tiles_to_each_sequences_end(monkeypatch):
    """launch_fwd.end_aligned_problem / equal_offsets: a band's top-left problem runs as
    bottom-right (whose kernels align tiles to each sequence's end) only where the host knows
    every sequence has as many queries as keys: one offsets tensor for both, no seqused_k, no
    page table, 16-bit inputs; a full mask, grouped rows and split keys keep theirs; and the
    plans tell one offsets tensor from two with the same values apart."""
    from cute_flash import launch_fwd, varlen_plan

    q = torch.empty(100, 4, 64, dtype=BF16, device="meta")
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    other = cu.clone()
    assert launch_fwd.equal_offsets(cu, cu, None, None)
    assert not launch_fwd.equal_offsets(cu, other, None, None)
    assert not launch_fwd.equal_offsets(cu, cu, torch.tensor([40, 60], dtype=torch.int32), None)
    assert not launch_fwd.equal_offsets(cu, cu, None, torch.zeros(2, 1, dtype=torch.int32))
    causal = AttentionProblem.of(True, packed=True)
    window = AttentionProblem.of(False, (128, 0), packed=True)
    full = AttentionProblem.of(False, packed=True)
    for band in (causal, window):
        aligned = launch_fwd.packed_kernel_problem(band, q, q, 60, True)
        assert aligned.bottom_right and aligned == dataclasses.replace(band, bottom_right=True)
        assert launch_fwd.packed_kernel_problem(band, q, q, 60, False) is band
    assert launch_fwd.packed_kernel_problem(full, q, q, 60, True) is full
    right = AttentionProblem.of(True, alignment="bottom_right", packed=True)
    assert launch_fwd.packed_kernel_problem(right, q, q, 60, False) is right
    assert launch_fwd.packed_kernel_problem(causal, q.float(), q.float(), 60, True) is causal  # float32: start
    for kept in (AttentionProblem.of(True, grouped_rows=True), AttentionProblem.of(True, cached_keys=True,
                                                                                    keys_used=True)):
        assert launch_fwd.end_aligned_problem(kept, True, BF16) is kept
    monkeypatch.setattr(varlen_plan, "current_device_index", lambda: 0)
    rows = torch.empty(100, 4, 64, dtype=BF16)
    args = (rows, rows, rows, cu, cu, None, None, 60, 60, True, None, (-1, -1), "top_left", 0.0)
    assert varlen_plan.signature(*args) != varlen_plan.signature(*args[:4], other, *args[5:])


@pytest.mark.gpu
def test_offsets_that_break_the_contract_stay_inside_the_tensors():
    """Offsets past the totals, decreasing or negative: wrong rows, but no fault (the kernel
    clamps every offset into the tensors; perf/sanitize.py runs this under memcheck)."""
    q, k, v, _, _, _ = packed_inputs(BF16, 64, 4, [100, 100], [100, 100], False)
    from cute_flash import launch_fwd

    problem = AttentionProblem.of(False, packed=True)
    for cu in ([0, 150, 100], [0, 500, 9000], [-300, 50, 200]):
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        out, lse = launch_fwd.forward_packed(q, k, v, cu_t, cu_t, None, 300, 300, problem, 0.125)
        torch.cuda.synchronize()
        assert out.shape == q.shape and lse.shape == (4, 200)


def test_host_checks_name_the_argument():
    q = torch.randn(10, 4, 64, dtype=BF16)
    k = v = torch.randn(12, 2, 64, dtype=BF16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 12], dtype=torch.int32)
    assert validate_packed(q, k, v, cu_q, cu_k, 6, 6, None) == 0.125
    assert validate_packed(q, k, v[..., :32], cu_q, cu_k, 6, 6, None) == 0.125  # a value head dim of its own
    cases = [
        (dict(q=q[None]), "q must have 3 dimensions"),
        (dict(cu_seqlens_q=cu_q.long()), "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_k=cu_k[:2]), "cu_seqlens_k must have 3 entries"),
        (dict(cu_seqlens_q=cu_q[:1]), r"B \+ 1 >= 2"),
        (dict(cu_seqlens_q=cu_q.view(1, 3)), "cu_seqlens_q must be 1-D"),
        (dict(max_seqlen_q=0), "max_seqlen_q is 0"),
        (dict(max_seqlen_k=-1), "max_seqlen_k must be an int >= 0"),
        (dict(max_seqlen_k=2.5), "max_seqlen_k must be an int >= 0"),
        (dict(k=torch.randn(12, 2, 32, dtype=BF16)), "q and k must have the same head dim"),
        (dict(v=torch.randn(12, 2, 264, dtype=BF16)), "v has head dim 264"),
        (dict(v=torch.randn(11, 2, 64, dtype=BF16)), "same total tokens"),
        (dict(k=torch.randn(12, 3, 64, dtype=BF16), v=torch.randn(12, 3, 64, dtype=BF16)), "must divide"),
        (dict(seqused_k=torch.tensor([1, 2, 3], dtype=torch.int32)), "seqused_k must have 2 entries"),
    ]
    base = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=6,
                softmax_scale=None)
    for change, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            validate_packed(**dict(base, **change))


def test_packed_rows_follow_the_kernels_regions():
    """launch_bwd.packed_rows: token t of sequence b at its region's start (16-byte aligned,
    sequences.Sequence.stat_offset) plus its place in the sequence; inside the buffers even
    for offsets that break the contract."""
    from cute_flash.kernels.seqlen_pad import PACKED_ROW_ALIGN, PACKED_ROW_SLACK, packed_padded_rows
    from cute_flash.launch_bwd import packed_rows

    lens = [3, 0, 5, 129, 1]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = packed_rows(cu, sum(lens), packed_padded_rows(sum(lens), len(lens))).tolist()
    want = []
    for b, (start, n) in enumerate(zip(cu.tolist(), lens)):
        region = -(-start // PACKED_ROW_ALIGN) * PACKED_ROW_ALIGN + b * PACKED_ROW_SLACK
        want += [region + i for i in range(n)]
    assert rows == want
    for bad in ([0, 30, 10, 400], [-5, 2, 1, 9000]):
        rows = packed_rows(torch.tensor(bad, dtype=torch.int32), 10, packed_padded_rows(10, 3))
        assert rows.min() >= 0 and rows.max() < packed_padded_rows(10, 3)


def test_value_checks_with_validate():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    check_packed_values(cu, cu, 10, 10, 6, 6, torch.tensor([4, 0], dtype=torch.int32))
    cases = [
        (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), "start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 11, 10], dtype=torch.int32)), "non-decreasing"),
        (dict(max_seqlen_q=5), "more than its max_seqlen"),
        (dict(total_k=12), "end at the packed tensor's 12 rows"),
        (dict(seqused_k=torch.tensor([5, 0], dtype=torch.int32)), r"seqused_k\[0\] = 5"),
    ]
    base = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, total_q=10, total_k=10, max_seqlen_q=6, max_seqlen_k=6)
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            check_packed_values(**dict(base, **change))


def test_value_checks_are_asked_for_by_argument_or_environment(monkeypatch):
    from cute_flash.varlen import _validating

    monkeypatch.delenv("CUTE_FLASH_VALIDATE", raising=False)
    assert _validating(True) and not _validating(False)
    monkeypatch.setenv("CUTE_FLASH_VALIDATE", "1")
    assert _validating(False)
    monkeypatch.setenv("CUTE_FLASH_VALIDATE", "0")
    assert not _validating(False)


@pytest.mark.gpu
def test_value_checks_under_graph_capture_say_they_cannot_sync():
    """validate=True syncs the device to read the offsets, which capture forbids: a clear error
    before any kernel is recorded (packed batches and KV caches), not the CUDA error of a sync."""
    q, k, v, cu_q, cu_k, _ = packed_inputs(BF16, 64, 2, [5, 9], [7, 3], False)
    cache = torch.randn(2, 32, 2, 64, device="cuda", dtype=BF16)
    lengths = torch.tensor([4, 7], dtype=torch.int32, device="cuda")
    calls = [lambda: cute_flash.flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 7, validate=True),
             lambda: cute_flash.flash_attn_with_kvcache(q[:2, None], cache, cache, cache_seqlens=lengths,
                                                        validate=True)]
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), pytest.raises(RuntimeError, match="CUDA graph capture does not allow"):
            with torch.cuda.graph(graph):
                call()
        call()  # eager: checked and run


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_public_function_checks_values_before_any_kernel(how, monkeypatch):
    """validate=True (or CUTE_FLASH_VALIDATE=1) through flash_attention_varlen itself: bad
    offsets are named on the CPU, where the kernels would be refused next."""
    q, k = torch.randn(12, 4, 64, dtype=BF16), torch.randn(14, 2, 64, dtype=BF16)
    offsets_k = torch.tensor([0, 9, 14], dtype=torch.int32)
    kwargs = {"validate": True} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("CUTE_FLASH_VALIDATE", "1")
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        cute_flash.flash_attention_varlen(q, k, k, torch.tensor([0, 13, 12], dtype=torch.int32), offsets_k, 7, 9,
                                          **kwargs)
    with pytest.raises(ValueError, match="CUDA tensors"):  # good offsets: on to the kernels
        cute_flash.flash_attention_varlen(q, k, k, torch.tensor([0, 5, 12], dtype=torch.int32), offsets_k, 7, 9,
                                          **kwargs)


def test_the_public_function_traces_every_variant_on_meta():
    """flash_attention_varlen with grouped heads, Dv != D, a window, softcap and a sink through
    autograd (every gradient, the sink's included) and torch.compile(fullgraph) on meta tensors:
    the forward and backward ops' fakes."""
    meta = dict(device="meta", dtype=BF16)
    q, k = torch.empty(12, 4, 64, **meta, requires_grad=True), torch.empty(14, 2, 64, **meta, requires_grad=True)
    v = torch.empty(14, 2, 32, **meta, requires_grad=True)
    sink = torch.empty(4, device="meta", dtype=torch.float32, requires_grad=True)
    offsets = torch.empty(3, dtype=torch.int32, device="meta")
    kwargs = dict(causal=True, window_size=(8, 0), softcap=5.0, return_lse=True)
    out, lse = cute_flash.flash_attention_varlen(q, k, v, offsets, offsets, 7, 9, sink=sink, **kwargs)
    assert out.shape == (12, 4, 32) and lse.shape == (4, 12) and lse.dtype == torch.float32
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v, sink):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype

    def step(q, k, v, sink, offsets):
        out, lse = cute_flash.flash_attention_varlen(q, k, v, offsets, offsets, 7, 9, sink=sink, **kwargs)
        return out.sum(dim=-1), lse * 2

    summed, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(
        *(t.detach() for t in (q, k, v, sink)), offsets)
    assert summed.shape == (12, 4) and lse.shape == (4, 12)


def test_the_op_traces_with_fake_tensors():
    """torch.compile's view: output shapes do not depend on the offsets' values."""
    q = torch.empty(50, 8, 128, dtype=BF16, device="meta")
    k = v = torch.empty(70, 2, 128, dtype=BF16, device="meta")
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = torch.ops.cute_flash.flash_attention_varlen_fwd(q, k, v, cu, cu, None, 30, 40, True, 0.1)
    assert out.shape == (50, 8, 128) and lse.shape == (8, 50) and lse.dtype == torch.float32


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(variant=st.integers(0, len(VARIANTS) - 1), hd=st.integers(0, len(HEAD_DIMS) - 1),
       lengths=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 400)), min_size=1, max_size=40),
       scale=st.one_of(st.none(), st.floats(0.02, 0.5)), kv_heads=st.sampled_from([None, 1, 2, 4]),
       few_queries=st.booleans())
def test_fuzz_length_sets(variant, hd, lengths, scale, kv_heads, few_queries):
    """Random length sets (empty sequences, Sq != Sk both ways, up to 40 sequences; with
    few_queries at most 16 queries per sequence, the decode-like batches whose grouped heads run
    as each tile's rows) over the variants' masks and any key/value head count of the 4 query
    heads, forward and gradients against float64."""
    dtype, head_dim = HEAD_DIMS[hd]
    _, kwargs, variant_kv_heads = VARIANTS[variant]
    kv_heads = kv_heads or variant_kv_heads
    kwargs = dict(kwargs)
    lens_q, lens_k = [min(a, 16) if few_queries else a for a, _ in lengths], [b for _, b in lengths]
    if sum(lens_q) == 0:
        lens_q[0] = 1
    q, k, v, cu_q, cu_k, sink = packed_inputs(dtype, head_dim, kv_heads, lens_q, lens_k,
                                              kwargs.pop("sink", False))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = cute_flash.flash_attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink,
                                                 softmax_scale=scale, return_lse=True, **kwargs)
    ref_leaves = reference_leaves(leaves)
    want, want_lse = packed_attention_reference(*ref_leaves, cu_q, cu_k, sink=sink, softmax_scale=scale,
                                                **kwargs)
    check_forward(out, lse, want.detach(), want_lse.detach(), dtype)
    if k.shape[0]:
        dout = torch.randn_like(out)
        (want * dout.double()).sum().backward()
        for name, g, leaf in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout), ref_leaves):
            ref = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if ref.norm() > 1e-3:
                assert rel_err(g, ref) < 2 * BWD_TOLERANCE[dtype], f"{name}: {rel_err(g, ref):.3e}"
            else:
                assert g.double().norm() <= 1e-4 * dout.double().norm(), name


def prewarm():
    """Compile the GPU cases' forward kernels in parallel (python tests/test_varlen.py --prewarm)."""
    from parallel_compile import compile_in_parallel

    problems = set()
    for _, kwargs, kv_heads in VARIANTS:
        kwargs = dict(kwargs)
        sink = kwargs.pop("sink", False)
        problems.add(AttentionProblem.of(sink=sink, grouped=kv_heads != 4, packed=True, **kwargs))
    problems.add(AttentionProblem.of(True, alignment="bottom_right", grouped=True, packed=True, keys_used=True))
    problems.add(AttentionProblem.of(False, (100, 100), grouped=True, packed=True))
    jobs = [(dtype, hd, p) for dtype, hd in HEAD_DIMS for p in problems]
    compile_in_parallel(jobs, _compile)


def _compile(job):
    import time

    from parallel_compile import compile_forward_and_backward

    dtype, head_dim, problem = job
    start = time.time()
    compile_forward_and_backward(dtype, head_dim, problem,
                                 (False, True) if head_dim == 128 and problem.grouped else (False,))
    return time.time() - start


def test_a_packed_batch_counts_as_many_longest_sequences_as_its_total_holds():
    """launch_fwd.packed_grid: the grid config.grid_fitted weighs for a packed batch (the host
    does not read the lengths): total_q // max_seqlen_q sequences of max_seqlen_q rows, at least
    one, one unit per query head; K / V heads as k has them."""
    from cute_flash.launch_fwd import packed_grid

    q, k = torch.empty(10000, 32, 64, device="meta"), torch.empty(7000, 8, 64, device="meta")
    assert packed_grid(q, k, 1000) == (10, 32, 8)
    assert packed_grid(q, k, 1024) == (9, 32, 8)
    assert packed_grid(q, k, 20000) == (1, 32, 8)  # max_seqlen_q may exceed the total
    assert packed_grid(q[:0], k, 0) == (1, 32, 8)


if __name__ == "__main__" and "--prewarm" in sys.argv:
    prewarm()
