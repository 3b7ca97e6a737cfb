"""MXFP4 (gpt-oss's checkpoint layout) -> bf16, bit for bit transformers' `convert_moe_packed_tensors`.

A gpt-oss expert weight is stored as `*_blocks` uint8 [..., R, G, 16] (two e2m1 codes per byte, low nibble
first: 32 codes per group) and `*_scales` uint8 [..., R, G] (e8m0: 2**(s - 127)), and decodes to
[..., G*32, R] (transformers transposes the last two dims: gate_up_proj [E, H, 2I] from blocks
[E, 2I, H/32, 16]). Each (scale byte, code) pair has exactly one result, so the CPU paths gather from one
[256, 16] table that `mxfp4_table` computes with transformers' own ops (its lut, `torch.ldexp` with an
int32 exponent, into a bf16 out): the table is its decode by construction, and the tests check every pair.

Paths: a compiled loop (kernels/mxfp4.c, built with dequant_lut.c by native.py) on the CPU, a pure-torch
gather where that cannot be built (EXPERTD_NATIVE=0), a Triton kernel on CUDA (triton imported on first use;
it computes each result exactly instead of gathering, see _triton_mxfp4).
`dequant_mxfp4_reference` decodes with exact float64 arithmetic instead, the independent check.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch

from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError

from . import native
from .triton_dequant import launch_device, on_device

# transformers.integrations.mxfp4.FP4_VALUES: e2m1 code -> value (bit 3 is the sign)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
SCALE_BIAS = 127
OUT_DTYPE = torch.bfloat16


def _mxfp4_table(dtype: torch.dtype) -> torch.Tensor:
    # transformers' _convert_moe_packed_tensors on 256 rows: row s holds byte (c | c << 4) at position c, so
    # both nibbles of each byte are code c and the row decodes [c0, c0, c1, c1, ...] under exponent s - 127;
    # the same ops, on rows of the same 32 results, into the same kind of out tensor.
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    codes = torch.arange(16, dtype=torch.uint8)
    blk = (codes | (codes << 4)).expand(256, 16).contiguous()
    exp = torch.arange(256, dtype=torch.uint8).reshape(256, 1).to(torch.int32) - SCALE_BIAS
    sub = torch.empty(256, 32, dtype=dtype)
    sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
    sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
    torch.ldexp(sub, exp, out=sub)
    return sub[:, 0::2].contiguous()


@functools.lru_cache(maxsize=None)
def _table(dtype: torch.dtype = OUT_DTYPE) -> torch.Tensor:
    return _mxfp4_table(dtype)


def mxfp4_table(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[256, 16]: entry [s, c] is transformers' decode of e2m1 code c under e8m0 scale byte s, in `dtype`."""
    return _table(dtype).clone()


@functools.lru_cache(maxsize=None)
def _pair_table() -> torch.Tensor:
    """int32 [256 * 256]: at s * 256 + b, the bf16 bits of code byte b's two results under scale byte s,
    placed so that its int16 view reads (low nibble's result, high nibble's result) on this host."""
    t = _table(OUT_DTYPE).view(torch.int16).to(torch.int32) & 0xFFFF
    b = torch.arange(256)
    first, second = (t[:, b & 15], t[:, b >> 4]) if sys.byteorder == "little" else (t[:, b >> 4], t[:, b & 15])
    return (first | (second << 16)).reshape(-1).contiguous()


def _kind(t) -> str:
    return type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.dtype} tensor"


