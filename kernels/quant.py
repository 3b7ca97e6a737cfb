"""Blockwise FP8 quantization in the DeepSeek-V3 checkpoint format (the inverse of weight_dequant).

Used to generate test and demo checkpoints: each block gets s = amax(|w|) / 448 so its largest value
maps to the largest finite e4m3 value. Blocks are block_size x block_size (DeepSeek) or any (rows,
columns) pair: (1, N) is compressed-tensors' per-channel scale, (M, N) its per-tensor one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertd.dtypes import E4M3_MAX
from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError

from .reference import DEFAULT_BLOCK_SIZE, FP8_DTYPE, as_block, expand_scale, scale_shape

FP8_MAX = E4M3_MAX


def quantize_fp8_blockwise(
    w: torch.Tensor, block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (float8_e4m3fn weight, float32 scale_inv) with w ~= weight.float() * scale_inv per block.

    All-zero blocks get scale 1.0 (any positive value works; 1.0 keeps the file readable).
    """
    rows, cols = as_block(block_size, name)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise UnsupportedDtypeError(f"can only quantize a float tensor, got {getattr(w, 'dtype', type(w))}",
                                    tensor=name)
    if w.dim() != 2:
        raise ShapeError(f"can only quantize a 2-D tensor, got shape {list(w.shape)}", tensor=name)
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ScaleError("cannot quantize a tensor holding inf or NaN", tensor=name)
    m, n = w.shape
    mb, nb = scale_shape(m, n, block_size)
    padded = F.pad(w.abs(), (0, nb * cols - n, 0, mb * rows - m))
    amax = padded.view(mb, rows, nb, cols).amax(dim=(1, 3))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).contiguous()
    q = (w / expand_scale(scale, m, n, block_size)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
