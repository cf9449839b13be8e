"""cute_flash: FlashAttention for PyTorch with CuTe DSL kernels for NVIDIA Hopper (sm_90a)."""

from cute_flash import op as _op  # registers torch.ops.cute_flash.*
from cute_flash.api import flash_attention
from cute_flash.validation import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS

__version__ = "0.1.0"
__all__ = ["flash_attention", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "__version__"]
