"""Rewrite generated bf16 checkpoints in released quantized layouts (test and benchmark data).

`write_mxfp4(folder)` turns a bf16 gpt_oss checkpoint (`generate_model_type(folder, "gpt_oss", fp8=False)`)
into gpt-oss's released MXFP4 layout: each `...mlp.experts.gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H]
(as transformers' GptOssExperts holds them) becomes `..._blocks` uint8 [E, 2I, H/32, 16] / [E, H, I/32, 16]
and `..._scales` uint8 [E, 2I, H/32] / [E, H, I/32], the names and layout transformers' MXFP4 loader reads
(its `Mxfp4HfQuantizer.serialized_names`; `convert_moe_packed_tensors` decodes them back to [E, H, 2I] /
[E, I, H]). Biases and every other tensor are kept; config.json gets gpt-oss's `quantization_config`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from expertd.kernels.mxfp4 import quantize_mxfp4

EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# gpt-oss's release (openai/gpt-oss-20b / -120b config.json): only the experts are MXFP4.
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}


def is_mxfp4_expert_weight(name: str) -> bool:
    """Whether `name` is a gpt_oss expert weight that the MXFP4 release stores as blocks + scales."""
    return name.endswith(EXPERT_WEIGHTS)


def shard_files(folder: str) -> tuple[list[str], str | None]:
    """A checkpoint folder's shard files (sharded or not), and its index file where it has one."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            return sorted(set(json.load(f)["weight_map"].values())), index_path
    return ["model.safetensors"], None


def write_mxfp4(folder: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rewrite the bf16 gpt_oss checkpoint in `folder` in place as gpt-oss's MXFP4 release: each expert
    weight replaced, in its own shard, by `<name>_blocks` and `<name>_scales` (`quantize_mxfp4`), the index
    and config.json updated. Returns {name: (blocks, scales)} of what was written."""
    files, index_path = shard_files(folder)
    written: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for file in files:
        path = os.path.join(folder, file)
        tensors = load_file(path)
        out: dict[str, torch.Tensor] = {}
        for name, w in tensors.items():
            if is_mxfp4_expert_weight(name):
                if w.dim() != 3:
                    raise ValueError(f"{name}: expected [experts, in, out], got shape {list(w.shape)}")
                blocks, scales = quantize_mxfp4(w, name=name)
                out[name + BLOCKS_SUFFIX], out[name + SCALES_SUFFIX] = blocks, scales
                written[name] = (blocks, scales)
            else:
                out[name] = w
        if out.keys() != tensors.keys():
            save_file(out, path, metadata={"format": "pt"})
        weight_map.update((name, file) for name in out)
        total += sum(t.numel() * t.element_size() for t in out.values())
    if not written:
        raise ValueError(f"{folder}: no {' / '.join(EXPERT_WEIGHTS)} tensors to quantize "
                         "(is it a bf16 gpt_oss checkpoint?)")
    if index_path is not None:
        with open(index_path) as f:
            index = json.load(f)
        index.setdefault("metadata", {})["total_size"] = total
        index["weight_map"] = dict(sorted(weight_map.items()))
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = json.loads(json.dumps(MXFP4_QUANTIZATION_CONFIG))
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return written
