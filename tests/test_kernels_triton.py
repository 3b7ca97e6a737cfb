"""The FP8 Triton kernel, one weight or a stack of experts in one launch: under TRITON_INTERPRET=1 and on a CUDA
GPU (native fp8 conversion and integer decode alike), bit-identical to the reference (bf16 NaN bits too), and
never imported with the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError
from expertd.kernels import (
    weight_dequant,
    weight_dequant_batched_triton,
    weight_dequant_reference,
    weight_dequant_triton,
)
from helpers.kernel_cases import NAME, OUT_DTYPES, all_bytes_case, assert_bits_equal, needs_cuda, random_case


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


def _interpret(script: str, *args: str) -> list[dict]:
    """Run `script` in a child process under TRITON_INTERPRET=1 (so the setting cannot leak); its RESULTS line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(text for text in proc.stdout.splitlines() if text.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


def test_triton_interpreter_matches_reference():
    """The Triton kernel under TRITON_INTERPRET=1."""
    results = _interpret(_INTERPRETER_SCRIPT, json.dumps(_INTERPRETER_CASES))
    assert len(results) == len(_INTERPRETER_CASES)
    for r in results:
        assert r["is_out"], r
        assert r["same_nan"] and r["finite_exact"], r
        if r["case"][3] == "bfloat16":  # bf16 NaN bits match too
            assert r["exact"], r
    assert any(r["has_nan"] for r in results)


_BATCHED_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from expertd.kernels import weight_dequant_batched_triton, weight_dequant_reference, weight_dequant_triton
    from expertd.kernels.reference import as_block, scale_shape
    from expertd.kernels.triton_dequant import Tiling, _scale_plan, launch_dequant, tiling
    FP8 = torch.float8_e4m3fn
    results = []
    for e, m, n, block, out_dtype, kind, tile in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(e * 1000 + m)
        dt = getattr(torch, out_dtype)
        sh = scale_shape(m, n, block)
        if kind == "all_bytes":  # every byte in every row, under scales from 2**-130 (subnormal results) to 2**126
            row = torch.arange(256, dtype=torch.uint8)
            x = torch.stack([torch.stack([row.roll(i + 7 * k) for i in range(m)])[:, :n] for k in range(e)])
            s = torch.stack([torch.exp2(torch.linspace(-130, 126, sh[0] * sh[1]).round().view(sh)).roll(k)
                             for k in range(e)]) * 1.3
        else:
            x = torch.randint(0, 256, (e, m, n), dtype=torch.uint8, generator=g)
            s = torch.rand(e, *sh, generator=g) * 1e-2
        x, s = x.view(FP8).contiguous(), s.float().contiguous()
        want = [weight_dequant_reference(x[k], s[k], block, out_dtype=dt) for k in range(e)]
        out = torch.full((e, m, n), 3.0, dtype=dt)
        if tile is None:
            got = weight_dequant_batched_triton(x, s, block, out=out, out_dtype=dt)
            single = [weight_dequant_triton(x[k], s[k], block, out_dtype=dt) for k in range(e)]
        else:
            tile = Tiling(*tile)
            launch_dequant(x, s, out, e, m, n, block, tile=tile)
            got, single = out, list(out)
        iv = torch.int32 if dt == torch.float32 else torch.int16
        nan = [torch.isnan(w.float()) for w in want]
        rows, cols = as_block(block)
        mode = _scale_plan(m, n, rows, cols, tile or tiling(m, n, e))[2]
        results.append(dict(
            case=[e, m, n, block, out_dtype, kind, tile], is_out=got is out, mode=mode,
            exact=all(torch.equal(got[k].view(iv), want[k].view(iv)) for k in range(e)),
            same_nan=all(torch.equal(torch.isnan(got[k].float()), nan[k]) for k in range(e)),
            finite_exact=all(torch.equal(got[k].masked_fill(nan[k], 0).view(iv),
                                         want[k].masked_fill(nan[k], 0).view(iv)) for k in range(e)),
            single_exact=all(torch.equal(single[k].view(iv), got[k].view(iv)) for k in range(e)),
            has_nan=any(bool(v.any()) for v in nan)))
    print("RESULTS" + json.dumps(results))
    """
)

# (experts, m, n, block, out_dtype, kind, tile or None for the default): every scale mode, masked and not
_BATCHED_CASES = [
    (3, 200, 320, 128, "bfloat16", "random", None),  # partial blocks, one scale per tile
    (3, 70, 50, [1, 50], "bfloat16", "random", None),  # compressed-tensors per channel: one scale per row
    (2, 70, 50, [70, 50], "bfloat16", "random", None),  # per tensor
    (2, 200, 320, [128, 32], "float16", "random", None),  # one scale per column of a tile
    (2, 300, 260, 100, "bfloat16", "random", None),  # blocks not powers of two: a scale per element
    (2, 256, 256, 16, "bfloat16", "all_bytes", None),
    (2, 256, 256, 16, "float16", "all_bytes", None),
    (2, 256, 256, 16, "float32", "all_bytes", None),
    (1, 1, 1, 128, "bfloat16", "random", None),
    (0, 5, 5, 128, "bfloat16", "random", None),
    (2, 200, 320, 128, "bfloat16", "random", [64, 128, 4]),  # the benchmark's tile sweep
    (2, 200, 320, 128, "bfloat16", "random", [32, 256, 4]),
]


def test_triton_interpreter_batched_matches_reference():
    """A stack of experts in one launch under TRITON_INTERPRET=1: each expert bit for bit its reference and the
    one-weight kernel."""
    results = _interpret(_BATCHED_SCRIPT, json.dumps(_BATCHED_CASES))
    assert len(results) == len(_BATCHED_CASES)
    for r in results:
        assert r["is_out"] or r["case"][-1] is not None, r
        assert r["same_nan"] and r["finite_exact"] and r["single_exact"], r
        if r["case"][4] == "bfloat16":
            assert r["exact"], r
    assert {r["mode"] for r in results} == {0, 1, 2, 3}
    assert any(r["has_nan"] for r in results)


def test_batched_checks_name_the_tensor():
    x, s = random_case(64, 32)
    xs, ss = x.unsqueeze(0).expand(2, 64, 32), s.unsqueeze(0).expand(2, 1, 1)
    cases = [
        (UnsupportedDtypeError, "expected a torch.float8_e4m3fn tensor", (xs.view(torch.uint8), ss), {}),
        (ShapeError, r"3-D \[experts, M, N\]", (x, s), {}),
        (ScaleError, r"expected a torch.float32 tensor", (xs, ss.double()), {}),
        (ScaleError, r"scale_inv has shape \[2, 1\], expected \[2, 1, 1\]", (xs, ss[:, 0]), {}),
        (ScaleError, r"block_size", (xs, ss), {"block_size": 0}),
        (ShapeError, r"out has shape \[2, 64, 31\], expected \[2, 64, 32\]", (xs, ss),
         {"out": torch.empty(2, 64, 31, dtype=torch.bfloat16)}),
        (ShapeError, r"expected a torch.float16 tensor", (xs, ss),
         {"out": torch.empty(2, 64, 32, dtype=torch.bfloat16), "out_dtype": torch.float16}),
        (ShapeError, "contiguous", (xs, ss), {"out": torch.empty(2, 32, 64, dtype=torch.bfloat16).transpose(1, 2)}),
        (UnsupportedDtypeError, "out_dtype", (xs, ss), {"out_dtype": torch.int8}),
    ]
    for error, match, args, kwargs in cases:
        with pytest.raises(error, match=match) as info:
            weight_dequant_batched_triton(*args, name=NAME, **kwargs)
        assert NAME in str(info.value)
    assert isinstance(info.value, ValueError)


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


@pytest.fixture(params=["native", "integer"])
def gpu_path(request, monkeypatch):
    """A GPU test once with the GPU's own conversions (fp8 -> float32 on sm_89+, float32 -> bf16) and once with
    the integer decode and rounding the interpreter runs (EXPERTD_TRITON_NATIVE=0)."""
    if request.param == "integer":
        monkeypatch.setenv("EXPERTD_TRITON_NATIVE", "0")
    else:
        monkeypatch.delenv("EXPERTD_TRITON_NATIVE", raising=False)
    return request.param


@needs_cuda
def test_triton_gpu_picks_the_native_path(monkeypatch):
    from expertd.kernels.triton_dequant import conversions

    monkeypatch.delenv("EXPERTD_TRITON_NATIVE", raising=False)
    assert conversions(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (8, 9), True)
    monkeypatch.setenv("EXPERTD_TRITON_NATIVE", "0")
    assert conversions(torch.device("cuda")) == (False, False)


@needs_cuda
@pytest.mark.parametrize("shape,block", [((200, 320), 128), ((130, 70), 64), ((7168, 2048), 128), ((129, 257), 128),
                                         ((33, 50), 100), ((300, 260), 100), ((200, 320), (128, 32))])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_gpu_matches_reference(shape, block, out_dtype, gpu_path):
    x, s = random_case(*shape, block=block, seed=21)
    want = weight_dequant_reference(x, s, block, out_dtype=out_dtype)
    got = weight_dequant_triton(x.cuda(), s.cuda(), block, out_dtype=out_dtype).cpu()
    # GPU float32 math returns a canonical NaN, so fp16/fp32 NaN payloads differ; bf16 NaN bits are fixed
    assert_bits_equal(got, want, nan_payload=out_dtype == torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_gpu_all_256_bytes(out_dtype, gpu_path):
    x, s = all_bytes_case(-100, 100)  # every product a normal float32
    got = weight_dequant_triton(x.cuda(), s.cuda(), 16, out_dtype=out_dtype).cpu()
    assert_bits_equal(got, weight_dequant_reference(x, s, 16, out_dtype=out_dtype),
                      nan_payload=out_dtype == torch.bfloat16)


@needs_cuda
def test_triton_gpu_extreme_scales(gpu_path):
    """Scales down to 2**-140 and up to 2**127: fails if the GPU flushes float32 subnormals."""
    for x, s, block in [(*all_bytes_case(), 16), (*random_case(576, 200, block=64, seed=23, scales="extreme"), 64),
                        (*random_case(7168, 2048, block=128, seed=24, scales="extreme"), 128)]:
        got = weight_dequant_triton(x.cuda(), s.cuda(), block).cpu()
        assert_bits_equal(got, weight_dequant_reference(x, s, block))


@needs_cuda
@pytest.mark.parametrize("experts,shape,block", [(3, (7168, 2048), 128), (5, (200, 320), 128), (3, (70, 50), (1, 50)),
                                                 (2, (576, 7168), (576, 7168)), (2, (576, 200), 64)])
def test_triton_gpu_batched_matches_reference(experts, shape, block, gpu_path):
    cases = [random_case(*shape, block=block, seed=30 + k, scales="extreme" if k % 2 else "normal")
             for k in range(experts)]
    x, s = torch.stack([c[0] for c in cases]), torch.stack([c[1] for c in cases])
    got = weight_dequant_batched_triton(x.cuda(), s.cuda(), block).cpu()
    for k, (xk, sk) in enumerate(cases):
        assert_bits_equal(got[k], weight_dequant_reference(xk, sk, block))


@needs_cuda
def test_weight_dequant_gpu_into_cpu_out():
    x, s = random_case(576, 200, seed=22)
    out = torch.empty(576, 200, dtype=torch.bfloat16)
    assert weight_dequant(x, s, out=out, name=NAME) is out  # device None + CUDA available -> GPU
    assert_bits_equal(out, weight_dequant_reference(x, s))
    y = weight_dequant(x, s, device="cuda")
    assert y.is_cuda
    assert_bits_equal(y.cpu(), weight_dequant_reference(x, s))
