"""Dequant kernels: every path bit-identical to the plain-torch reference, and strict argument checks."""

from __future__ import annotations

import json
import math
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import expertd.kernels.cpu as cpu_mod
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

FP8 = torch.float8_e4m3fn
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(200, 320), (576, 200), (1, 1), (129, 257), (128, 128), (300, 7)]
NAME = "model.layers.3.mlp.experts.7.up_proj.weight"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")



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

def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, nan_payload: bool = True) -> None:
    """Bit-for-bit, NaN patterns included; nan_payload=False only requires NaN in the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if not nan_payload:
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got.float()), nan)
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


@pytest.mark.parametrize("fn", [weight_dequant_cpu, weight_dequant_triton, weight_dequant], ids=["cpu", "triton", "dispatch"])
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
    bound = w.abs() * 2.0**-4 + 2.0**-10 * s.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]
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


# ---------------------------------------------------------------------------------------------- Triton

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from expertd.kernels import weight_dequant_reference, weight_dequant_triton, scale_shape
    FP8 = torch.float8_e4m3fn
    results = []
    for m, n, block, out_dtype, seed, kind in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(seed)
        dt = getattr(torch, out_dtype)
        if kind == "all_bytes":
            row = torch.arange(256, dtype=torch.uint8)
            x = torch.stack([row.roll(i) for i in range(m)])[:, :n].contiguous().view(FP8)
            sh = scale_shape(m, n, block)
            s = torch.exp2(torch.linspace(-130, 126, sh[0] * sh[1]).round().view(sh)) * 1.3
        else:
            x = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=g).view(FP8)
            s = torch.rand(scale_shape(m, n, block), generator=g) * 1e-2
        s = s.float().contiguous()
        want = weight_dequant_reference(x, s, block, out_dtype=dt)
        out = torch.full((m, n), 3.0, dtype=dt)
        got = weight_dequant_triton(x, s, block, out=out, out_dtype=dt)
        iv = torch.int32 if dt == torch.float32 else torch.int16
        nan = torch.isnan(want.float())
        same_nan = torch.equal(torch.isnan(got.float()), nan)
        exact = torch.equal(got.view(iv), want.view(iv))
        finite_exact = torch.equal(got.masked_fill(nan, 0).view(iv), want.masked_fill(nan, 0).view(iv))
        results.append(dict(case=[m, n, block, out_dtype, kind], is_out=got is out, same_nan=same_nan,
                            exact=exact, finite_exact=finite_exact, has_nan=bool(nan.any())))
    print("RESULTS" + json.dumps(results))
    """
)

# (m, n, block, out_dtype, seed, kind): small, as the interpreter runs every program in numpy
_INTERPRETER_CASES = [
    (200, 320, 128, "bfloat16", 0, "random"),
    (130, 70, 64, "bfloat16", 1, "random"),
    (33, 50, 100, "bfloat16", 2, "random"),  # block not a power of two: per-element scale gather
    (256, 256, 16, "bfloat16", 0, "all_bytes"),  # every byte under scales from 2**-130 to 2**126
    (256, 256, 16, "float16", 0, "all_bytes"),
    (256, 256, 16, "float32", 0, "all_bytes"),
    (1, 1, 128, "bfloat16", 3, "random"),
    (129, 257, 128, "float16", 4, "random"),
    (70, 50, [1, 50], "bfloat16", 5, "random"),  # compressed-tensors per channel
    (70, 50, [70, 50], "bfloat16", 6, "random"),  # per tensor
    (130, 70, [64, 32], "bfloat16", 7, "random"),  # a rectangular block: tiles inside it
]


def test_triton_interpreter_matches_reference():
    """The Triton kernel under TRITON_INTERPRET=1, in a child process so the setting cannot leak."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT, json.dumps(_INTERPRETER_CASES)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS"))
    results = json.loads(line[len("RESULTS"):])
    assert len(results) == len(_INTERPRETER_CASES)
    for r in results:
        assert r["is_out"], r
        assert r["same_nan"] and r["finite_exact"], r
        if r["case"][3] == "bfloat16":  # bf16 NaN bits match too
            assert r["exact"], r
    assert any(r["has_nan"] for r in results)


def test_importing_kernels_does_not_import_triton():
    code = "import sys, expertd.kernels; print('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_triton_refuses_cpu_tensors_without_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set in this process")
    x, s = random_case(8, 8)
    with pytest.raises(ValueError, match="CUDA"):
        weight_dequant_triton(x, s)


@needs_cuda
@pytest.mark.parametrize("shape,block", [((200, 320), 128), ((130, 70), 64), ((7168, 2048), 128), ((129, 257), 128), ((33, 50), 100)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_gpu_matches_reference(shape, block, out_dtype):
    x, s = random_case(*shape, block=block, seed=21)
    want = weight_dequant_reference(x, s, block, out_dtype=out_dtype)
    got = weight_dequant_triton(x.cuda(), s.cuda(), block, out_dtype=out_dtype).cpu()
    # GPU float32 math returns a canonical NaN, so fp16/fp32 NaN payloads differ; bf16 NaN bits are fixed
    assert_bits_equal(got, want, nan_payload=out_dtype == torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_gpu_all_256_bytes(out_dtype):
    x, s = all_bytes_case(-100, 100)  # every product a normal float32
    got = weight_dequant_triton(x.cuda(), s.cuda(), 16, out_dtype=out_dtype).cpu()
    assert_bits_equal(got, weight_dequant_reference(x, s, 16, out_dtype=out_dtype), nan_payload=out_dtype == torch.bfloat16)


@needs_cuda
def test_triton_gpu_extreme_scales():
    """Scales down to 2**-140 and up to 2**127: fails if the GPU flushes float32 subnormals."""
    for x, s, block in [(*all_bytes_case(), 16), (*random_case(576, 200, block=64, seed=23, scales="extreme"), 64)]:
        got = weight_dequant_triton(x.cuda(), s.cuda(), block).cpu()
        assert_bits_equal(got, weight_dequant_reference(x, s, block))


@needs_cuda
def test_weight_dequant_gpu_into_cpu_out():
    x, s = random_case(576, 200, seed=22)
    out = torch.empty(576, 200, dtype=torch.bfloat16)
    assert weight_dequant(x, s, out=out, name=NAME) is out  # device None + CUDA available -> GPU
    assert_bits_equal(out, weight_dequant_reference(x, s))
    y = weight_dequant(x, s, device="cuda")
    assert y.is_cuda
    assert_bits_equal(y.cpu(), weight_dequant_reference(x, s))
