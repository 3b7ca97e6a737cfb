"""HiFloat8 codes and round trip, bit for bit against en-dtypes' `hifloat8` numpy dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from expertd.tools import number_formats as F
from expertd.tools.hif8 import HIF8_MAX, MAGNITUDES, hif8_decode, hif8_encode, hif8_round_trip

en_dtypes = pytest.importorskip("en_dtypes")
HIF8 = en_dtypes.hifloat8


def oracle_codes(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(HIF8).view(np.uint8)


def test_all_256_codes_decode_like_the_oracle():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(HIF8).astype(np.float32)
    got = hif8_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(got, want)  # NaN where NaN (only 0x80), +-Inf at 0x6F/0xEF
    assert math.isnan(got[0x80]) and np.isnan(got).sum() == 1
    assert got[0x6E] == 32768 and got[0x6F] == math.inf and got[0xEF] == -math.inf
    assert got[0x01] == 2.0 ** -22 and got[0x7E] == 2.0 ** -15 and got[0x00] == 0


def test_every_code_and_midpoint_encodes_like_the_oracle():
    finite = MAGNITUDES.numpy()  # 0 .. 32768, every finite magnitude
    mids = (finite[:-1] + finite[1:]) / 2  # ties: away from zero in both
    below = np.nextafter(mids, np.float32(0), dtype=np.float32)
    above = np.nextafter(mids, np.float32(np.inf), dtype=np.float32)
    values = np.concatenate([finite, mids, below, above]).astype(np.float32)
    values = np.concatenate([values, -values])
    got = hif8_encode(torch.from_numpy(values)).numpy()
    want = oracle_codes(values)
    # en-dtypes keeps a sign on -0 (0x80 would be NaN, so it maps -0 to 0x00 as well): codes agree everywhere
    np.testing.assert_array_equal(got, want)


def test_random_values_across_the_range_encode_like_the_oracle():
    gen = np.random.default_rng(0)
    exponents = gen.uniform(-26, math.log2(HIF8_MAX * 1.2), 200_000)
    values = (gen.choice([-1.0, 1.0], exponents.size) * 2.0 ** exponents).astype(np.float32)
    got = hif8_encode(torch.from_numpy(values)).numpy()
    want = oracle_codes(values)
    # en-dtypes overflows to +-Inf by design (a cast without saturation); this format saturates at +-32768
    # like the others in expertd.tools.number_formats. Compare codes within range; saturation is tested below.
    inside = np.abs(values) < 1.25 * HIF8_MAX
    np.testing.assert_array_equal(got[inside], want[inside])
    np.testing.assert_array_equal(hif8_encode(torch.from_numpy(values), saturate=False).numpy(), want)
    trip = hif8_round_trip(torch.from_numpy(values)).numpy()
    np.testing.assert_array_equal(trip[inside], want[inside].view(HIF8).astype(np.float32))


def test_saturation_flush_and_specials():
    x = torch.tensor([40959.0, 40960.0, 1e9, math.inf, -math.inf, -1e9, 2.0 ** -23, 2.0 ** -23 * 0.999, -1e-30,
                      math.nan])
    assert hif8_round_trip(x)[:-1].tolist() == [32768, 32768, 32768, 32768, -32768, -32768, 2.0 ** -22, 0, 0]
    assert math.isnan(hif8_round_trip(x)[-1])
    codes = hif8_encode(x).tolist()
    assert codes[:3] == [0x6E] * 3 and codes[3:5] == [0x6F, 0xEF] and codes[-2:] == [0x00, 0x80]
    assert hif8_encode(torch.tensor([40960.0, -40960.0]), saturate=False).tolist() == [0x6F, 0xEF]


def test_hif8_is_a_format_with_aliases():
    x = torch.randn(3, 40)
    assert torch.equal(F.FORMATS["hif8"](x), hif8_round_trip(x))
    assert F.resolve_format("hifloat8") == "hif8" and F.resolve_format("mxfp4") == "mxfp4_e2m1"
    with pytest.raises(ValueError, match="known"):
        F.resolve_format("fp3")
    assert F.round_trip(x.bfloat16(), "bf16").dtype == torch.bfloat16
