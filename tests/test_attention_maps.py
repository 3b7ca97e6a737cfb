"""Attention probabilities: captured per head with eager attention, drawn by `expertd inspect` as heatmaps."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from expertd.hf import model_config
from expertd.tools.capture import capture
from expertd.tools.generate import make_config
from expertd.tools.inspect import inspect
from helpers.inputs import INPUT_IDS


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(make_config("tiny")), dtype=torch.float32).eval()


def test_capture_saves_attention_probabilities_and_inspect_draws_them(model, tmp_path):
    before = model.config._attn_implementation
    out = tmp_path / "cap"
    with capture(model, str(out), modules=["*.self_attn"], directions="forward", attention_probs=True):
        assert model.config._attn_implementation == "eager"
        with torch.no_grad():
            model(torch.tensor(INPUT_IDS))
    assert model.config._attn_implementation == before  # restored after the pass
    heads, seq = model.config.num_attention_heads, len(INPUT_IDS[0])
    for layer in range(3):
        probs = load_file(str(out / f"000001_L{layer:02d}_self_attn_forward_attention_probs.safetensors"))["probs"]
        assert probs.shape == (1, heads, seq, seq)
        assert torch.allclose(probs.sum(-1), torch.ones(1, heads, seq), atol=1e-5)
        assert torch.all(probs.triu(1) == 0)  # causal: no query attends to a later key

    report = inspect(str(out), str(tmp_path / "report"), formats=["bf16", "hif8"], sample=2000)
    maps = [p["file"] for p in report["plots"] if p["file"].startswith("attention_")]
    assert len(maps) == 3
    for file in maps:
        with Image.open(os.path.join(tmp_path / "report", file)) as img:
            img.verify()
            assert img.format == "PNG"
    page = (tmp_path / "report" / "index.html").read_text()
    assert all(f"src='{f}'" in page for f in maps) and "formats_summary.png" in page  # beside the statistics


def test_capture_stores_hif8_codes_that_inspect_decodes(model, tmp_path):
    from expertd.tools.hif8 import hif8_decode, hif8_round_trip

    out = tmp_path / "codes"
    with capture(model, str(out), modules=["*.layers.1.self_attn.o_proj"], directions="forward", encoding="hif8"):
        with torch.no_grad():
            model(torch.tensor(INPUT_IDS))
    x = load_file(str(out / "000001_L01_self_attn.o_proj_forward_input.safetensors"))["args.0"]
    assert x.dtype == torch.uint8
    with capture(model, str(tmp_path / "plain"), modules=["*.layers.1.self_attn.o_proj"], directions="forward"):
        with torch.no_grad():
            model(torch.tensor(INPUT_IDS))
    plain = load_file(str(tmp_path / "plain" / "000001_L01_self_attn.o_proj_forward_input.safetensors"))["args.0"]
    assert torch.equal(hif8_decode(x), hif8_round_trip(plain).reshape(plain.shape))
    report = inspect(str(out), str(tmp_path / "report"), formats=["hif8"], plots=False)
    row = next(t for t in report["tensors"] if t["name"].endswith("forward_input:args.0"))
    assert row["dtype"] == "float32" and row["formats"]["hif8"]["rel_error"] == 0  # decoded: already HiF8 values
    with pytest.raises(ValueError, match="encoding"):
        capture(model, str(tmp_path / "bad"), encoding="fp3")
