"""The torch op: `cute_flash::flash_attention_fwd`, a torch.library custom op.

Registering it (rather than calling the kernel from Python directly) lets torch.compile and
meta tensors trace through it via the fake implementation, and is where autograd will attach
when the backward kernel lands.
"""

import torch

from cute_flash.validation import check_kernel_device


@torch.library.custom_op("cute_flash::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_kernel_device(q)
    from cute_flash import launch  # imports the CuTe DSL, so only when a kernel is needed

    return launch.forward(q, k, v, causal, softmax_scale)


@flash_attention_fwd.register_fake
def _flash_attention_fwd_fake(q, k, v, causal, softmax_scale):
    batch, heads, seqlen_q, _ = q.shape
    out = q.new_empty((batch, heads, seqlen_q, v.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    return out, lse
