"""Which head dims run, and how a head dim that is not a native tile runs.

Every head dim 1 <= D <= MAX_HEAD_DIM runs forward and backward (above 128 the backward's
warpgroups split dK and dV along D: kernels/bwd_sm90.py, split_head_dim). The kernels are
compiled for native tile
head dims (those the GPU's config file names, cute_flash.config.tile_head_dim); a call of
another D runs on the smallest native tile >= D:

* D a multiple of ROW_ALIGN (16-byte rows): the kernels take the D-column tensors as they are.
  TMA loads fill the columns past D with zeros (so S = Q K^T and P V are unchanged and the
  extra output columns are zero), TMA stores clip them, and the pre- and postprocess of the
  backward read and write only the first D columns. The dQ accumulator has the tile's width.
* any other D: flash_attention pads q, k and v with zero columns to the next multiple of
  ROW_ALIGN (one copy each, torch.nn.functional.pad, so autograd slices the gradients back)
  and returns the first D columns of the output; TMA cannot describe rows that are not a
  multiple of 16 bytes. The softmax scale stays 1/sqrt(D) of the real D.

v may have a head dim of its own, Dv (O has it too). The forward runs on the native pair of
tiles serving (D, Dv) (cute_flash.config.tile_head_dims: a YAML entry with a narrower value
tile, as (192, 128), or a square tile serving both), the backward on the square tile serving
max(D, Dv); each tensor is read and written at its own width as above. A Dv that is not a
multiple of ROW_ALIGN pads v alone; float32 pads the narrower tensors to the wider (its operand
pass takes one head dim).
"""

MAX_HEAD_DIM = 256
# Public since gradients stopped at 128; every head dim has gradients now.
MAX_BACKWARD_HEAD_DIM = MAX_HEAD_DIM
ROW_ALIGN = 8  # elements of a 2-byte dtype per 16 bytes: TMA's row-stride alignment


def aligned_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a multiple of ROW_ALIGN."""
    return -(-head_dim // ROW_ALIGN) * ROW_ALIGN


def with_aligned_rows(t, width: int | None = None):
    """The torch tensor t with zero columns appended up to `width` (default: its last dim
    rounded up to ROW_ALIGN), rows TMA can describe; t itself when it has that width already.
    One copy (torch.nn.functional.pad), so autograd slices the gradient back."""
    import torch

    extra = (width or aligned_head_dim(t.shape[-1])) - t.shape[-1]
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


def require_row_aligned(head_dim: int, kernels: str) -> None:
    """The kernels' own entry points (below flash_attention) take only 16-byte rows."""
    if head_dim % ROW_ALIGN:
        raise ValueError(f"the {kernels} take head dims that are multiples of {ROW_ALIGN}, got {head_dim} "
                         "(cute_flash.flash_attention pads the others)")
