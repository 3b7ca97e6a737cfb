"""MXFP4 (gpt-oss `*_blocks` / `*_scales`) dequant: every path bit for bit transformers' decode, the
loader's partial-group chunks, the encoder, bad inputs, and a gpt_oss checkpoint rewritten in the MXFP4
release layout that transformers itself loads."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from expertd.errors import ScaleError, ShapeError, UnsupportedDtypeError
from expertd.kernels import mxfp4 as M
from expertd.kernels import native
from expertd.kernels.mxfp4 import (
    dequant_mxfp4,
    dequant_mxfp4_groups,
    dequant_mxfp4_reference,
    dequant_mxfp4_triton,
    mxfp4_table,
    quantize_mxfp4,
)

NAME = "model.layers.0.mlp.experts.gate_up_proj"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def transformers_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16
    assert got.shape == want.shape
    diff = bits(got) != bits(want)
    assert not bool(diff.any()), f"{int(diff.sum())} results differ, first at {diff.nonzero()[0].tolist()}"


def every_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [1, 256, 16, 16] and scales [1, 256, 16]: row s holds every byte 0..255 (its 16 groups) under
    scale byte s, so the result covers every (scale, low code) and (scale, high code) pair, each byte too."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    return blocks, scales


def random_case(*lead: int, rows: int, groups: int, seed: int = 0, lo: int = 0, hi: int = 256):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(lo, hi, (*lead, rows, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.fixture(params=["native-simd", "native-simd-stream", "native-scalar", "torch"])
def cpu_path(request, monkeypatch):
    """Run a CPU test on the compiled gather (SSSE3/AVX2, with its non-temporal stores at any size, and the
    scalar loop) and on the pure-torch path."""
    if request.param.startswith("native"):
        if not native.available():
            pytest.fail("the native CPU dequant could not be built (is a C compiler installed?)")
        simd = request.param.startswith("native-simd")
        before, stream_before = native.mxfp4_simd(), native.mxfp4_stream_min()
        if native.mxfp4_simd(simd) != simd:
            pytest.skip("this CPU has no SSSE3 (the scalar loop is tested by native-scalar)")
        if request.param.endswith("stream"):
            native.mxfp4_stream_min(0)
        yield request.param
        native.mxfp4_simd(before)
        native.mxfp4_stream_min(stream_before)
    else:
        monkeypatch.setattr(native, "available", lambda: False)
        yield request.param


# --- the table, and every (scale, code) pair -------------------------------------------------------------


def test_fp4_values_are_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert tuple(FP4_VALUES) == M.FP4_VALUES


def test_table_is_transformers_decode_of_every_pair():
    """mxfp4_table()[s, c] is what transformers decodes for code c under scale s, all 256 x 16 of them."""
    blocks, scales = every_pair()
    want = transformers_decode(blocks, scales)[0]  # [16 groups * 32, 256 scales]
    table = mxfp4_table()
    assert table.shape == (256, 16) and table.dtype == torch.bfloat16
    byte = torch.arange(256)  # at group byte // 16, position byte % 16: results 2 * byte and 2 * byte + 1
    for s in range(256):
        assert torch.equal(bits(want[2 * byte, s]), bits(table[s, byte & 15])), s
        assert torch.equal(bits(want[2 * byte + 1, s]), bits(table[s, byte >> 4])), s
    # both nibbles of the bytes cover every code, and the values are the e8m0 * e2m1 products (no NaN)
    assert not bool(table.isnan().any())
    assert table[127].tolist() == list(M.FP4_VALUES)
    assert mxfp4_table(torch.float32).dtype == torch.float32


def test_every_pair_every_cpu_path(cpu_path):
    blocks, scales = every_pair()
    want = transformers_decode(blocks, scales)
    assert_bits_equal(dequant_mxfp4(blocks, scales, device="cpu"), want)
    assert_bits_equal(dequant_mxfp4(blocks, scales, device="cpu", threads=2), want)


def test_every_pair_reference():
    blocks, scales = every_pair()
    assert_bits_equal(dequant_mxfp4_reference(blocks, scales), transformers_decode(blocks, scales))


# --- random multi-expert tensors ----------------------------------------------------------------------------

CASES = [((4,), 70, 5), ((3,), 33, 2), ((2,), 1, 1), ((5,), 200, 3), ((1,), 129, 4), ((2,), 15, 7)]


@pytest.mark.parametrize("lead,rows,groups", CASES)
def test_random_experts_match_transformers(cpu_path, lead, rows, groups):
    blocks, scales = random_case(*lead, rows=rows, groups=groups, seed=rows)
    want = transformers_decode(blocks, scales)
    assert want.shape == (*lead, groups * 32, rows)
    assert_bits_equal(dequant_mxfp4_reference(blocks, scales), want)
    for threads in (1, 2, 3):
        assert_bits_equal(dequant_mxfp4(blocks, scales, device="cpu", threads=threads), want)
    out = torch.full_like(want, 7.0)
    assert dequant_mxfp4(blocks, scales, out, device="cpu") is out
    assert_bits_equal(out, want)


def test_realistic_scales_many_experts(cpu_path):
    """gpt-oss-like scales (around 2**-10 .. 2**3), more experts than threads."""
    blocks, scales = random_case(9, rows=96, groups=3, seed=5, lo=117, hi=131)
    assert_bits_equal(dequant_mxfp4(blocks, scales, device="cpu", threads=2), transformers_decode(blocks, scales))


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["one-expert", "two-leading-dims"])
def test_other_leading_dims(cpu_path, lead):
    """Any leading dims: the last two of the result are [G*32, R] (what transformers gives for [E, R, G, 16])."""
    blocks, scales = random_case(*lead, rows=37, groups=2, seed=3)
    want = transformers_decode(blocks.reshape(-1, 37, 2, 16), scales.reshape(-1, 37, 2)).reshape(*lead, 64, 37)
    got = dequant_mxfp4(blocks, scales, device="cpu")
    assert got.shape == (*lead, 64, 37)
    assert_bits_equal(got, want)
    assert_bits_equal(dequant_mxfp4_reference(blocks, scales), want)


def test_empty_and_non_contiguous_inputs(cpu_path):
    blocks, scales = random_case(0, rows=5, groups=2)
    assert dequant_mxfp4(blocks, scales, device="cpu").shape == (0, 64, 5)
    blocks, scales = random_case(4, rows=40, groups=3, seed=9)
    want = transformers_decode(blocks[::2].contiguous(), scales[::2].contiguous())
    assert_bits_equal(dequant_mxfp4(blocks[::2], scales[::2], device="cpu"), want)


def test_without_the_compiled_loop_in_a_fresh_process():
    """EXPERTD_NATIVE=0: nothing is built and the torch path gives the same bits."""
    code = (
        "import torch\n"
        "from expertd.kernels import native\n"
        "from expertd.kernels.mxfp4 import dequant_mxfp4, dequant_mxfp4_reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "b = torch.randint(0, 256, (3, 45, 4, 16), dtype=torch.uint8, generator=g)\n"
        "s = torch.randint(0, 256, (3, 45, 4), dtype=torch.uint8, generator=g)\n"
        "y = dequant_mxfp4(b, s, device='cpu')\n"
        "print(native.available(), torch.equal(y.view(torch.int16), dequant_mxfp4_reference(b, s).view(torch.int16)))\n"
    )
    env = {**os.environ, "EXPERTD_NATIVE": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["False", "True"]


# --- the loader's chunks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("g0,g1", [(0, 6), (0, 1), (2, 5), (5, 6), (3, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_groups_partial_ranges(cpu_path, g0, g1, threads):
    blocks, scales = random_case(rows=45, groups=6, seed=11)
    full = transformers_decode(blocks.unsqueeze(0), scales.unsqueeze(0))[0]
    buf = torch.full((8 * 32 + 6 * 32 * 45,), 3.0, dtype=torch.bfloat16)  # stands for a mapped buffer
    out = buf[256 : 256 + (g1 - g0) * 32 * 45].view((g1 - g0) * 32, 45)
    assert dequant_mxfp4_groups(blocks, scales, g0, g1, out, threads=threads) is out
    assert_bits_equal(out, full[g0 * 32 : g1 * 32])
    rest = torch.cat((buf[:256], buf[256 + (g1 - g0) * 32 * 45 :]))
    assert bool((rest == 3.0).all()), "wrote outside its rows"


def test_groups_chunks_from_threads_assemble_the_expert():
    """Loader threads each fill a chunk of one buffer at once (the compiled loop drops the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    blocks, scales = random_case(rows=300, groups=9, seed=12)
    out = torch.empty(9 * 32, 300, dtype=torch.bfloat16)
    ranges = [(0, 2), (2, 3), (3, 7), (7, 9)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda r: dequant_mxfp4_groups(blocks, scales, r[0], r[1], out[r[0] * 32 : r[1] * 32]), ranges))
    assert_bits_equal(out, transformers_decode(blocks.unsqueeze(0), scales.unsqueeze(0))[0])


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
                                                      name=NAME), ShapeError, r"group range \[2, 4\) is not within \[0, 3\)"),
        ("groups-out", lambda: dequant_mxfp4_groups(b[0], s[0], 1, 3, torch.empty(32, 8, dtype=torch.bfloat16),
                                                    name=NAME), ShapeError, r"out has shape \[32, 8\], expected \[64, 8\]"),
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


