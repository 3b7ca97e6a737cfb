"""FP8 dequant on the CPU: every path (the compiled table lookup, its SIMD gather, pure torch) bit-identical
to the plain-torch reference, into any kind of output buffer. Argument checks and the encoder:
test_kernels_checks.py; the Triton kernel: test_kernels_triton.py."""

from __future__ import annotations

import mmap

import pytest
import torch

import expertd.kernels.cpu as cpu_mod
from expertd.kernels import weight_dequant, weight_dequant_cpu, weight_dequant_reference
from helpers.kernel_cases import FP8, OUT_DTYPES, all_bytes_case, assert_bits_equal, random_case

SHAPES = [(200, 320), (576, 200), (1, 1), (129, 257), (128, 128), (300, 7)]


@pytest.fixture(params=["native-simd", "native-scalar", "torch"])
def cpu_path(request, monkeypatch):
    """Run a CPU test on the compiled table lookup (AVX-512 VBMI gather and the scalar loop) and on the
    pure-torch path."""
    from expertd.kernels import native

    if request.param.startswith("native"):
        if not native.available():
            pytest.fail("the native CPU dequant could not be built (is a C compiler installed?)")
        before = native.simd()
        if native.simd(request.param == "native-simd") != (request.param == "native-simd"):
            pytest.skip("this CPU has no AVX-512 VBMI (the scalar loop is tested by native-scalar)")
        yield request.param
        native.simd(before)
    else:
        monkeypatch.setattr(native, "available", lambda: False)
        yield request.param


# ---------------------------------------------------------------------------------------------- CPU path


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.usefixtures("cpu_path")
def test_all_256_bytes_match_reference(out_dtype):
    x, s = all_bytes_case()
    want = weight_dequant_reference(x, s, 16, out_dtype=out_dtype)
    assert bool(torch.isnan(want.float()).any())  # NaN bytes are in there
    assert_bits_equal(weight_dequant_cpu(x, s, 16, out_dtype=out_dtype), want)


@pytest.mark.usefixtures("cpu_path")
def test_nan_bytes_dequantize_to_nan():
    x = torch.tensor([[0x7F, 0xFF, 0x7E, 0xFE]], dtype=torch.uint8).view(FP8)
    y = weight_dequant_cpu(x, torch.full((1, 1), 0.5), 128).float()
    assert torch.isnan(y[0, :2]).all() and y[0, 2].item() == 224.0 and y[0, 3].item() == -224.0


