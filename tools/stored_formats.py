"""The stored formats `expertd generate --format` writes, and which one a family's releases use.

Kept apart from the writers (torch, transformers) so that the CLI's parser can list them without importing those.
"""

from __future__ import annotations

from expertd.errors import ConfigError

# Each stored format, as `--help` describes it.
FORMATS = {
    "bf16": "no quantization (float32 where the family's releases keep a tensor in float32)",
    "fp8-blocks": "DeepSeek-V3's FP8: e4m3 weights, 128x128 `weight_scale_inv` blocks in the next shard",
    "compressed-fp8": "compressed-tensors FP8 with one `weight_scale` per output channel (llmcompressor's FP8_DYNAMIC)",
    "compressed-fp8-block": "compressed-tensors FP8 with 128x128 `weight_scale` blocks (llmcompressor's FP8_BLOCK)",
    "mxfp4": "gpt-oss's MXFP4: expert weights as `_blocks` + `_scales` (--model-type gpt_oss only)",
}
COMPRESSED_STRATEGIES = {"compressed-fp8": "channel", "compressed-fp8-block": "block"}
MXFP4_MODEL_TYPES = ("gpt_oss",)  # the families whose expert weights `write_mxfp4` knows
# What the families' releases store, where not bf16 (the FP8 ones: generate.FP8_SCALE_DTYPES says their scales' dtype)
RELEASE_FORMATS = {"deepseek_v3": "fp8-blocks", "glm4_moe": "fp8-blocks", "qwen3_moe": "fp8-blocks", "gpt_oss": "mxfp4"}


def release_format(model_type: str | None) -> str:
    """The format a family's releases store: DeepSeek-V3 (every preset), GLM-4.5 and Qwen3-MoE FP8 blocks, gpt-oss
    MXFP4, the other families bf16."""
    return "fp8-blocks" if model_type is None else RELEASE_FORMATS.get(model_type, "bf16")


def release_formats_text() -> str:
    """The defaults in --help's words, from RELEASE_FORMATS (so the help stays true when a family is added)."""
    fp8 = ", ".join(t for t, f in RELEASE_FORMATS.items() if f == "fp8-blocks")
    others = "; ".join(f"{t}: {f}" for t, f in RELEASE_FORMATS.items() if f != "fp8-blocks")
    return f"the presets, {fp8}: fp8-blocks; {others}; other model types: bf16"


def check_format(fmt: str, model_type: str | None) -> None:
    """A format the generator can write for this model: else a ConfigError that says what would."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    if fmt == "mxfp4" and model_type not in MXFP4_MODEL_TYPES:
        model = f"--model-type {model_type}" if model_type else "a --preset (DeepSeek-V3)"
        raise ConfigError(f"--format mxfp4 writes gpt-oss's expert weights, which {model} does not have; use "
                          f"--model-type gpt_oss, or another format ({', '.join(f for f in FORMATS if f != 'mxfp4')})")