def check_mxfp4_args(blocks: torch.Tensor, scales: torch.Tensor, name: str | None = None) -> tuple[int, int, int]:
    """Validate a (blocks, scales) pair; return (leading elements E, rows R, groups G). Errors name the tensor."""
    if not isinstance(blocks, torch.Tensor):
        raise UnsupportedDtypeError(f"blocks must be a torch.Tensor, got {_kind(blocks)}", tensor=name)
    if blocks.dtype != torch.uint8:
        raise UnsupportedDtypeError(f"blocks dtype is {blocks.dtype}, expected torch.uint8 (two e2m1 codes per byte)",
                                    tensor=name)
    if not isinstance(scales, torch.Tensor):
        raise ScaleError(f"scales must be a torch.Tensor, got {_kind(scales)}", tensor=name)
    if scales.dtype != torch.uint8:
        raise ScaleError(f"scales dtype is {scales.dtype}, expected torch.uint8 (e8m0 exponents)", tensor=name)
    if blocks.dim() < 3 or blocks.shape[-1] != 16:
        raise ShapeError(f"blocks has shape {list(blocks.shape)}, expected [..., R, G, 16] (last dim 16: 32 e2m1 "
                         "codes per group)", tensor=name)
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ScaleError(f"scales has shape {list(scales.shape)}, expected blocks.shape[:-1] = "
                         f"{list(blocks.shape[:-1])}", tensor=name)
    r, g = blocks.shape[-3], blocks.shape[-2]
    e = 1
    for d in blocks.shape[:-3]:
        e *= d
    return e, r, g


def _out_shape(blocks: torch.Tensor) -> list[int]:
    *lead, r, g, _ = blocks.shape
    return [*lead, g * GROUP, r]


def _check_out(out, shape: list[int], name: str | None, device: torch.device | None = None) -> None:
    if not isinstance(out, torch.Tensor):
        raise ShapeError(f"out must be a torch.Tensor, got {_kind(out)}", tensor=name)
    if out.dtype != OUT_DTYPE:
        raise ShapeError(f"out dtype is {out.dtype}, expected {OUT_DTYPE}", tensor=name)
    if list(out.shape) != shape:
        raise ShapeError(f"out has shape {list(out.shape)}, expected {shape}", tensor=name)
    if not out.is_contiguous():
        raise ShapeError("out must be contiguous", tensor=name)
    if device is not None and out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device}")


