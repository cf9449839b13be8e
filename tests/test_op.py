"""The torch custom op without a GPU: its fake implementation under meta tensors and
torch.compile, and its refusal to run on the CPU."""

import pytest
import torch

import cute_flash  # noqa: F401  (registers torch.ops.cute_flash)


def meta_qkv(b=2, n=3, sq=17, sk=40, d=128, dtype=torch.float16):
    return tuple(torch.empty(b, n, s, d, device="meta", dtype=dtype) for s in (sq, sk, sk))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_shapes_on_meta(dtype):
    q, k, v = meta_qkv(dtype=dtype)
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 3, 17, 128) and out.dtype == dtype and out.device.type == "meta"
    assert lse.shape == (2, 3, 17) and lse.dtype == torch.float32


def test_empty_sequence_gives_empty_output_on_meta():
    out = cute_flash.flash_attention(*meta_qkv(sq=0, sk=5))
    assert out.shape == (2, 3, 0, 128)


def test_torch_compile_fullgraph_traces_through_the_op():
    def block(q, k, v):
        out, lse = cute_flash.flash_attention(q * 2, k, v, causal=True, return_lse=True)
        return out.sum(dim=-1), lse + 1

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    summed, lse = compiled(*meta_qkv(b=1, n=2, sq=33, sk=33, d=64))
    assert summed.shape == (1, 2, 33) and summed.dtype == torch.float16
    assert lse.shape == (1, 2, 33) and lse.dtype == torch.float32


def test_op_is_registered_with_the_dispatcher():
    q, k, v = meta_qkv()
    out, lse = torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, 0.125)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    torch.library.opcheck(torch.ops.cute_flash.flash_attention_fwd.default, (q, k, v, False, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_refuses_cpu_tensors_instead_of_falling_back():
    q, k, v = (torch.randn(1, 1, 4, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="CUDA tensors"):
        torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, 0.125)


def test_autograd_traces_through_both_ops_on_meta():
    q, k, v = (t.requires_grad_() for t in meta_qkv(b=1, n=2, sq=33, sk=50, d=64))
    out, lse = cute_flash.flash_attention(q, k, v, causal=True, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device.type == "meta"


def test_backward_op_fake_and_schema():
    q, k, v = meta_qkv()
    out, lse = torch.ops.cute_flash.flash_attention_fwd(q, k, v, False, 0.125)
    args = (torch.empty_like(out), None, q, k, v, out, lse, False, 0.125)
    dq, dk, dv = torch.ops.cute_flash.flash_attention_bwd(*args)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    torch.library.opcheck(torch.ops.cute_flash.flash_attention_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_backward_op_refuses_cpu_tensors():
    q, k, v = (torch.randn(1, 1, 4, 64, dtype=torch.float16) for _ in range(3))
    lse = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="CUDA tensors"):
        torch.ops.cute_flash.flash_attention_bwd(q, None, q, k, v, q, lse, False, 0.125)
