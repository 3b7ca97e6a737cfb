"""The checkpoint's quantization format, read once from config.json's `quantization_config`.

Today expertd serves DeepSeek's FP8 format (`quant_method: fp8`, e4m3 weights with a float32
`*_scale_inv` per `weight_block_size` block, dynamic activation scales) and unquantized checkpoints.
Any other format is refused here, before a tensor is read, with one line naming the config field, its
value and what is served: serving another format's quantized bytes as if they were bf16, or with
DeepSeek's scale rule, would be silently wrong. compressed-tensors FP8 and MXFP4 are recognised by name
so the refusal says what they are; serving them is the next step (issue 20).
"""

from __future__ import annotations

from dataclasses import dataclass

from expertd.errors import CheckpointError

SERVED = "quant_method 'fp8' with weight_block_size (DeepSeek FP8 blocks) or no quantization_config (weights as stored)"
DEFAULT_BLOCK = (128, 128)


class UnsupportedQuantization(CheckpointError):
    """config.json's quantization_config names a format expertd does not serve."""


@dataclass(frozen=True)
class QuantFormat:
    method: str | None  # "fp8"; None: no quantization_config (FP8 tensors with *_scale_inv still dequantize)
    block_size: tuple[int, int]


def quantization_format(config: dict, file: str | None = None) -> QuantFormat:
    """The format a config.json declares; UnsupportedQuantization (naming the field) for any expertd cannot serve."""
    qc = config.get("quantization_config")
    if qc is None:
        return QuantFormat(None, DEFAULT_BLOCK)
    if not isinstance(qc, dict):
        raise CheckpointError(f"quantization_config must be a mapping, got {type(qc).__name__}", file=file)
    method = qc.get("quant_method", "fp8")  # DeepSeek's own config names it; older copies may not
    if method != "fp8":
        raise UnsupportedQuantization(f"quantization_config.quant_method {method!r}{_described(qc)} is not served by "
                                      f"this expertd; it serves {SERVED}", file=file)
    for field, served in (("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None))):
        if qc.get(field) not in served:
            why = " (static activation scales would change the numerics)" if field == "activation_scheme" else ""
            raise UnsupportedQuantization(f"quantization_config.{field} {qc.get(field)!r} is not served{why}; "
                                          f"expertd serves {field} {served[0]!r}", file=file)
    return QuantFormat("fp8", _block(qc, file))


def _block(qc: dict, file: str | None) -> tuple[int, int]:
    block = qc.get("weight_block_size", list(DEFAULT_BLOCK))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"quantization_config.weight_block_size {block!r} must be [rows, cols] of positive ints",
                              file=file)
    if block[0] != block[1]:
        raise CheckpointError(f"quantization_config.weight_block_size {block!r}: only square blocks are supported",
                              file=file)
    return block[0], block[1]


def _described(qc: dict) -> str:
    """What a refused format is, in its own config's words (compressed-tensors' scheme, MXFP4's layout)."""
    if qc.get("quant_method") == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        schemes = sorted({f"{w.get('type')} {w.get('num_bits')}-bit {w.get('strategy')}" for w in weights if isinstance(w, dict)})
        return f" (format {qc.get('format')!r}, weights {', '.join(schemes) or 'unknown'})"
    if qc.get("quant_method") == "mxfp4":
        return " (gpt-oss MXFP4: *_blocks e2m1 codes with *_scales e8m0)"
    return ""
