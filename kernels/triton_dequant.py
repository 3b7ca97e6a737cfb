"""Triton dequant launchers; triton is imported on the first call only (clients never import it).

Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1. Bit-identical to the reference for
bf16 output, NaN included (the kernel writes the NaN bits torch's CPU cast writes, so GPU and CPU
paths put the same bytes in shared memory); fp16/fp32 outputs match except for NaN payloads.

`weight_dequant_triton` takes one [M, N] weight, `weight_dequant_batched_triton` a stack [E, M, N] of
same-shaped experts in one launch. On GPUs with fp8 conversion (compute capability 8.9+) the kernel decodes
with it; elsewhere, under the interpreter, or with EXPERTD_TRITON_NATIVE=0, with integer ops (same bits).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import torch

from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError

from .reference import (
    DEFAULT_BLOCK_SIZE,
    FP8_DTYPE,
    SCALE_DTYPE,
    as_block,
    check_out_dtype,
    checked_entry,
    nan_bits,
    scale_shape,
)

TILE_ELEMS = 128 * 128  # elements per program: a whole DeepSeek block
MIN_PROGRAMS = 1024  # ~8 per SM of an H100
WHOLE = 1 << 30  # the block side passed for a block that covers its whole dimension
NATIVE_ENV = "EXPERTD_TRITON_NATIVE"  # "0": decode and round with integer ops even where the GPU converts


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


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def conversions(device: torch.device) -> tuple[bool, bool]:
    """(fp8 -> float32 by the hardware, float32 -> bf16 by the hardware) for a launch on `device`: both need
    a CUDA GPU, not the interpreter, and EXPERTD_TRITON_NATIVE unset or not "0"; fp8 also needs sm_89+."""
    if device.type != "cuda" or _interpreting() or os.environ.get(NATIVE_ENV, "1") == "0":
        return False, False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9), True


class Tiling(NamedTuple):
    tile_m: int
    tile_n: int
    num_warps: int


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def tiling(m: int, n: int, experts: int = 1) -> Tiling:
    """The tile of an [m, n] weight: 128 columns (fewer for narrow weights) by as many rows as make
    TILE_ELEMS, halved (down to 32 rows) while a launch would have fewer than MIN_PROGRAMS programs, so
    that every SM gets several and the last wave is short. 8-byte loads and 16-byte stores per thread."""
    tile_n = min(128, max(16, _pow2_at_least(n)))
    tile_m = min(max(1, TILE_ELEMS // tile_n), _pow2_at_least(m))
    while tile_m > 32 and experts * -(-m // tile_m) * -(-n // tile_n) < MIN_PROGRAMS:
        tile_m //= 2
    while tile_m > 1 and tile_m * n >= 1 << 31:  # offsets within a tile are int32
        tile_m //= 2
    return Tiling(tile_m, tile_n, 8 if tile_m * tile_n >= TILE_ELEMS else 4)


def _scale_plan(m: int, n: int, rows: int, cols: int, tile: Tiling) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, SCALE) for the kernel: a block that covers a whole dimension becomes WHOLE (one
    compiled kernel serves every per-tensor and per-channel shape); SCALE is what one tile meets: 0 one scale
    (the tile inside one block), 1 one per row (its columns inside one block column: per-channel scales),
    2 one per column, 3 a gather per element (blocks smaller than the tile, or not powers of two)."""
    bm = rows if rows < m else WHOLE
    bn = cols if cols < n else WHOLE
    along_m = bm % tile.tile_m == 0  # each tile's rows lie inside one block row
    along_n = bn % tile.tile_n == 0
    mode = {(True, True): 0, (False, True): 1, (True, False): 2, (False, False): 3}[(along_m, along_n)]
    return bm, bn, mode


