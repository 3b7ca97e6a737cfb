"""Test-side reference: every checkpoint tensor dequantized by the pure-torch reference, and a bf16 checkpoint of it."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from expertd.server.load.checkpoint import Checkpoint

def reference_tensors(folder: str) -> dict[str, torch.Tensor]:
    """name -> tensor for every checkpoint tensor but the aux ones, each quantized weight dequantized to bf16
    by its format's own definition (written out here, apart from the daemon's code):
    DeepSeek FP8 `*_scale_inv` and compressed-tensors FP8 `*_scale`: bf16(float32(w) * float32(s)), s broadcast
    over its block / channel / tensor; MXFP4 `*_blocks` + `*_scales`: transformers' own decoder."""
    ckpt = Checkpoint.open(folder)
    qc = ckpt.config.get("quantization_config") or {}
    method = qc.get("quant_method", "fp8")
    out = {}
    try:
        for name, info in ckpt.tensors.items():
            if method == "mxfp4" and name.endswith("_blocks"):
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                base = name[: -len("_blocks")]
                out[base] = convert_moe_packed_tensors(ckpt.read(name), ckpt.read(base + "_scales"))
                continue
            if method == "mxfp4" and name.endswith("_scales"):
                continue
            suffix = "_scale" if method == "compressed-tensors" else "_scale_inv"
            if name.endswith(suffix) and name[: -len(suffix)] in ckpt.tensors:
                continue
            t = ckpt.read(name)
            if info.dtype == torch.float8_e4m3fn:
                t = _dequant(t, ckpt.read(name + suffix).float(), qc, method)
            out[name] = t
    finally:
        ckpt.close()
    return out


def _dequant(w: torch.Tensor, s: torch.Tensor, qc: dict, method: str) -> torch.Tensor:
    """bf16(float32(w) * float32(s)), s broadcast over what one scale covers."""
    m, n = w.shape
    if method == "compressed-tensors" and s.numel() == 1:
        full = s.reshape(1, 1).expand(m, n)
    elif method == "compressed-tensors" and tuple(s.shape) == (m, 1):
        full = s.expand(m, n)
    else:
        if method == "compressed-tensors":
            rows, cols = next(g["weights"]["block_structure"] for g in qc["config_groups"].values())
        else:
            rows, cols = qc.get("weight_block_size", [128, 128])
        full = s.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :n]
    return (w.float() * full).to(torch.bfloat16)


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

