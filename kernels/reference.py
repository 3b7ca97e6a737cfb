"""Argument checks shared by every dequant path, and the plain-torch reference they must match bit for bit.

Numerics are DeepSeek-V3's `weight_dequant`: y[i, j] = out_dtype(float32(x[i, j]) * s[i // BM, j // BN]),
one float32 multiply and one round-to-nearest-even cast, where x is float8_e4m3fn [M, N] and s
(`*_scale_inv`) is float32 [ceil(M/BM), ceil(N/BN)], the last block row/column partial when a block
dimension does not divide M or N. DeepSeek's blocks are square (`block_size` an int B: BM = BN = B);
compressed-tensors' per-channel scales are blocks (1, N) and its per-tensor scale one block (M, N), so
every FP8 format expertd serves is this one rule with `block_size` a pair (BM, BN).
"""

from __future__ import annotations

import functools

import torch

from expertd.dtypes import DEQUANTIZED
from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError

FP8_DTYPE = DEQUANTIZED
SCALE_DTYPE = torch.float32
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_BLOCK_SIZE = 128


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def as_block(block_size, name: str | None = None) -> tuple[int, int]:
    """(rows, columns) of one scale block: an int B is a square B x B block, a pair is taken as it is."""
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in pair)):
        raise ScaleError(f"block_size must be a positive int or a (rows, columns) pair of them, got {block_size!r}",
                         tensor=name)
    return pair[0], pair[1]


def scale_shape(m: int, n: int, block_size=DEFAULT_BLOCK_SIZE) -> tuple[int, int]:
    """Shape of the `scale_inv` that goes with an [m, n] weight quantized in blocks of `block_size`."""
    bm, bn = as_block(block_size)
    return ceil_div(m, bm), ceil_div(n, bn)


def check_dequant_args(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size=DEFAULT_BLOCK_SIZE, name: str | None = None
) -> tuple[int, int]:
    """Validate a (weight, scale_inv, block_size) triple; return (M, N). Errors name the tensor."""
    as_block(block_size, name)
    if not isinstance(weight, torch.Tensor):
        raise UnsupportedDtypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}", tensor=name)
    if weight.dtype != FP8_DTYPE:
        raise UnsupportedDtypeError(f"weight dtype is {weight.dtype}, expected {FP8_DTYPE}", tensor=name)
    if weight.dim() != 2:
        raise ShapeError(f"weight must be 2-D, got shape {list(weight.shape)}", tensor=name)
    if not isinstance(scale_inv, torch.Tensor):
        raise ScaleError(f"scale_inv must be a torch.Tensor, got {type(scale_inv).__name__}", tensor=name)
    if scale_inv.dtype != SCALE_DTYPE:
        raise ScaleError(f"scale_inv dtype is {scale_inv.dtype}, expected {SCALE_DTYPE}", tensor=name)
    m, n = weight.shape
    want = scale_shape(m, n, block_size)
    if tuple(scale_inv.shape) != want:
        raise ScaleError(
            f"scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} "
            f"for weight shape {[m, n]} and block_size {block_size}",
            tensor=name,
        )
    return m, n


def check_out_dtype(out_dtype: torch.dtype, name: str | None = None) -> None:
    """Reject output dtypes no path supports."""
    if out_dtype not in OUT_DTYPES:
        raise UnsupportedDtypeError(f"out_dtype {out_dtype} not supported, expected one of {OUT_DTYPES}", tensor=name)


def check_out(out: torch.Tensor, m: int, n: int, out_dtype: torch.dtype, name: str | None = None) -> None:
    """A caller-supplied `out` must be a contiguous [m, n] tensor of out_dtype."""
    if not isinstance(out, torch.Tensor):
        raise ShapeError(f"out must be a torch.Tensor, got {type(out).__name__}", tensor=name)
    if out.dtype != out_dtype:
        raise ShapeError(f"out dtype is {out.dtype}, expected {out_dtype}", tensor=name)
    if tuple(out.shape) != (m, n):
        raise ShapeError(f"out has shape {list(out.shape)}, expected {[m, n]}", tensor=name)
    if not out.is_contiguous():
        raise ShapeError("out must be contiguous", tensor=name)


def check_dequant_call(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    name: str | None = None,
) -> tuple[int, int]:
    """Every check a dequant entry point makes before it touches a device: inputs, out_dtype, `out`; return (M, N)."""
    m, n = check_dequant_args(weight, scale_inv, block_size, name)
    check_out_dtype(out_dtype, name)
    if out is not None:
        check_out(out, m, n, out_dtype, name)
    return m, n


def checked_entry(impl, name: str, doc: str):
    """A public dequant entry point: `check_dequant_call`, then `impl` (which checks only devices).

    The CPU and Triton paths share one signature and one preamble this way; `weight_dequant`
    checks once and calls the `impl`s directly.
    """

    def entry(weight: torch.Tensor, scale_inv: torch.Tensor, block_size=DEFAULT_BLOCK_SIZE,
              out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              name: str | None = None) -> torch.Tensor:
        m, n = check_dequant_call(weight, scale_inv, block_size, out, out_dtype, name)
        return impl(weight, scale_inv, block_size, out, out_dtype, m, n)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = doc
    return entry


def expand_scale(scale_inv: torch.Tensor, m: int, n: int, block_size) -> torch.Tensor:
    """Per-element [m, n] scale: each scale entry repeated over its block, edge blocks cropped."""
    bm, bn = as_block(block_size)
    return scale_inv.repeat_interleave(bm, dim=0)[:m].repeat_interleave(bn, dim=1)[:, :n]


def weight_dequant_reference(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size=DEFAULT_BLOCK_SIZE,
    out_dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
) -> torch.Tensor:
    """Obviously correct (and slow, full-size temporaries) dequant: (x.float() * s).to(out_dtype)."""
    m, n = check_dequant_call(weight, scale_inv, block_size, None, out_dtype, name)
    return (weight.float() * expand_scale(scale_inv, m, n, block_size)).contiguous().to(out_dtype)


@functools.lru_cache(maxsize=None)
def nan_bits(out_dtype: torch.dtype) -> tuple[int, int]:
    """Bit patterns (as signed ints) the reference writes for the fp8 NaN bytes 0x7f and 0xff.

    torch's contiguous CPU fp32->bf16 cast writes 0xffff for every NaN (a strided cast writes 0x7fc0), so
    the fast paths ask the reference instead of assuming a canonical NaN.
    """
    check_out_dtype(out_dtype)
    nan_bytes = torch.tensor([[0x7F, 0xFF]], dtype=torch.uint8).view(FP8_DTYPE)
    y = weight_dequant_reference(nan_bytes, torch.ones(1, 1), block_size=2, out_dtype=out_dtype)
    bits = y.view(torch.int32 if out_dtype == torch.float32 else torch.int16).flatten().tolist()
    return bits[0], bits[1]
