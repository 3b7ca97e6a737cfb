"""The MXFP4 encoder (quantize_mxfp4: error bound, rounding, exact round trips) and the checks every MXFP4
entry point makes on its arguments."""

from __future__ import annotations

import pytest
import torch

from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError
from expertd.kernels.mxfp4 import (
    dequant_mxfp4,
    dequant_mxfp4_groups,
    dequant_mxfp4_reference,
    dequant_mxfp4_triton,
    quantize_mxfp4,
)
from helpers.mxfp4_cases import assert_bits_equal, every_pair, random_case

NAME = "model.layers.0.mlp.experts.gate_up_proj"


# --- the encoder ---------------------------------------------------------------------------------------------


def test_encoder_round_trip_error_bound():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 128, 70, generator=g) * torch.logspace(-3, 2, 70)).to(torch.bfloat16)  # [E, K, R]
    w[0, :32, 0] = 0.0  # an all-zero group
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 70, 4, 16) and scales.shape == (3, 70, 4)
    assert blocks.dtype == scales.dtype == torch.uint8
    y = dequant_mxfp4(blocks, scales, device="cpu")
    assert y.shape == w.shape
    # per group of 32 along K: amax in [4, 8) * 2**X, so the error is at most one half step (<= 2**X, the
    # step between 4 and 6 being 2 * 2**X) or the saturation amax - 6 * 2**X
    wg = w.float().transpose(-1, -2).reshape(3, 70, 4, 32)
    err = (y.float().transpose(-1, -2).reshape(3, 70, 4, 32) - wg).abs().amax(-1)
    step = torch.pow(2.0, scales.float() - 127)
    amax = wg.abs().amax(-1)
    bound = torch.maximum(step, amax - 6 * step)
    assert bool((err <= bound).all())
    assert bool((err <= amax / 3).all())
    assert float((y.float() - w.float()).norm() / w.float().norm()) < 0.15
    assert bool((y[0, :32, 0] == 0).all())
    nonzero = amax > 0
    assert bool((scales[nonzero] == torch.floor(torch.log2(amax[nonzero])).to(torch.uint8) + 125).all())


def test_encoder_round_to_nearest_even_and_saturation():
    # one group (scale 2**0: amax 6.5 -> floor(log2) = 2 -> X = 0), the midpoints between e2m1 values
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.25, -0.75, -5.0, -6.5, 0.3, 2.6, 4.9, 5.1]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -4.0, -6.0, 0.5, 3.0, 4.0, 6.0]
    w = torch.tensor(vals + [0.0] * 16).reshape(32, 1)
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    y = dequant_mxfp4(blocks, scales, device="cpu").reshape(-1)[:16]
    assert y.tolist() == want
    assert torch.equal(torch.signbit(y), torch.signbit(torch.tensor(want)))


def test_encoder_exact_on_representable_values():
    """Every value e2m1 * 2**(s-127) that is finite in bf16 comes back bit for bit (signed zeros too)."""
    blocks, scales = random_case(4, rows=64, groups=4, seed=21, hi=254)
    blocks[0, 0] = 0x88  # a group of -0.0
    blocks[0, 1] = 0  # and of +0.0
    w = dequant_mxfp4_reference(blocks, scales)
    finite = torch.isfinite(w.float()).reshape(4, 4, 32, 64).all(dim=2)  # [E, G, R]: whole groups
    w = torch.where(finite.repeat_interleave(32, dim=1), w, torch.zeros_like(w))
    y = dequant_mxfp4(*quantize_mxfp4(w), device="cpu")
    assert_bits_equal(y, w)
    every = dequant_mxfp4_reference(*every_pair())  # every (scale, code) pair, groups holding inf zeroed
    ok = torch.isfinite(every.float()).reshape(1, 16, 32, 256).all(dim=2)
    every = torch.where(ok.repeat_interleave(32, dim=1), every, torch.zeros_like(every))
    assert int(ok.sum()) > 250 * 16  # scales up to 253 keep their groups (2**126 * 6 is finite)
    assert_bits_equal(dequant_mxfp4(*quantize_mxfp4(every), device="cpu"), every)


