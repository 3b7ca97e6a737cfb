"""MXFP4 (gpt-oss `*_blocks` / `*_scales`) dequant on the CPU: every path bit for bit transformers' decode,
and the loader's partial-group chunks. The encoder and bad inputs: test_mxfp4_encoder.py; Triton:
test_mxfp4_triton.py; a checkpoint in the release layout: test_mxfp4_release.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from expertd.kernels import mxfp4 as M
from expertd.kernels import native
from expertd.kernels.mxfp4 import dequant_mxfp4, dequant_mxfp4_groups, dequant_mxfp4_reference, mxfp4_table
from helpers.mxfp4_cases import CASES, assert_bits_equal, bits, every_pair, random_case, transformers_decode


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