def launch_dequant(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, experts: int, m: int, n: int,
                   block_size, *, native: bool = True, tile: Tiling | None = None) -> None:
    """Dequantize x (fp8 or uint8, [experts, m, n] contiguous) with scale (float32 [experts, sr, sc]
    contiguous) into out (contiguous, same shape), arguments unchecked. native=False decodes and rounds
    with integer ops even where the GPU converts; `tile` overrides `tiling` (both for benchmarks)."""
    if experts * m * n == 0:
        return
    from . import _triton_kernel as K

    rows, cols = as_block(block_size)
    tile = tile or tiling(m, n, experts)
    bm, bn, mode = _scale_plan(m, n, rows, cols, tile)
    fp8_cvt, bf16_cvt = conversions(out.device) if native else (False, False)
    kind = {torch.bfloat16: K.OUT_BF16, torch.float16: K.OUT_FP16, torch.float32: K.OUT_FP32}[out.dtype]
    tiles_m, tiles_n = -(-m // tile.tile_m), -(-n // tile.tile_n)
    with on_device(out.device):
        K._dequant_kernel[(experts * tiles_m * tiles_n,)](
            x.view(torch.uint8),
            scale,
            out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
            m,
            n,
            tiles_m,
            tiles_n,
            scale.shape[-2],
            scale.shape[-1],
            BLOCK_M=bm,
            BLOCK_N=bn,
            TILE_M=tile.tile_m,
            TILE_N=tile.tile_n,
            SCALE=mode,
            MASKED=m % tile.tile_m != 0 or n % tile.tile_n != 0,
            OUT_KIND=kind,
            NAN_BF16=nan_bits(torch.bfloat16)[0],
            FP8_CVT=fp8_cvt,
            BF16_CVT=bf16_cvt,
            num_warps=tile.num_warps,
        )


def _dequant_triton(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size, out: torch.Tensor | None, out_dtype: torch.dtype,
    m: int, n: int,
) -> torch.Tensor:
    """`weight_dequant_triton` on arguments `check_dequant_call` has passed; only the devices are checked here."""
    device = launch_device("weight_dequant_triton", "weight", weight, scale_inv=scale_inv, out=out)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
    launch_dequant(weight.contiguous(), scale_inv.contiguous(), out, 1, m, n, block_size)
    return out


weight_dequant_triton = checked_entry(
    _dequant_triton, "weight_dequant_triton",
    "Dequantize with the Triton kernel into `out` (allocated on weight's device if None); return it.")


def _kind(t) -> str:
    return f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__


def check_batched_call(weights: torch.Tensor, scale_inv: torch.Tensor, block_size, out: torch.Tensor | None,
                       out_dtype: torch.dtype, name: str | None = None) -> tuple[int, int, int]:
    """`check_dequant_call` for a stack: weights [E, M, N] fp8, scale_inv [E, *scale_shape(M, N)] float32,
    `out` (if given) a contiguous [E, M, N] tensor of out_dtype; return (E, M, N)."""
    as_block(block_size, name)
    if not isinstance(weights, torch.Tensor) or weights.dtype != FP8_DTYPE:
        raise UnsupportedDtypeError(f"weights is a {_kind(weights)}, expected a {FP8_DTYPE} tensor", tensor=name)
    if weights.dim() != 3:
        raise ShapeError(f"weights must be 3-D [experts, M, N], got shape {list(weights.shape)}", tensor=name)
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != SCALE_DTYPE:
        raise ScaleError(f"scale_inv is a {_kind(scale_inv)}, expected a {SCALE_DTYPE} tensor", tensor=name)
    e, m, n = weights.shape
    want = [e, *scale_shape(m, n, block_size)]
    if list(scale_inv.shape) != want:
        raise ScaleError(f"scale_inv has shape {list(scale_inv.shape)}, expected {want} for weights shape "
                         f"{[e, m, n]} and block_size {block_size}", tensor=name)
    check_out_dtype(out_dtype, name)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != out_dtype:
            raise ShapeError(f"out is a {_kind(out)}, expected a {out_dtype} tensor", tensor=name)
        if list(out.shape) != [e, m, n]:
            raise ShapeError(f"out has shape {list(out.shape)}, expected {[e, m, n]}", tensor=name)
        if not out.is_contiguous():
            raise ShapeError("out must be contiguous", tensor=name)
    return e, m, n


def weight_dequant_batched_triton(
    weights: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size=DEFAULT_BLOCK_SIZE,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
) -> torch.Tensor:
    """Dequantize a stack of E same-shaped weights [E, M, N] (one layer's experts) with scales
    [E, ceil(M/BM), ceil(N/BN)] in one launch into `out` (allocated on weights' device if None); return it.
    Each expert's result is `weight_dequant_triton`'s bits."""
    e, m, n = check_batched_call(weights, scale_inv, block_size, out, out_dtype, name)
    device = launch_device("weight_dequant_batched_triton", "weights", weights, scale_inv=scale_inv, out=out)
    if out is None:
        out = torch.empty((e, m, n), dtype=out_dtype, device=device)
    launch_dequant(weights.contiguous(), scale_inv.contiguous(), out, e, m, n, block_size)
    return out