def test_triton_refuses_cpu_tensors_without_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set in this process")
    b, s = random_case(1, rows=4, groups=1)
    with pytest.raises(ValueError, match="CUDA"):
        dequant_mxfp4_triton(b, s)


# --- Triton ----------------------------------------------------------------------------------------------------

_INTERPRETER_SCRIPT = r"""
import json, sys, torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from expertd.kernels.mxfp4 import dequant_mxfp4_triton, dequant_mxfp4_reference
results = []
blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
cases = [("every-pair", blocks, scales)]
g = torch.Generator().manual_seed(0)
for lead, rows, groups in [((3,), 70, 3), ((2,), 129, 2), ((1,), 1, 1), ((), 37, 2)]:
    b = torch.randint(0, 256, (*lead, rows, groups, 16), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (*lead, rows, groups), dtype=torch.uint8, generator=g)
    cases.append((f"{lead}-{rows}-{groups}", b, s))
for name, b, s in cases:
    want = dequant_mxfp4_reference(b, s)
    out = torch.empty_like(want)
    got = dequant_mxfp4_triton(b, s, out)
    tf = want if b.dim() < 4 else convert_moe_packed_tensors(b, s)
    results.append(dict(case=name, is_out=got is out,
                        exact=bool(torch.equal(got.view(torch.int16), want.view(torch.int16))),
                        transformers=bool(torch.equal(got.view(torch.int16), tf.view(torch.int16)))))
print("RESULTS" + json.dumps(results))
"""


