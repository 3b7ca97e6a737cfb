"""Make deterministic DeepSeek-V3-format FP8 checkpoints: the bundled tiny model, test and benchmark data.

Weights are drawn from a seeded generator, rounded to bf16, then quantized to FP8 e4m3 with
128x128 block scales exactly as DeepSeek-V3 stores them (`weight` F8_E4M3 + `weight_scale_inv`
F32, dequant `y = x * s`). Dims like 200 and 320 give partial edge blocks; each scale can be put
in another shard than its weight; `e_score_correction_bias` is F32 as in the real checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from expertd.fusion import parts_of
from expertd.hf import fusions_for, model_state
from expertd.kernels import quantize_fp8_blockwise

from ..layout import SCALE_SUFFIX, is_fp8_weight

PRESETS: dict[str, dict] = {
    # ~2 MB: partial blocks everywhere (320 = 2.5 blocks, 200, 576), 8 experts in 2 groups.
    "tiny": dict(
        vocab_size=384, hidden_size=320, intermediate_size=576, moe_intermediate_size=200,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        q_lora_rank=192, kv_lora_rank=160, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    ),
    # ~1 GB of bf16 once dequantized: DeepSeek-V3's shapes scaled down, for the benchmarks.
    "bench-1g": dict(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=384,
        num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
        n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6, n_group=8, topk_group=4,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    ),
}

BASE_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, routed_scaling_factor=2.5,
    norm_topk_prob=True, tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=[128, 128]),
)


@dataclass
class GeneratedTensor:
    name: str
    tensor: torch.Tensor


def checkpoint_tensors(config: dict, seed: int = 0) -> list[GeneratedTensor]:
    """Every checkpoint tensor of the model `config` describes, in checkpoint (per-expert) naming."""
    gen = torch.Generator().manual_seed(seed)
    fusions = fusions_for(config["model_type"])
    names: list[tuple[str, tuple[int, ...]]] = []
    for param, (shape, _) in model_state(config).items():
        fused = parts_of(fusions, param, shape)
        names.extend(fused[1] if fused is not None else [(param, shape)])
    out: list[GeneratedTensor] = []
    for name, shape in names:
        if name.endswith("e_score_correction_bias"):
            out.append(GeneratedTensor(name, (torch.rand(shape, generator=gen) * 0.1).float()))
        elif name.endswith("norm.weight"):
            out.append(GeneratedTensor(name, (1.0 + 0.1 * torch.randn(shape, generator=gen)).bfloat16()))
        else:
            std = 1.0 / math.sqrt(shape[-1])
            w = (torch.randn(shape, generator=gen) * std).bfloat16()
            if is_fp8_weight(name, shape):
                q, s = quantize_fp8_blockwise(w.float(), 128, name=name)
                out.append(GeneratedTensor(name, q))
                out.append(GeneratedTensor(name + SCALE_SUFFIX, s))
            else:
                out.append(GeneratedTensor(name, w))
    return out


def write_checkpoint(folder: str, config: dict, tensors: list[GeneratedTensor], shards: int = 2,
                     scales_elsewhere: bool = True) -> None:
    """Write sharded safetensors + index + config.json; with `scales_elsewhere` scales go to the next shard."""
    os.makedirs(folder, exist_ok=True)
    shards = max(1, shards)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    by_shard: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    weight_map = {}
    for i, t in enumerate(tensors):
        k = (i * shards) // len(tensors)
        if t.name.endswith(SCALE_SUFFIX) and scales_elsewhere:
            k = (weight_map_index(weight_map, files, t.name[: -len(SCALE_SUFFIX)]) + 1) % shards
        by_shard[k][t.name] = t.tensor.contiguous()
        weight_map[t.name] = files[k]
    for file, content in zip(files, by_shard):
        save_file(content, os.path.join(folder, file), metadata={"format": "pt"})
    total = sum(t.tensor.numel() * t.tensor.element_size() for t in tensors)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def weight_map_index(weight_map: dict[str, str], files: list[str], name: str) -> int:
    return files.index(weight_map[name]) if name in weight_map else 0


def make_config(preset: str = "tiny", **overrides) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return {**BASE_CONFIG, **PRESETS[preset], **overrides}


def generate(folder: str, preset: str = "tiny", seed: int = 0, shards: int = 2, **overrides) -> dict:
    """Generate a whole checkpoint folder; returns its config."""
    config = make_config(preset, **overrides)
    write_checkpoint(folder, config, checkpoint_tensors(config, seed), shards=shards)
    return config
