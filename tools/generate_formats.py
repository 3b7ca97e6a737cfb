"""`expertd generate --format`: a generated checkpoint stored in any format expertd serves, in N shards.

The generators write bf16 (the presets: DeepSeek-V3's own generator; --model-type: transformers'
save_pretrained); the format's writer then quantizes the folder in place: `quantize_saved_checkpoint` for
DeepSeek's FP8 blocks and compressed-tensors FP8, `write_mxfp4` for gpt-oss's MXFP4. The one exception is a
preset in fp8-blocks, which `generate` quantizes as it draws (the bundled tiny checkpoint, byte for byte).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from expertd.errors import ConfigError

from .generate import (FP8_SCALE_DTYPES, MOE_MODEL_TYPES, GeneratedTensor, checkpoint_tensors, generate,
                       generate_model_type, make_config, quantize_saved_checkpoint, write_checkpoint)
from .requantize import shard_files, write_mxfp4
from .stored_formats import COMPRESSED_STRATEGIES, check_format, release_format


def generate_checkpoint(folder: str, fmt: str | None = None, preset: str = "tiny", model_type: str | None = None,
                        seed: int = 0, shards: int | None = None) -> str:
    """Write a tiny checkpoint (a DeepSeek-V3 `preset`, or `model_type` at TINY_DIMS) in `fmt` (default: as the
    family's releases) and `shards` files (default: 2 for a preset, save_pretrained's 400KB pieces for a model
    type); returns the format written."""
    fmt = fmt or release_format(model_type)
    check_format(fmt, model_type)
    if model_type is not None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            raise ConfigError(f"unknown --model-type {model_type!r}: not a model type of the installed transformers; "
                              f"MoE types the generator builds: {', '.join(MOE_MODEL_TYPES)}")
    if model_type is None and fmt == "fp8-blocks":
        generate(folder, preset=preset, seed=seed, shards=shards or 2)
        return fmt
    if model_type is None:
        config = {k: v for k, v in make_config(preset).items() if k != "quantization_config"}
        write_checkpoint(folder, config, checkpoint_tensors(config, seed, fp8=False), shards=shards or 2)
    else:
        generate_model_type(folder, model_type, fp8=False, seed=seed)
        if shards is not None:
            reshard(folder, shards)
    if fmt == "fp8-blocks":
        quantize_saved_checkpoint(folder, FP8_SCALE_DTYPES.get(model_type, torch.float32))
    elif fmt in COMPRESSED_STRATEGIES:
        quantize_saved_checkpoint(folder, torch.bfloat16, scheme=COMPRESSED_STRATEGIES[fmt])
    elif fmt == "mxfp4":
        write_mxfp4(folder)
    return fmt


def reshard(folder: str, shards: int) -> None:
    """Lay a checkpoint folder's tensors out again in `shards` files (model-0000i-of-0000N + index), in order."""
    files, index_path = shard_files(folder)
    tensors = [GeneratedTensor(name, t) for file in files for name, t in load_file(os.path.join(folder, file)).items()]
    if shards > len(tensors):
        raise ConfigError(f"--shards {shards}: the checkpoint has only {len(tensors)} tensors; give at most that many")
    for file in files:
        os.unlink(os.path.join(folder, file))
    if index_path is not None:
        os.unlink(index_path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    write_checkpoint(folder, config, tensors, shards=shards, scales_elsewhere=False)