def dequant_mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Obviously correct (and slow): value(code) * 2**(s - 127) in float64, where every product is exact,
    rounded once to bf16 (exact too, but for overflow to inf); the last two dims transposed."""
    check_mxfp4_args(blocks, scales, name)
    *lead, r, g, _ = blocks.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*lead, r, g, GROUP).long()
    values = torch.tensor(FP4_VALUES, dtype=torch.float64, device=blocks.device)[codes]
    factor = torch.pow(2.0, scales.to(torch.float64) - SCALE_BIAS).unsqueeze(-1)
    y = (values * factor).to(OUT_DTYPE).reshape(*lead, r, g * GROUP)
    return y.transpose(-1, -2).contiguous()


def _torch_gather(x: torch.Tensor, s: torch.Tensor, g0: int, g1: int, out: torch.Tensor) -> None:
    """The pure-torch path: out [E, (g1-g0)*32, R] from x [E, R, G, 16], s [E, R, G] (CPU), one expert at a
    time: the bytes transposed to [n, 16, R] first (a quarter of the result's bytes), then one gather from
    the pair table per byte gives result rows 2i and 2i+1 of each group."""
    pairs = _pair_table()
    n = g1 - g0
    for e in range(s.shape[0]):
        idx = x[e, :, g0:g1].permute(1, 2, 0).to(torch.int64, memory_format=torch.contiguous_format)  # [n, 16, R]
        idx += s[e, :, g0:g1].t().to(torch.int64).mul_(256).unsqueeze(1)
        vals = torch.index_select(pairs, 0, idx.view(-1)).view(torch.int16).view(n, 16, -1, 2)
        out[e].view(torch.int16).view(n, 16, 2, -1).copy_(vals.permute(0, 1, 3, 2))


def _dequant_cpu(x: torch.Tensor, s: torch.Tensor, g0: int, g1: int, out: torch.Tensor, threads: int | None) -> None:
    """out [E, (g1-g0)*32, R] (contiguous) from contiguous CPU x [E, R, G, 16] and s [E, R, G]."""
    if out.numel() == 0:
        return
    if native.available():
        native.mxfp4_dequant(x, s, _table(OUT_DTYPE), out, g0, g1, threads)
    else:
        _torch_gather(x, s, g0, g1, out)


def dequant_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    name: str | None = None,
    device: torch.device | str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """bf16 [..., G*32, R] from blocks [..., R, G, 16] and scales [..., R, G], into `out` if given.

    Runs on `device` (default: CUDA if available, else CPU): on the CPU the compiled gather (or the torch
    path where it cannot be built), `threads` capping its threads (default: torch's); on CUDA the Triton
    kernel, the inputs moved there first and a CPU `out` receiving a copy.
    """
    e, r, g = check_mxfp4_args(blocks, scales, name)
    shape = _out_shape(blocks)
    if out is not None:
        _check_out(out, shape, name)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        xb = blocks.to(device, non_blocking=True)
        sc = scales.to(device, non_blocking=True)
        if out is not None and out.device == xb.device:
            return _dequant_triton(xb, sc, out)
        y = _dequant_triton(xb, sc, None)
        if out is None:
            return y
        out.copy_(y)
        return out
    if device.type != "cpu":
        raise ValueError(f"dequant_mxfp4 runs on cpu or cuda, not {device}")
    blocks, scales = blocks.cpu(), scales.cpu()
    if out is None:
        out = torch.empty(shape, dtype=OUT_DTYPE)
    elif out.device.type != "cpu":
        raise ValueError(f"dequant_mxfp4 on the CPU writes CPU tensors, out is on {out.device}")
    _dequant_cpu(blocks.contiguous().reshape(e, r, g, 16), scales.contiguous().reshape(e, r, g), 0, g,
                 out.view(e, g * GROUP, r), threads)
    return out


def dequant_mxfp4_groups(blocks: torch.Tensor, scales: torch.Tensor, g0: int, g1: int, out: torch.Tensor, *,
                         threads: int = 1, name: str | None = None) -> torch.Tensor:
    """Rows [g0*32, g1*32) of one expert's [G*32, R] result into `out` (contiguous bf16 [(g1-g0)*32, R] on
    the CPU, e.g. a view of a mapped buffer): a loader's chunk. blocks [R, G, 16] and scales [R, G] are
    contiguous CPU tensors; the compiled loop drops the GIL, so loader threads run in parallel."""
    check_mxfp4_args(blocks, scales, name)
    if blocks.dim() != 3:
        raise ShapeError(f"blocks has shape {list(blocks.shape)}, expected one expert's [R, G, 16]", tensor=name)
    r, g, _ = blocks.shape
    if isinstance(g0, bool) or isinstance(g1, bool) or not isinstance(g0, int) or not isinstance(g1, int) \
            or not 0 <= g0 <= g1 <= g:
        raise ShapeError(f"group range [{g0!r}, {g1!r}) is not within [0, {g})", tensor=name)
    for what, t in (("blocks", blocks), ("scales", scales)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ShapeError(f"{what} must be a contiguous CPU tensor", tensor=name)
    _check_out(out, [(g1 - g0) * GROUP, r], name, torch.device("cpu"))
    _dequant_cpu(blocks.unsqueeze(0), scales.unsqueeze(0), g0, g1, out.unsqueeze(0), threads)
    return out


# --- encoder ---------------------------------------------------------------------------------------------

# Between e2m1 magnitudes i and i+1 (0, 0.5, 1, 1.5, 2, 3, 4, 6): the midpoint, and whether a tie goes up
# (round half to even: to the even code, i+1 when i is odd).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E2M1_EMAX = 2  # exponent of the largest e2m1 magnitude, 6 = 1.5 * 2**2


def quantize_mxfp4(w: torch.Tensor, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., R, K/32, 16], scales uint8 [..., R, K/32]) of a float w [..., K, R] (the decoded
    layout: `dequant_mxfp4(*quantize_mxfp4(w))` approximates w).

    OCP MX: each group of 32 values along K shares the scale 2**X, X = floor(log2(amax)) - 2 (the largest
    e2m1 exponent), clamped to e8m0's finite range [-127, 127]; each value / 2**X is rounded to e2m1 to
    nearest, ties to even, saturating at +-6. All-zero groups get X = 0. Values already of the form
    e2m1 * 2**k come back exactly.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise UnsupportedDtypeError(f"can only quantize a float tensor, got {_kind(w)}", tensor=name)
    if w.dim() < 2 or w.shape[-2] % GROUP != 0:
        raise ShapeError(f"can only quantize [..., K, R] with K a multiple of {GROUP}, got shape {list(w.shape)}",
                         tensor=name)
    x = w.detach().to(torch.float64).transpose(-1, -2)  # [..., R, K]
    if not bool(torch.isfinite(x).all()):
        raise ScaleError("cannot quantize a tensor holding inf or NaN", tensor=name)
    *lead, r, k = x.shape
    x = x.reshape(*lead, r, k // GROUP, GROUP)
    amax = x.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1: floor(log2(amax)) = e - 1
    xexp = torch.where(amax > 0, e.to(torch.int64) - 1 - E2M1_EMAX, torch.zeros_like(e, dtype=torch.int64))
    xexp = xexp.clamp(-SCALE_BIAS, SCALE_BIAS)
    v = torch.ldexp(x.abs(), -xexp.unsqueeze(-1))  # exact in float64
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in _MIDPOINTS:
        code += (v >= mid) if tie_up else (v > mid)
    code |= torch.signbit(x).to(torch.uint8) << 3
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()
    scales = (xexp + SCALE_BIAS).to(torch.uint8).contiguous()
    return blocks, scales


# --- Triton ----------------------------------------------------------------------------------------------


class Mxfp4Tiling(NamedTuple):
    groups: int  # groups per program: groups * 16 contiguous bytes of each row, groups * 32 result rows
    tile_r: int  # rows of blocks per program: result columns
    num_warps: int


def mxfp4_tiling(r: int, g: int) -> Mxfp4Tiling:
    """The tile of one expert's [G*32, R] result: 4 groups (64-byte reads per row) by 64 columns."""
    return Mxfp4Tiling(min(4, 1 << max(0, g - 1).bit_length()), 64, 4)


def launch_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                 tile: Mxfp4Tiling | None = None) -> None:
    """One launch over every expert: contiguous blocks [E, R, G, 16], scales [E, R, G] into out [E, G*32, R],
    arguments unchecked; `tile` overrides `mxfp4_tiling` (benchmarks)."""
    if out.numel() == 0:
        return
    from . import _triton_mxfp4 as K

    *_, r, g, _ = blocks.shape
    e = out.numel() // (g * GROUP * r)
    tile = tile or mxfp4_tiling(r, g)
    tiles_g, tiles_r = -(-g // tile.groups), -(-r // tile.tile_r)
    with on_device(out.device):
        K._mxfp4_kernel[(e * tiles_g * tiles_r,)](
            blocks,
            scales,
            out.view(torch.int16),
            r,
            g,
            tiles_g,
            tiles_r,
            GROUPS=tile.groups,
            TILE_R=tile.tile_r,
            MASKED=g % tile.groups != 0 or r % tile.tile_r != 0,
            num_warps=tile.num_warps,
        )


def _dequant_triton(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`dequant_mxfp4_triton` on checked arguments; only the devices are checked here."""
    device = launch_device("dequant_mxfp4_triton", "blocks", blocks, scales=scales, out=out)
    if out is None:
        out = torch.empty(_out_shape(blocks), dtype=OUT_DTYPE, device=device)
    launch_mxfp4(blocks.contiguous(), scales.contiguous(), out)
    return out


def dequant_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None, *,
                         name: str | None = None) -> torch.Tensor:
    """Dequantize with the Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1) into `out`
    (allocated on blocks' device if None); return it. Bit for bit the CPU paths; every leading dimension
    (a layer's experts) in one launch."""
    check_mxfp4_args(blocks, scales, name)
    if out is not None:
        _check_out(out, _out_shape(blocks), name)
    return _dequant_triton(blocks, scales, out)
