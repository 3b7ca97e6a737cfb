"""The quantization formats of `expertd inspect`, on values checked by hand."""

import math

import pytest
import torch

from expertd.tools import number_formats as F


def row(*values, width=32):
    """One row of `width` values, zero-padded: a single MX block."""
    x = torch.zeros(1, width)
    x[0, : len(values)] = torch.tensor(values)
    return x


def test_minifloat_rounding_matches_torch_fp8_casts_bit_for_bit():
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt in (F.E4M3, F.E5M2):
        values = codes.view(fmt.torch_dtype).float()
        values = values[torch.isfinite(values)].unique()
        mids = (values[1:] + values[:-1]) / 2  # every tie
        rand = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 2.0 ** torch.randint(-12, 10, (20000,))
        for x in (values, mids, rand.clamp(-fmt.max_value, fmt.max_value)):
            assert torch.equal(F.round_minifloat(x, fmt), x.to(fmt.torch_dtype).float())


def test_e2m1_grid_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.0, 100.0, -0.3, 0.1, 0.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, 0.0, 0.0])
    assert torch.equal(F.round_minifloat(x, F.E2M1), want)


def test_mxfp4_shared_scale_is_floor_log2_amax_minus_2():
    # amax 12: X = 2^(3 - 2) = 2; elements 12/2 = 6, 10/2 = 5 -> 4 (tie to even), 3/2 = 1.5, 1/2 = 0.5,
    # 0.5/2 = 0.25 -> 0 (tie to even), 0.7/2 = 0.35 -> 0.5
    q = F.mxfp4(row(12.0, 10.0, 3.0, 1.0, 0.5, 0.7, -12.0))
    assert q[0, :7].tolist() == [12.0, 8.0, 3.0, 1.0, 0.0, 1.0, -12.0]
    # amax 7: X = 2^(2 - 2) = 1 and 7 clamps to the largest element, 6
    assert F.mxfp4(row(7.0, 1.0))[0, :2].tolist() == [6.0, 1.0]


def test_mxfp8_scale_clamping_and_independent_blocks():
    # amax 500: X = 2^(8 - 8) = 1, and 500 clamps to e4m3's 448
    assert F.mxfp8(row(500.0, 3.0))[0, :2].tolist() == [448.0, 3.0]
    # amax 1: X = 2^-8; 1/3 * 256 = 85.33 -> 88 (spacing 8) -> 0.34375
    assert F.mxfp8(row(1.0, 1 / 3))[0, :2].tolist() == [1.0, 0.34375]
    # the same 0.0013 in two blocks: X = 2^-8 (normal element) vs X = 2^-2 (amax 100: subnormal element)
    x = torch.cat([row(1.0, 0.0013), row(100.0, 0.0013)], dim=1)
    q = F.mxfp8(x)
    assert q[0, 1].item() == 0.0013427734375 and q[0, 33].item() == 0.00146484375
    # a tiny block: floor(log2(2^-140)) - 8 = -148 clamps to E8M0's -127; 2^-140 * 2^127 rounds to 0
    assert F.mx_scale_exponent(torch.tensor([2.0**-140]), F.E4M3).item() == -127
    assert F.mxfp8(row(2.0**-140)).abs().max().item() == 0.0


def test_mx_blocks_follow_the_last_dim_with_a_partial_block():
    x = torch.ones(3, 40)
    x[:, 35] = 7.0  # second (partial, 8-element) block of each row: amax 7
    q = F.mxfp4(x)
    assert q.shape == (3, 40)
    assert torch.equal(q[:, :32], torch.ones(3, 32)) and torch.equal(q[:, 35], torch.full((3,), 6.0))


def test_fp8_per_tensor_and_block_scales():
    assert F.fp8_per_tensor(torch.tensor([448.0, 1.1]), F.E4M3).tolist() == [[448.0, 1.125]]
    assert F.fp8_per_tensor(torch.tensor([57344.0, 1.1]), F.E5M2).tolist() == [[57344.0, 1.0]]
    x = torch.ones(130, 130)
    x[0, 0] = 448.0  # block (0, 0): scale 1, so 1.0 stays exact
    x[129, 129] = 1344.0  # partial block (1, 1): scale 3, 1/3 -> 0.34375 -> 1.03125
    q = F.fp8_block(x, F.E4M3)
    assert q[5, 5].item() == 1.0 and q[128, 128].item() == 1.03125 and q[129, 129].item() == 1344.0
    assert q[5, 129].item() == 1.0  # block (0, 1): amax 1, exact


def test_casts_round_to_nearest_even():
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 70000.0])
    assert F.FORMATS["bf16"](x)[0, :2].tolist() == [1.0, 1.015625]
    assert F.FORMATS["fp16"](x)[0, 2].item() == math.inf


def test_metrics():
    x, q = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0])
    assert F.relative_error(x, q) == pytest.approx(0.2)
    assert F.snr_db(x, q) == pytest.approx(10 * math.log10(25.0))
    assert F.snr_db(x, x) == math.inf and F.relative_error(x, x) == 0.0
    errors = F.measure(torch.tensor([[1.0, float("nan"), 70000.0]]), ["bf16", "fp16"])
    assert errors["fp16"].rel_error == math.inf  # fp16 overflows; the NaN is left out
    assert 0 < errors["bf16"].rel_error < 2**-8
    total = F.FormatError()
    total.add(F.FormatError(1.0, 16.0))
    total.add(F.FormatError(0.0, 9.0))
    assert total.rel_error == pytest.approx(0.2)  # errors add as squares, over tensors


@pytest.mark.parametrize("name", list(F.FORMATS))
def test_every_format_keeps_shape_and_orders_sensibly(name):
    x = torch.randn(3, 70, 200, generator=torch.Generator().manual_seed(1))
    q = F.FORMATS[name](x)
    assert q.shape == (210, 200) and q.dtype == torch.float32
    err = F.measure(x, [name])[name].rel_error
    bound = {"bf16": 2**-8, "fp16": 2**-11, "mxfp4_e2m1": 0.25}.get(name, 0.1)
    assert 0 < err < bound
