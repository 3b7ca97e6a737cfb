"""Real compressed-tensors FP8 checkpoints, written by llmcompressor's own `oneshot` (in its own virtualenv) from a
tiny bf16 Qwen3-MoE: what is on disk is what the formats define.

FP8_DYNAMIC: every targeted Linear's weight in float8_e4m3fn with one scale per output channel ([out, 1]);
FP8_BLOCK: one scale per 128x128 block ([ceil(out/128), ceil(in/128)]), partial blocks at the edges (the tiny
dims, 192 and 200, are not multiples of 128: llmcompressor only warns). Scales are stored in the model's dtype
(bf16), activations are dynamic (no input_scale). transformers 5 fuses the experts into 3-D parameters;
llmcompressor linearizes them into one nn.Linear per expert, so the experts are quantized and saved under
per-expert names (`mlp.experts.N.gate_proj.weight`), as the bf16 source has them.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open

from expertd.tools.requantize import shard_files


SCHEMES = ("FP8_DYNAMIC", "FP8_BLOCK")
BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def read_folder(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint folder (sharded or not)."""
    files, _ = shard_files(folder)
    out = {}
    for file in files:
        with safe_open(os.path.join(folder, file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture(scope="module")
def checkpoints(llmcompressor_checkpoints):
    """The bf16 source and its FP8_DYNAMIC and FP8_BLOCK checkpoints, each as (config.json, tensors)."""
    out = {}
    for key, folder in llmcompressor_checkpoints.items():
        with open(os.path.join(folder, "config.json")) as f:
            out[key] = (json.load(f), read_folder(folder))
    return out


def linear_weights(tensors: dict) -> list[str]:
    """The source's weights llmcompressor quantizes: attention and expert projections (not the routers, `mlp.gate`)."""
    return sorted(n for n, t in tensors.items()
                  if n.startswith("model.layers.") and n.endswith("_proj.weight") and t.dim() == 2)


def expand(scale: torch.Tensor, shape) -> torch.Tensor:
    """A per-channel ([out, 1]) or per-block scale broadcast over the weight's [out, in]."""
    out, inp = shape
    if scale.shape[1] == 1:
        return scale.expand(out, inp)
    return scale.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]


def amax(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """max |w| over each channel (FP8_DYNAMIC) or each 128x128 block, zero-padded at the edges (FP8_BLOCK)."""
    w = w.float().abs()
    if scheme == "FP8_DYNAMIC":
        return w.amax(1, keepdim=True)
    out, inp = w.shape
    rows, cols = math.ceil(out / BLOCK), math.ceil(inp / BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:out, :inp] = w
    return padded.reshape(rows, BLOCK, cols, BLOCK).amax((1, 3))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_config(checkpoints, scheme):
    src_config, _ = checkpoints["bf16"]
    config, _ = checkpoints[scheme]
    qc = config.pop("quantization_config")
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "float-quantized"
    assert qc["quantization_status"] == "compressed"
    assert qc["kv_cache_scheme"] is None and qc["sparsity_config"] == {}
    # the regexes are resolved: the routers of every layer by name, then lm_head
    layers = src_config["num_hidden_layers"]
    assert sorted(qc["ignore"]) == sorted([f"model.layers.{i}.mlp.gate" for i in range(layers)] + ["lm_head"])
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == "float-quantized"
    assert group["output_activations"] is None
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["symmetric"], w["dynamic"]) == ("float", 8, True, False)
    assert (a["type"], a["num_bits"], a["symmetric"], a["dynamic"]) == ("float", 8, True, True)
    if scheme == "FP8_DYNAMIC":
        assert (w["strategy"], w["block_structure"]) == ("channel", None)
        assert (a["strategy"], a["group_size"]) == ("token", None)
    else:
        assert (w["strategy"], w["block_structure"]) == ("block", [BLOCK, BLOCK])
        assert (a["strategy"], a["group_size"]) == ("group", BLOCK)
    # the rest of config.json is the source's
    src_config = {k: v for k, v in src_config.items() if k != "dtype"}
    assert {k: v for k, v in config.items() if k != "dtype"} == src_config


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tensors(checkpoints, scheme):
    src_config, source = checkpoints["bf16"]
    _, tensors = checkpoints[scheme]
    quantized = linear_weights(source)
    # attention and every expert of every layer: per-expert names, nothing fused
    experts = src_config["num_hidden_layers"] * src_config["num_local_experts"] * 3
    assert sum(".mlp.experts." in n for n in quantized) == experts
    assert len(quantized) == experts + src_config["num_hidden_layers"] * 4
    assert not any("gate_up_proj" in n or n.endswith("experts.down_proj") for n in tensors)
    # the source's names, plus a weight_scale for each quantized weight; no input_scale, nothing else
    assert set(tensors) == set(source) | {n + "_scale" for n in quantized}
    for name, t in source.items():
        if name not in quantized:  # norms, embeddings, lm_head, routers: as they were
            assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    for name in quantized:
        w, q, scale = source[name], tensors[name], tensors[name + "_scale"]
        out, inp = w.shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape, name
        assert scale.dtype == torch.bfloat16, name  # the model's dtype, not float32
        if scheme == "FP8_DYNAMIC":
            assert scale.shape == (out, 1), name
        else:
            assert scale.shape == (math.ceil(out / BLOCK), math.ceil(inp / BLOCK)), name
        # llmcompressor 0.14's arithmetic: scale = bf16(amax / 448), q = fp8(clamp(w / scale)) divided in bf16
        assert torch.equal(scale, (amax(w, scheme) / FP8_MAX).to(torch.bfloat16)), name
        full = expand(scale, w.shape)
        assert torch.equal(q.view(torch.uint8),
                           (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)), name
        # so the dequantized weight is the source within e4m3's precision (3 mantissa bits, subnormals 2^-9)
        err = (q.float() * full.float() - w.float()).abs()
        assert (err <= w.float().abs() * 2**-4 + full.float() * 2**-9).all(), name


def test_layer0_names(checkpoints):
    """Layer 0's tensors, as the checkpoints name them (experts per expert, each with its scale)."""
    _, dyn = checkpoints["FP8_DYNAMIC"]
    _, block = checkpoints["FP8_BLOCK"]
    assert set(dyn) == set(block)
    expert = {f"model.layers.0.mlp.experts.0.{p}_proj.{s}" for p in ("gate", "up", "down")
              for s in ("weight", "weight_scale")}
    attn = {f"model.layers.0.self_attn.{p}_proj.{s}" for p in "qkvo" for s in ("weight", "weight_scale")}
    assert expert | attn | {"model.layers.0.mlp.gate.weight"} <= set(dyn)
    assert "model.layers.0.mlp.gate.weight_scale" not in dyn and "lm_head.weight_scale" not in dyn
