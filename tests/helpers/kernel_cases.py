"""What the FP8 dequant tests share: random and every-byte cases, bit-for-bit comparison, the CUDA and
triton marks (the MXFP4 tests use these too)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from expertd.kernels import scale_shape

FP8 = torch.float8_e4m3fn
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAME = "model.layers.3.mlp.experts.7.up_proj.weight"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, nan_payload: bool = True) -> None:
    """Bit-for-bit, NaN patterns included; nan_payload=False only requires NaN in the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{got.dtype} {list(got.shape)} vs {want.dtype} {list(want.shape)}"
    if not nan_payload:
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got.float()), nan), "NaN in other places"
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    same = bits(got) == bits(want)
    if not bool(same.all()):
        i, j = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{int((~same).sum())} elements differ, first at {(i, j)}: {got[i, j]} vs {want[i, j]}")


def random_case(m: int, n: int, block: int = 128, seed: int = 0, scales: str = "normal"):
    """Random fp8 bytes (all 256 values, NaN included) and float32 scales of the given kind."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=g).view(FP8)
    shape = scale_shape(m, n, block)
    if scales == "normal":
        s = torch.rand(shape, generator=g) * 1e-2 + 1e-6
    elif scales == "extreme":  # exponents from fp32-subnormal results to s * 256 overflowing fp32
        e = torch.randint(-140, 127, shape, generator=g).float()
        s = torch.exp2(e) * (1 + torch.rand(shape, generator=g))
        s = torch.where(torch.rand(shape, generator=g) < 0.5, -s, s)
    else:
        raise ValueError(scales)
    return x, s.float().contiguous()


def all_bytes_case(lo: int = -130, hi: int = 126):
    """A 256x256 weight whose every row holds all 256 bytes (rolled), with 16x16 scales (block 16) spanning
    2**lo..2**hi; the default reaches fp32-subnormal products and scales where s * 256 overflows."""
    row = torch.arange(256, dtype=torch.uint8)
    x = torch.stack([row.roll(i) for i in range(256)]).view(FP8)
    exps = torch.linspace(lo, hi, 256).round().view(16, 16)
    s = (torch.exp2(exps) * 1.3).float().contiguous()
    return x, s

