"""A gpt_oss checkpoint rewritten in the MXFP4 release layout (write_mxfp4), which transformers itself loads
and dequantizes bit for bit as dequant_mxfp4 does."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from expertd.kernels.mxfp4 import dequant_mxfp4
from helpers.mxfp4_cases import assert_bits_equal


@pytest.fixture(scope="module")
def gpt_oss_folders(tmp_path_factory):
    """(bf16 folder, the same rewritten as MXFP4, what write_mxfp4 wrote)."""
    from expertd.tools.generate import generate_model_type
    from expertd.tools.requantize import write_mxfp4

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
