"""flash-attn's argument conventions, mapped onto cute_flash's for the flash-attn-style entry
points (api.flash_attn_func, varlen.flash_attn_varlen_func, kvcache.flash_attn_with_kvcache),
so that code written for flash-attn 2, 3 or 4 runs with an import change or fails loudly.

Those entry points take the tensors positionally and everything else by keyword: after the
tensors, flash-attn's versions put different arguments in the same positions (flash-attn 2:
dropout_p, then softmax_scale; flash-attn-4: qv, gather_kv_indices, then softmax_scale; its
KV cache: rotary_cos / qv before cache_seqlens), so a positional call written for one of them
would bind a value to the wrong meaning here (a dropout probability read as the softmax scale)
instead of raising.
"""

import torch

# flash-attn-4 takes a sink's logits in these dtypes as well as float32, which the kernels read.
SINK_DTYPES_TO_CAST = (torch.float16, torch.bfloat16)


def check_layout(q, k, v):
    """flash-attn's (B, S, H, D) layout: the checks whose messages name a dimension, in that
    layout's terms, before flash_attn_func transposes the tensors to cute_flash's (B, H, S, D)
    (validate then finds these true, and its messages of dims 1 and 2 would misname them).
    Non-tensors are left to validate."""
    for name, t in zip("qkv", (q, k, v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim) in flash-attn's layout, "
                             f"got {t.dim()} with shape {tuple(t.shape)}")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads (dim 2), got k={k.shape[2]}, v={v.shape[2]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same sequence length (dim 1), got k={k.shape[1]}, v={v.shape[1]}")


def window(window_size):
    """flash-attn's window_size as cute_flash's (left, right): a None side (flash-attn-4's default
    (None, None)) is -1, unbounded. Anything that is not a pair is passed on for
    check_variant to name."""
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        return tuple(-1 if side is None else side for side in window_size)
    return window_size


def sink(learnable_sink):
    """flash-attn-4's learnable_sink (N,) in float16, bfloat16 or float32, as the float32 logits
    the kernels read (the cast is differentiable: dsink comes back in the caller's dtype).
    Other dtypes and non-tensors are passed on for check_variant to name."""
    if isinstance(learnable_sink, torch.Tensor) and learnable_sink.dtype in SINK_DTYPES_TO_CAST:
        return learnable_sink.float()
    return learnable_sink


def no_dropout(dropout_p):
    """flash-attn 2's dropout_p: accepted as 0 (inference, or a model without attention
    dropout, as Hugging Face passes it), refused otherwise: cute_flash has no dropout."""
    if dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: cute_flash has no attention dropout (pass 0.0, or apply dropout "
                         "outside attention)")


def block_table(block_table, page_table):
    """flash-attn 2's block_table or flash-attn-3/4's page_table (the same (B, max_pages) int32
    table), at most one of them."""
    if page_table is None:
        return block_table
    if block_table is not None:
        raise ValueError("pass the page table as block_table or page_table, not both")
    return page_table
