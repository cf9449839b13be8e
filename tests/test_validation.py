"""Every argument error of the wrapper, on the CPU: the exception type and a message that
names the argument, what was expected and what was given."""

import math
from types import SimpleNamespace

import pytest
import torch

import cute_flash
from cute_flash import validation
from cute_flash.validation import check_kernel_device, validate


def qkv(b=1, n=2, sq=8, sk=8, d=64, dtype=torch.float16, device="cpu"):
    return tuple(torch.randn(b, n, s, d, device=device).to(dtype) for s in (sq, sk, sk))


def test_valid_inputs_give_default_scale():
    assert validate(*qkv(), None) == pytest.approx(1 / math.sqrt(64))
    assert validate(*qkv(d=128, dtype=torch.bfloat16), 0.25) == 0.25


BAD_CALLS = [
    # (id, mutate (q, k, v) -> (q, k, v), kwargs, exception, substrings of the message)
    ("q rank 3", lambda q, k, v: (q[0], k, v), {}, ValueError, ["q must have 4 dimensions", "got 3"]),
    ("k rank 5", lambda q, k, v: (q, k[None], v), {}, ValueError, ["k must have 4 dimensions", "got 5"]),
    ("batch differs", lambda q, k, v: (q, k.repeat(2, 1, 1, 1), v), {}, ValueError,
     ["same batch size", "q=1", "k=2"]),
    ("k and v heads differ", lambda q, k, v: (q, k, v[:, :1]), {}, ValueError,
     ["k and v must have the same number of heads", "k=2, v=1"]),
    ("kv heads do not divide", lambda q, k, v: (q[:, :1].expand(1, 3, 8, 64), k, v), {}, ValueError,
     ["key/value heads (2) must divide the number of query heads (3)"]),
    ("window below -1", lambda q, k, v: (q, k, v), {"window_size": (-2, 0)}, ValueError,
     ["window_size left", ">= -1", "-2"]),
    ("window not a pair", lambda q, k, v: (q, k, v), {"window_size": 5}, ValueError, ["window_size must be a pair"]),
    ("window float", lambda q, k, v: (q, k, v), {"window_size": (4, 1.5)}, ValueError, ["window_size right", "1.5"]),
    ("causal with right window", lambda q, k, v: (q, k, v), {"causal": True, "window_size": (8, 4)}, ValueError,
     ["causal=True", "right is 4"]),
    ("unknown alignment", lambda q, k, v: (q, k, v), {"alignment": "bottom-right"}, ValueError,
     ["alignment must be one of", "'bottom_right'", "'bottom-right'"]),
    ("softcap negative", lambda q, k, v: (q, k, v), {"softcap": -1.0}, ValueError, ["softcap", "-1.0"]),
    ("softcap inf", lambda q, k, v: (q, k, v), {"softcap": float("inf")}, ValueError, ["softcap", "inf"]),
    ("sink shape", lambda q, k, v: (q, k, v), {"sink": torch.zeros(3)}, ValueError, ["sink must have shape (2,)"]),
    ("sink dtype", lambda q, k, v: (q, k, v), {"sink": torch.zeros(2, dtype=torch.float16)}, TypeError,
     ["sink must be float32", "float16"]),
    ("sink device", lambda q, k, v: (q, k, v), {"sink": torch.zeros(2, device="meta")}, ValueError,
     ["sink must be on q's device"]),
    ("q and k head dims differ", lambda q, k, v: (q, torch.cat([k, k], -1), v), {}, ValueError,
     ["q and k must have the same head dim", "q=64, k=128"]),
    ("value head dim 0", lambda q, k, v: (q, k, v[..., :0]), {}, ValueError,
     ["v has head dim 0", "supported head dims: 1 to 256"]),
    ("value head dim 320", lambda q, k, v: (q, k, torch.cat([v] * 5, -1)), {}, ValueError,
     ["v has head dim 320", "supported head dims: 1 to 256"]),
    ("k/v seqlen differ", lambda q, k, v: (q, k, v[:, :, :5]), {}, ValueError,
     ["same sequence length", "k=8", "v=5"]),
    ("float32 q alone", lambda q, k, v: (q.float(), k, v), {}, TypeError, ["same dtype", "q=float32", "k=float16"]),
    ("float64 v", lambda q, k, v: (q, k, v.double()), {}, TypeError, ["v has dtype float64", "float16, bfloat16, float32"]),
    ("int", lambda q, k, v: (q, k.to(torch.int32), v), {}, TypeError, ["k has dtype int32"]),
    ("mixed dtypes", lambda q, k, v: (q, k.bfloat16(), v), {}, TypeError,
     ["same dtype", "q=float16", "k=bfloat16"]),
    ("head dim 0", lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), {}, ValueError,
     ["head dim 0", "supported head dims: 1 to 256"]),
    ("head dim 264", lambda q, k, v: tuple(torch.cat([t, t, t, t, t[..., :8]], -1) for t in (q, k, v)), {},
     ValueError, ["head dim 264", "supported head dims: 1 to 256"]),
    ("last dim not contiguous", lambda q, k, v: (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v),
     {}, ValueError, ["k must be contiguous in its last dimension"]),
    ("different devices", lambda q, k, v: (q, k.to("meta"), v), {}, ValueError,
     ["same device", "q=cpu", "k=meta"]),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v), {}, TypeError, ["q must be a torch.Tensor", "list"]),
    ("scale 0", lambda q, k, v: (q, k, v), {"softmax_scale": 0.0}, ValueError, ["softmax_scale", "positive finite", "0.0"]),
    ("scale negative", lambda q, k, v: (q, k, v), {"softmax_scale": -1.0}, ValueError, ["softmax_scale", "-1.0"]),
    ("scale nan", lambda q, k, v: (q, k, v), {"softmax_scale": float("nan")}, ValueError, ["softmax_scale", "nan"]),
    ("scale inf", lambda q, k, v: (q, k, v), {"softmax_scale": float("inf")}, ValueError, ["softmax_scale", "inf"]),
    ("scale string", lambda q, k, v: (q, k, v), {"softmax_scale": "0.1"}, TypeError, ["softmax_scale", "'0.1'"]),
    ("scale bool", lambda q, k, v: (q, k, v), {"softmax_scale": True}, TypeError, ["softmax_scale", "True"]),
]