def test_encoder_rejects():
    with pytest.raises(ShapeError, match="multiple of 32") as exc:
        quantize_mxfp4(torch.zeros(2, 40, 8), name=NAME)
    assert NAME in str(exc.value)
    with pytest.raises(UnsupportedDtypeError, match="float"):
        quantize_mxfp4(torch.zeros(32, 8, dtype=torch.int32))
    with pytest.raises(ScaleError, match="inf or NaN"):
        quantize_mxfp4(torch.full((32, 2), float("inf")))


# --- bad inputs ----------------------------------------------------------------------------------------------


def _bad_calls():
    b, s = random_case(2, rows=8, groups=3)
    return [
        ("blocks-dtype", lambda: dequant_mxfp4(b.to(torch.int8), s, name=NAME), UnsupportedDtypeError,
         "blocks dtype is torch.int8, expected torch.uint8"),
        ("blocks-type", lambda: dequant_mxfp4(b.tolist(), s, name=NAME), UnsupportedDtypeError,
         "blocks must be a torch.Tensor"),
        ("scales-dtype", lambda: dequant_mxfp4(b, s.float(), name=NAME), ScaleError,
         "scales dtype is torch.float32, expected torch.uint8"),
        ("last-dim", lambda: dequant_mxfp4(b[..., :8], s, name=NAME), ShapeError,
         r"blocks has shape \[2, 8, 3, 8\], expected \[..., R, G, 16\]"),
        ("too-few-dims", lambda: dequant_mxfp4(b[0, 0], s[0, 0], name=NAME), ShapeError,
         r"blocks has shape \[3, 16\], expected \[..., R, G, 16\]"),
        ("scales-shape", lambda: dequant_mxfp4(b, s[:, :, :2], name=NAME), ScaleError,
         r"scales has shape \[2, 8, 2\], expected blocks.shape\[:-1\] = \[2, 8, 3\]"),
        ("out-dtype", lambda: dequant_mxfp4(b, s, torch.empty(2, 96, 8), name=NAME), ShapeError,
         "out dtype is torch.float32, expected torch.bfloat16"),
        ("out-shape", lambda: dequant_mxfp4(b, s, torch.empty(2, 8, 96, dtype=torch.bfloat16), name=NAME), ShapeError,
         r"out has shape \[2, 8, 96\], expected \[2, 96, 8\]"),
        ("out-strided", lambda: dequant_mxfp4(b, s, torch.empty(2, 8, 96, dtype=torch.bfloat16).transpose(1, 2),
                                              name=NAME), ShapeError, "out must be contiguous"),
        ("groups-range", lambda: dequant_mxfp4_groups(b[0], s[0], 2, 4, torch.empty(64, 8, dtype=torch.bfloat16),
                                                      name=NAME), ShapeError,
         r"group range \[2, 4\) is not within \[0, 3\)"),
        ("groups-out", lambda: dequant_mxfp4_groups(b[0], s[0], 1, 3, torch.empty(32, 8, dtype=torch.bfloat16),
                                                    name=NAME), ShapeError,
         r"out has shape \[32, 8\], expected \[64, 8\]"),
        ("groups-experts", lambda: dequant_mxfp4_groups(b, s, 0, 1, torch.empty(32, 8, dtype=torch.bfloat16),
                                                        name=NAME), ShapeError, "one expert's"),
        ("groups-strided", lambda: dequant_mxfp4_groups(b[0, ::2], s[0, ::2], 0, 1,
                                                        torch.empty(32, 4, dtype=torch.bfloat16), name=NAME),
         ShapeError, "blocks must be a contiguous CPU tensor"),
        ("triton-dtype", lambda: dequant_mxfp4_triton(b, s.to(torch.int32), name=NAME), ScaleError,
         "scales dtype is torch.int32"),
        ("reference-dtype", lambda: dequant_mxfp4_reference(b.float(), s, name=NAME), UnsupportedDtypeError,
         "blocks dtype is torch.float32"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_say_what_was_expected(case):
    _, call, error, message = case
    with pytest.raises(error, match=message) as exc:
        call()
    assert NAME in str(exc.value)
