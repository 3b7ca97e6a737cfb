"""The FP8 Triton kernel: under TRITON_INTERPRET=1 and on a CUDA GPU, bit-identical to the reference (bf16
NaN bits too), and never imported with the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from expertd.kernels import weight_dequant, weight_dequant_reference, weight_dequant_triton
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


def test_triton_interpreter_matches_reference():
    """The Triton kernel under TRITON_INTERPRET=1, in a child process so the setting cannot leak."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT, json.dumps(_INTERPRETER_CASES)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(text for text in proc.stdout.splitlines() if text.startswith("RESULTS"))
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
@pytest.mark.parametrize("shape,block", [((200, 320), 128), ((130, 70), 64), ((7168, 2048), 128), ((129, 257), 128),
                                         ((33, 50), 100)])
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
    assert_bits_equal(got, weight_dequant_reference(x, s, 16, out_dtype=out_dtype),
                      nan_payload=out_dtype == torch.bfloat16)


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