@pytest.mark.parametrize("mutate, kwargs, exc, words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_clear_error(mutate, kwargs, exc, words):
    q, k, v = mutate(*qkv())
    with pytest.raises(exc) as info:
        cute_flash.flash_attention(q, k, v, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_cpu_tensors_are_rejected_on_the_kernel_path():
    with pytest.raises(ValueError, match="must be CUDA tensors.*got device 'cpu'"):
        cute_flash.flash_attention(*qkv())


def test_a_value_head_dim_of_its_own_is_valid():
    q, k, v = qkv(d=192)
    assert validate(q, k, v[..., :128], None) == pytest.approx(1 / math.sqrt(192))  # the scale is q's
    assert validate(q[..., :64], k[..., :64], v, None) == pytest.approx(1 / 8)


def test_odd_but_valid_strides_pass_validation():
    # A (B, S, N, D) tensor viewed as (B, N, S, D) and a slice along S are valid inputs.
    base = torch.randn(2, 16, 3, 64).half()
    view = base.transpose(1, 2)
    assert validate(view, view, view, None) > 0
    sliced = torch.randn(2, 3, 32, 64).half()[:, :, 5:20]
    assert validate(sliced, sliced, sliced, None) > 0


def _fake_cuda(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return SimpleNamespace(device=torch.device("cuda:0"))


def test_non_hopper_gpu_is_named(monkeypatch):
    tensor = _fake_cuda(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"Hopper.*found NVIDIA A100-SXM4-80GB with compute capability 8\.0"):
        check_kernel_device(tensor)


def test_hopper_gpu_is_accepted(monkeypatch):
    check_kernel_device(_fake_cuda(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3"))


def test_supported_lists_are_public():
    assert cute_flash.SUPPORTED_HEAD_DIMS == validation.SUPPORTED_HEAD_DIMS == range(1, cute_flash.MAX_HEAD_DIM + 1)
    assert cute_flash.MAX_HEAD_DIM == cute_flash.MAX_BACKWARD_HEAD_DIM == 256
    assert cute_flash.SUPPORTED_DTYPES == (torch.float16, torch.bfloat16)


# Fuzzing the validation layer: any combination of shapes, dtypes, strides and scales either
# passes (and then satisfies every documented rule) or raises ValueError/TypeError; nothing
# else escapes and nothing invalid passes.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int8]


@st.composite
def _tensor(draw):
    rank = draw(st.sampled_from([4, 4, 4, 3, 5]))
    shape = [draw(st.integers(0, 3)) for _ in range(rank - 1)] + [draw(st.sampled_from([32, 40, 64, 128, 256]))]
    t = torch.zeros(shape, dtype=draw(st.sampled_from(_DTYPES)))
    if rank >= 2 and draw(st.booleans()):
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    return t


@st.composite
def _qkv(draw):
    """(q, k, v, valid): a triple drawn from one shape and dtype (grouped heads, Sq != Sk, a
    value head dim of its own), each tensor at times drawn on its own (_tensor) or with its
    last dim strided, so that valid triples are common and each rule is broken alone too;
    valid: the triple keeps every rule (validate must accept it)."""
    dtype = draw(st.sampled_from(_DTYPES))
    batch, seqlen_q, seqlen_k, kv_heads = (draw(st.integers(0, 3)) for _ in range(4))
    group = draw(st.integers(1, 3))
    head_dims = st.sampled_from([32, 40, 64, 128, 256])
    head_dim, value_head_dim = draw(head_dims), draw(head_dims)
    shapes = ((batch, kv_heads * group, seqlen_q, head_dim), (batch, kv_heads, seqlen_k, head_dim),
              (batch, kv_heads, seqlen_k, value_head_dim))
    tensors, valid = [], dtype in (torch.float16, torch.bfloat16, torch.float32) and kv_heads > 0
    for shape in shapes:
        if draw(st.integers(0, 5)) == 0:
            tensors.append(draw(_tensor()))
            valid = False
            continue
        t = torch.zeros(shape, dtype=dtype)
        if draw(st.integers(0, 5)) == 0:
            t = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
            valid = valid and t.numel() == 0
        tensors.append(t)
    return (*tensors, valid)


def _valid_scale(scale) -> bool:
    return scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                             and math.isfinite(scale) and scale > 0)


@settings(max_examples=300, deadline=None)
@given(qkv_valid=_qkv(),
       scale=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2),
                       st.just("0.1"), st.booleans()))
def test_validation_fuzzed(qkv_valid, scale):
    q, k, v, valid = qkv_valid
    try:
        resolved = validate(q, k, v, scale)
    except (ValueError, TypeError):
        assert not (valid and _valid_scale(scale)), "a valid call was refused"
        return
    assert q.dim() == k.dim() == v.dim() == 4
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
    # v (and out) may have a head dim of its own.
    assert 1 <= q.shape[3] == k.shape[3] <= 256 and 1 <= v.shape[3] <= 256 and k.shape[2] == v.shape[2]
    assert all(t.numel() == 0 or t.stride(-1) == 1 for t in (q, k, v))
    assert math.isfinite(resolved) and resolved > 0
    assert _valid_scale(scale)


def test_problems_are_canonical():
    """Equal masks share one problem (and kernels): a right window of 0 is causal, and
    without a bound the alignment does not matter."""
    from cute_flash.kernels.problem import AttentionProblem

    assert AttentionProblem.of(False, (16, 0)) == AttentionProblem.of(True, (16, -1))
    assert AttentionProblem.of(False, (-1, -1), "bottom_right") == AttentionProblem.of(False)
    assert AttentionProblem.of(True, alignment="bottom_right").bottom_right
    assert AttentionProblem.of(True) is AttentionProblem.of(1)
    problem = AttentionProblem.of(False, (100, 7), "bottom_right", 5.0, True, True)
    assert (problem.left, problem.right, problem.softcap, problem.sink, problem.grouped) == (100, 7, 5.0, True, True)
    with pytest.raises(ValueError, match="window_left"):
        AttentionProblem(window_left=-3)
