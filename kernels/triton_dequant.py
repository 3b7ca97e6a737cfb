"""Triton dequant launcher; triton is imported on the first call only (clients never import it).

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1. Bit-identical to the reference for
bf16 output, NaN included (the kernel writes the NaN bits torch's CPU cast writes, so GPU and CPU
paths put the same bytes in shared memory); fp16/fp32 outputs match except for NaN payloads.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .reference import as_block, checked_entry, nan_bits

TILE_M = 32  # divides 128


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_device(entry: str, name: str, first: torch.Tensor, **others: torch.Tensor | None) -> torch.device:
    """The device a Triton launch of `entry` runs on: `first`'s (named `name`), which must be CUDA (any under
    TRITON_INTERPRET=1) and hold each of `others` that is given."""
    device = first.device
    if device.type != "cuda" and not _interpreting():
        raise ValueError(f"{entry} needs CUDA tensors (or TRITON_INTERPRET=1), got {device}")
    for what, t in others.items():
        if t is not None and t.device != device:
            raise ValueError(f"{what} is on {t.device}, {name} on {device}")
    return device


def on_device(device: torch.device):
    """The context a launch on `device` runs in: that CUDA device current, or nothing off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _tiles(rows: int, cols: int) -> tuple[int, int, bool]:
    """(TILE_M, TILE_N, scalar_scale): tiles inside one scale block when each block side is a multiple of
    its tile side (128 columns, or a power of 2 from 16); else a per-element scale gather."""
    def side(b: int, tile: int) -> int | None:
        if b % tile == 0:
            return tile
        return b if 16 <= b < tile and b & (b - 1) == 0 else None

    tile_m, tile_n = side(rows, TILE_M), side(cols, 128)
    if tile_m and tile_n:
        return tile_m, tile_n, True
    return TILE_M, 64, False  # odd block sizes, one-row (per-channel) blocks: per-element scale gather


def _dequant_triton(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size, out: torch.Tensor | None, out_dtype: torch.dtype,
    m: int, n: int,
) -> torch.Tensor:
    """`weight_dequant_triton` on arguments `check_dequant_call` has passed; only the devices are checked here."""
    device = launch_device("weight_dequant_triton", "weight", weight, scale_inv=scale_inv, out=out)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out

    from . import _triton_kernel as K

    kind = {torch.bfloat16: K.OUT_BF16, torch.float16: K.OUT_FP16, torch.float32: K.OUT_FP32}[out_dtype]
    y = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
    scale = scale_inv.contiguous()
    rows, cols = as_block(block_size)
    tile_m, tile_n, scalar_scale = _tiles(rows, cols)
    grid = (-(-m // tile_m), -(-n // tile_n))
    with on_device(device):
        K._dequant_kernel[grid](
            weight.contiguous().view(torch.uint8),
            scale,
            y,
            m,
            n,
            scale.stride(0),
            nan_bits(torch.bfloat16)[0],
            BLOCK_M=rows,
            BLOCK_N=cols,
            TILE_M=tile_m,
            TILE_N=tile_n,
            SCALAR_SCALE=scalar_scale,
            OUT_KIND=kind,
            num_warps=4,
        )
    return out


weight_dequant_triton = checked_entry(
    _dequant_triton, "weight_dequant_triton",
    "Dequantize with the Triton kernel into `out` (allocated on weight's device if None); return it.")
