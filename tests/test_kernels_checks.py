"""FP8 dequant's argument checks (every entry point names the tensor), its small helpers and the encoder."""

from __future__ import annotations

import math

import pytest
import torch

from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError
from expertd.kernels import (
    ceil_div,
    quantize_fp8_blockwise,
    scale_shape,
    weight_dequant,
    weight_dequant_cpu,
    weight_dequant_reference,
    weight_dequant_triton,
)
from helpers.kernel_cases import FP8, NAME, random_case


# ---------------------------------------------------------------------------------------------- validation


def _paths():
    return [
        ("reference", lambda x, s, b=128, **kw: weight_dequant_reference(x, s, b, **kw)),
        ("cpu", weight_dequant_cpu),
        ("dispatch", lambda x, s, b=128, **kw: weight_dequant(x, s, b, device="cpu", **kw)),
        ("triton", weight_dequant_triton),  # checks run before any device or triton use
    ]


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p[0])
def test_validation_errors_name_the_tensor(path):
    _, fn = path
    x, s = random_case(200, 320, seed=15)
    cases = [
        (ScaleError, "shape", lambda: fn(x, torch.ones(2, 2), name=NAME)),
        (ScaleError, "shape", lambda: fn(x, torch.ones(4, 4), 64, name=NAME)),
        (ScaleError, "dtype", lambda: fn(x, s.double(), name=NAME)),
        (ScaleError, "dtype", lambda: fn(x, s.bfloat16(), name=NAME)),
        (UnsupportedDtypeError, "dtype", lambda: fn(x.float(), s, name=NAME)),
        (UnsupportedDtypeError, "dtype", lambda: fn(x.view(torch.uint8), s, name=NAME)),
        (UnsupportedDtypeError, "dtype", lambda: fn(x.view(torch.float8_e5m2), s, name=NAME)),
        (ShapeError, "2-D", lambda: fn(x.view(-1), s, name=NAME)),
        (ShapeError, "2-D", lambda: fn(x.view(1, 200, 320), s, name=NAME)),
        (ScaleError, "block_size", lambda: fn(x, s, 0, name=NAME)),
        (UnsupportedDtypeError, "out_dtype", lambda: fn(x, s, out_dtype=torch.int16, name=NAME)),
    ]
    for err, word, call in cases:
        with pytest.raises(err) as info:
            call()
        assert NAME in str(info.value) and word in str(info.value), str(info.value)
        assert info.value.tensor == NAME


def test_errors_are_standard_exceptions_too():
    x, s = random_case(8, 8)
    with pytest.raises(ValueError):
        weight_dequant_cpu(x, torch.ones(3, 3))
    with pytest.raises(TypeError):
        weight_dequant_cpu(x.float(), s)


@pytest.mark.parametrize("fn", [weight_dequant_cpu, weight_dequant_triton, weight_dequant],
                         ids=["cpu", "triton", "dispatch"])
def test_bad_out_is_rejected(fn):
    x, s = random_case(200, 320, seed=16)
    bad = [
        torch.empty(200, 321, dtype=torch.bfloat16),
        torch.empty(200, 320, dtype=torch.float16),
        torch.empty(320, 200, dtype=torch.bfloat16).t(),
    ]
    for out in bad:
        with pytest.raises(ShapeError, match=r"out .*" + NAME.replace(".", r"\.")):
            fn(x, s, out=out, name=NAME)


def test_helpers():
    assert ceil_div(0, 128) == 0 and ceil_div(128, 128) == 1 and ceil_div(129, 128) == 2
    assert all(ceil_div(a, 7) == math.ceil(a / 7) for a in range(50))
    assert scale_shape(200, 320) == (2, 3) and scale_shape(130, 70, 64) == (3, 2) and scale_shape(1, 1) == (1, 1)


# ---------------------------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("shape,block", [((200, 320), 128), ((129, 257), 128), ((130, 70), 64), ((1, 1), 128)])
def test_quantize_round_trip(shape, block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.02
    q, s = quantize_fp8_blockwise(w, block)
    assert q.dtype == FP8 and s.dtype == torch.float32 and tuple(s.shape) == scale_shape(*shape, block)
    y = weight_dequant_reference(q, s, block, out_dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normals, absolute <= 2**-10 * s for subnormals
    scales = s.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]
    bound = w.abs() * 2.0**-4 + 2.0**-10 * scales
    assert bool(((y - w).abs() <= bound).all())
    # the largest magnitude of each block maps to +-448 exactly
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            assert q[i * block:(i + 1) * block, j * block:(j + 1) * block].float().abs().max().item() == 448.0


def test_quantize_zero_block_and_errors():
    w = torch.zeros(256, 128)
    w[128:, :] = 1.0
    q, s = quantize_fp8_blockwise(w)
    assert torch.equal(s, torch.tensor([[1.0], [1.0 / 448]])) and bool((q[:128].float() == 0).all())
    with pytest.raises(ShapeError):
        quantize_fp8_blockwise(torch.zeros(4))
    with pytest.raises(UnsupportedDtypeError):
        quantize_fp8_blockwise(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ScaleError):
        quantize_fp8_blockwise(torch.full((4, 4), float("inf")))

