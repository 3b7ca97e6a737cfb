"""Test-side reference: every checkpoint tensor dequantized by the pure-torch reference, and a bf16 checkpoint of it."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from expertd.kernels import weight_dequant_reference
from expertd.server.reader import Checkpoint

SCALE_SUFFIX = "_scale_inv"


def reference_tensors(folder: str) -> dict[str, torch.Tensor]:
    """name -> tensor for every checkpoint tensor but the scales; FP8 weights dequantized to bf16."""
    ckpt = Checkpoint.open(folder)
    block = (ckpt.config.get("quantization_config") or {}).get("weight_block_size", [128])[0]
    out = {}
    for name, info in ckpt.tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        t = ckpt.read(name)
        if info.dtype == torch.float8_e4m3fn:
            # bf16 scales (Qwen's releases) widen to float32 exactly: the reference is bf16(f32(x) * f32(s))
            scale_inv = ckpt.read(name + SCALE_SUFFIX).float()
            t = weight_dequant_reference(t, scale_inv, block, out_dtype=torch.bfloat16)
        out[name] = t
    return out


def write_reference_bf16(folder: str, dst: str) -> str:
    """A plain bf16 checkpoint (no quantization_config) holding the reference-dequantized weights."""
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in reference_tensors(folder).items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst

