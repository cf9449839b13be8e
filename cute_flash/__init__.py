"""cute_flash: FlashAttention for PyTorch with CuTe DSL kernels for NVIDIA Hopper (sm_90a)."""

import logging as _logging

from cute_flash import op as _op  # registers torch.ops.cute_flash.*
from cute_flash import sdpa as _sdpa
from cute_flash.api import flash_attention, flash_attn_func
from cute_flash.varlen import flash_attention_varlen, flash_attn_varlen_func
from cute_flash.kvcache import flash_attn_with_kvcache
from cute_flash.head_dims import MAX_BACKWARD_HEAD_DIM, MAX_HEAD_DIM
from cute_flash.validation import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

from cute_flash._version import __version__

__all__ = ["flash_attention", "flash_attn_func", "flash_attention_varlen", "flash_attn_varlen_func",
           "flash_attn_with_kvcache",
           "MAX_BACKWARD_HEAD_DIM", "MAX_HEAD_DIM", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "__version__"]

# Silent unless the application configures logging: INFO says which config and kernel each
# call picked (see README, "Environment variables and logging").
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
# Listed under torch.nn.attention's flash implementations (torch 2.10+); activation is the user's.
_sdpa.register()
