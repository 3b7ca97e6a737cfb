"""The MXFP4 Triton kernel: refused on CPU tensors, bit for bit transformers' decode under TRITON_INTERPRET=1
and on a CUDA GPU, every expert of a stack in one launch, under every tiling the benchmark tries."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from expertd.kernels.mxfp4 import dequant_mxfp4, dequant_mxfp4_triton
from helpers.kernel_cases import needs_cuda, needs_triton
from helpers.mxfp4_cases import CASES, assert_bits_equal, every_pair, random_case, transformers_decode


# --- Triton ----------------------------------------------------------------------------------------------------


def test_triton_refuses_cpu_tensors_without_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set in this process")
    b, s = random_case(1, rows=4, groups=1)
    with pytest.raises(ValueError, match="CUDA"):
        dequant_mxfp4_triton(b, s)


_INTERPRETER_SCRIPT = r"""
import json, sys, torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from expertd.kernels.mxfp4 import Mxfp4Tiling, dequant_mxfp4_triton, dequant_mxfp4_reference, launch_mxfp4
results = []
blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
cases = [("every-pair", blocks, scales)]
g = torch.Generator().manual_seed(0)
for lead, rows, groups in [((3,), 70, 3), ((2,), 129, 2), ((1,), 1, 1), ((), 37, 2), ((2, 3), 33, 5), ((2,), 128, 8)]:
    b = torch.randint(0, 256, (*lead, rows, groups, 16), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (*lead, rows, groups), dtype=torch.uint8, generator=g)
    cases.append((f"{lead}-{rows}-{groups}", b, s))
for name, b, s in cases:
    want = dequant_mxfp4_reference(b, s)
    out = torch.empty_like(want)
    got = dequant_mxfp4_triton(b, s, out)
    tf = want if b.dim() != 4 else convert_moe_packed_tensors(b, s)  # transformers: [E, R, G, 16] only
    results.append(dict(case=name, is_out=got is out,
                        exact=bool(torch.equal(got.view(torch.int16), want.view(torch.int16))),
                        transformers=bool(torch.equal(got.view(torch.int16), tf.view(torch.int16)))))
for tile in [(2, 64, 4), (4, 32, 4), (4, 128, 8), (8, 64, 8)]:  # the benchmark's sweep
    for name, b, s in (cases[0], cases[1], cases[-1]):
        want = dequant_mxfp4_reference(b, s)
        out = torch.empty_like(want)
        launch_mxfp4(b, s, out, Mxfp4Tiling(*tile))
        same = bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))
        results.append(dict(case=f"{name} {tile}", is_out=True, exact=same, transformers=same))
print("RESULTS" + json.dumps(results))
"""


@needs_triton
def test_triton_interpreter_matches_transformers():
    """The Triton kernel under TRITON_INTERPRET=1, in a child process so the setting cannot leak."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next(text for text in proc.stdout.splitlines() if text.startswith("RESULTS"))[len("RESULTS"):])
    assert len(results) == 7 + 4 * 3
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