@pytest.mark.usefixtures("cpu_path")
def test_subnormal_bytes_are_exact():
    x = torch.arange(8, dtype=torch.uint8).view(1, 8).view(FP8)  # 0 and the 7 e4m3 subnormals m * 2**-9
    y = weight_dequant_cpu(x, torch.ones(1, 1), 128, out_dtype=torch.float32)
    assert y.flatten().tolist() == [m * 2.0**-9 for m in range(8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [128, 64, 100])
@pytest.mark.parametrize("scales", ["normal", "extreme"])
@pytest.mark.usefixtures("cpu_path")
def test_cpu_matches_reference(shape, block, scales):
    x, s = random_case(*shape, block=block, scales=scales, seed=shape[0] * 1000 + shape[1] + block)
    for out_dtype in OUT_DTYPES:
        want = weight_dequant_reference(x, s, block, out_dtype=out_dtype)
        assert_bits_equal(weight_dequant_cpu(x, s, block, out_dtype=out_dtype), want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", ["channel", "tensor", (64, 32), (1, 7), (3, 128)])
@pytest.mark.usefixtures("cpu_path")
def test_cpu_rectangular_blocks_match_reference(shape, block):
    """compressed-tensors' scales are blocks too: one per output channel (1 x N), one per tensor (M x N); any
    (rows, columns) block dequantizes as the reference does, on every CPU path."""
    m, n = shape
    block = {"channel": (1, n), "tensor": (m, n)}.get(block, block)
    x, s = random_case(m, n, block)
    assert_bits_equal(weight_dequant_cpu(x, s, block), weight_dequant_reference(x, s, block))


@pytest.mark.parametrize("chunk", [1, 7, 257 * 10, 128 * 257 + 5, 1 << 20])
@pytest.mark.usefixtures("cpu_path")
def test_cpu_chunking_does_not_matter(monkeypatch, chunk):
    """Chunks of one row, of 10 rows (part of a block row), of two block rows with a partial one at the end."""
    monkeypatch.setattr(cpu_mod, "CHUNK_ELEMS", chunk)
    x, s = random_case(300, 257, block=64, seed=chunk % 97, scales="extreme")
    for out_dtype in OUT_DTYPES:
        assert_bits_equal(weight_dequant_cpu(x, s, 64, out_dtype=out_dtype),
                          weight_dequant_reference(x, s, 64, out_dtype=out_dtype))


@pytest.mark.usefixtures("cpu_path")
def test_cpu_nan_inf_zero_scales():
    x, s = random_case(256, 384, block=128, seed=5)
    s[0, 0], s[0, 1], s[1, 0], s[1, 2] = float("nan"), float("inf"), 0.0, -float("inf")
    for out_dtype in OUT_DTYPES:
        want = weight_dequant_reference(x, s, 128, out_dtype=out_dtype)
        # bf16 NaN is one pattern; fp16/fp32 NaN payloads for NaN byte x NaN scale are the compiler's choice
        assert_bits_equal(weight_dequant_cpu(x, s, 128, out_dtype=out_dtype), want,
                          nan_payload=out_dtype == torch.bfloat16)


@pytest.mark.usefixtures("cpu_path")
def test_cpu_block_size_one_and_large():
    for block, shape in [(1, (9, 11)), (512, (700, 300)), (3, (10, 20))]:
        x, s = random_case(*shape, block=block, seed=block)
        assert_bits_equal(weight_dequant_cpu(x, s, block), weight_dequant_reference(x, s, block))


@pytest.mark.usefixtures("cpu_path")
def test_cpu_empty_weight():
    x = torch.empty(0, 5, dtype=FP8)
    assert weight_dequant_cpu(x, torch.empty(0, 1)).shape == (0, 5)


@pytest.mark.usefixtures("cpu_path")
def test_cpu_non_contiguous_inputs():
    x, s = random_case(256, 300, seed=3)
    xt, st = x.t().contiguous().t(), s.t().contiguous().t()  # same values, column-major storage
    assert_bits_equal(weight_dequant_cpu(xt, st), weight_dequant_reference(x, s))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.usefixtures("cpu_path")
def test_cpu_writes_into_preallocated_out(out_dtype):
    x, s = random_case(129, 257, seed=11)
    out = torch.full((129, 257), 7.0, dtype=out_dtype)
    ptr = out.data_ptr()
    got = weight_dequant_cpu(x, s, out=out, out_dtype=out_dtype)
    assert got is out and out.data_ptr() == ptr
    assert_bits_equal(out, weight_dequant_reference(x, s, out_dtype=out_dtype))


@pytest.mark.usefixtures("cpu_path")
def test_cpu_writes_into_bytearray_view():
    x, s = random_case(200, 320, seed=12)
    nbytes = 200 * 320 * 2
    buf = bytearray(16 + nbytes + 16)
    out = torch.frombuffer(buf, dtype=torch.bfloat16, offset=16, count=200 * 320).view(200, 320)
    weight_dequant_cpu(x, s, out=out)
    want = weight_dequant_reference(x, s)
    assert bytes(buf[16:16 + nbytes]) == want.view(torch.uint8).numpy().tobytes()
    assert buf[:16] == bytes(16) and buf[-16:] == bytes(16)  # nothing written outside the view


@pytest.mark.usefixtures("cpu_path")
def test_cpu_writes_into_mmap_view():
    x, s = random_case(300, 7, seed=13)
    mm = mmap.mmap(-1, 8192)  # anonymous: nothing lands in the working tree
    out = torch.frombuffer(mm, dtype=torch.bfloat16, count=300 * 7).view(300, 7)
    assert weight_dequant_cpu(x, s, out=out) is out
    want = weight_dequant_reference(x, s).view(torch.uint8).numpy().tobytes()
    del out  # release the exported buffer before closing the map
    assert mm[: len(want)] == want and mm[len(want):] == bytes(8192 - len(want))
    mm.close()


def test_weight_dequant_dispatches_to_cpu():
    x, s = random_case(200, 320, seed=14)
    want = weight_dequant_reference(x, s)
    assert_bits_equal(weight_dequant(x, s, device="cpu"), want)
    out = torch.empty(200, 320, dtype=torch.bfloat16)
    assert weight_dequant(x, s, out=out, device=torch.device("cpu")) is out
    assert_bits_equal(out, want)
    if not torch.cuda.is_available():
        assert_bits_equal(weight_dequant(x, s), want)