@needs_triton
def test_triton_interpreter_matches_transformers():
    """The Triton kernel under TRITON_INTERPRET=1, in a child process so the setting cannot leak."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS"))[len("RESULTS"):])
    assert len(results) == 5
    for r in results:
        assert r["is_out"] and r["exact"] and r["transformers"], r


@needs_cuda
@needs_triton
@pytest.mark.parametrize("lead,rows,groups", [((32,), 2880, 90), *CASES])
def test_triton_gpu_matches_transformers(lead, rows, groups):
    blocks, scales = random_case(*lead, rows=rows, groups=groups, seed=rows)
    want = transformers_decode(blocks, scales)
    assert_bits_equal(dequant_mxfp4_triton(blocks.cuda(), scales.cuda()).cpu(), want)
    assert_bits_equal(dequant_mxfp4(blocks, scales, device="cuda").cpu(), want)
    out = torch.empty_like(want)
    assert dequant_mxfp4(blocks, scales, out, device="cuda") is out
    assert_bits_equal(out, want)


@needs_cuda
@needs_triton
def test_triton_gpu_every_pair():
    blocks, scales = every_pair()
    assert_bits_equal(dequant_mxfp4_triton(blocks.cuda(), scales.cuda()).cpu(), transformers_decode(blocks, scales))


# --- a gpt_oss checkpoint in the MXFP4 release layout -----------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_folders(tmp_path_factory):
    """(bf16 folder, the same rewritten as MXFP4, what write_mxfp4 wrote)."""
    from expertd.server.tools.generate import generate_model_type
    from expertd.server.tools.requantize import write_mxfp4

    base = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    bf16, mx = str(base / "bf16"), str(base / "mxfp4")
    generate_model_type(bf16, "gpt_oss", fp8=False)
    shutil.copytree(bf16, mx)
    written = write_mxfp4(mx)
    return bf16, mx, written


def _checkpoint(folder: str) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    found = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(os.path.join(folder, file), "pt") as f:
            for name in f.keys():
                found[name] = (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
                assert weight_map[name] == file, name
    assert set(found) == set(weight_map)
    return found


def test_write_mxfp4_layout(gpt_oss_folders):
    bf16, mx, written = gpt_oss_folders
    before, after = _checkpoint(bf16), _checkpoint(mx)
    with open(os.path.join(mx, "config.json")) as f:
        config = json.load(f)
    e, h, i = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        assert before[p + "gate_up_proj"] == ("BF16", [e, h, 2 * i])
        assert before[p + "down_proj"] == ("BF16", [e, i, h])
        assert after[p + "gate_up_proj_blocks"] == ("U8", [e, 2 * i, h // 32, 16])
        assert after[p + "gate_up_proj_scales"] == ("U8", [e, 2 * i, h // 32])
        assert after[p + "down_proj_blocks"] == ("U8", [e, h, i // 32, 16])
        assert after[p + "down_proj_scales"] == ("U8", [e, h, i // 32])
        assert after[p + "gate_up_proj_bias"] == before[p + "gate_up_proj_bias"]
        assert after[p + "down_proj_bias"] == before[p + "down_proj_bias"]
        assert p + "gate_up_proj" not in after and p + "down_proj" not in after
    quantized = {n for n in before if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert set(written) == quantized
    assert {n: v for n, v in before.items() if n not in quantized} == \
        {n: v for n, v in after.items() if not n.endswith(("_blocks", "_scales"))}
    assert config["quantization_config"] == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    with open(os.path.join(mx, "model.safetensors.index.json")) as f:
        total = json.load(f)["metadata"]["total_size"]
    sizes = {"BF16": 2, "U8": 1, "F32": 4}
    assert total == sum(sizes[d] * torch.Size(s).numel() for d, s in after.values())


@pytest.mark.parametrize("how", ["plain", "Mxfp4Config-dequantize"])
def test_transformers_loads_mxfp4_checkpoint(gpt_oss_folders, how):
    """transformers' own from_pretrained on the CPU dequantizes the experts to bf16 [E, H, 2I] / [E, I, H],
    each bit for bit dequant_mxfp4 of the stored blocks and scales, and its logits are those of the bf16
    model given these dequantized weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Mxfp4Config

    bf16, mx, written = gpt_oss_folders
    if how == "plain":
        if torch.cuda.is_available() or getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
            pytest.skip("with an accelerator transformers would run MXFP4 kernels instead of dequantizing")
        model = AutoModelForCausalLM.from_pretrained(mx)
    else:
        model = AutoModelForCausalLM.from_pretrained(mx, quantization_config=Mxfp4Config(dequantize=True),
                                                     device_map="cpu")
    model.eval()
    with open(os.path.join(mx, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]

    def stored(name):
        with safe_open(os.path.join(mx, weight_map[name]), "pt") as f:
            return f.get_tensor(name)

    reference = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    reference.eval()
    assert written
    for name, (blocks, scales) in written.items():
        assert torch.equal(stored(name + "_blocks"), blocks) and torch.equal(stored(name + "_scales"), scales)
        param = model.get_parameter(name)
        assert param.dtype == torch.bfloat16 and param.device.type == "cpu"
        assert_bits_equal(param.data, dequant_mxfp4(blocks, scales, device="cpu"))
        original = reference.get_parameter(name)
        assert param.shape == original.shape
        with torch.no_grad():
            original.copy_(param)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    tokens = torch.tensor([[0, 5, 17, 99, 250, 3, 42, 7]])
    with torch.no_grad():
        got, want = model(tokens).logits, reference(tokens).logits
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
