"""The checkpoint's quantization format, read once from config.json's `quantization_config`: the one place a
checkpoint is matched to its format's class (`expertd.formats`).

A format is one class, its codec and its dequant entry points together: which checkpoint tensors are quantized
weights and which are their aux tensors, what shape each aux must have, the dtype a weight is served in (bf16),
and how its bytes dequantize. Every site that reads a quantized checkpoint or a quantized push (planner, loader,
updates, the client's `push_all`, convert, inspect, doctor) asks the format rather than testing names or formats.
The formats served:

- `ScaledFp8` (`formats/scaled_fp8.py`): float8_e4m3fn weights with one scale tensor each, a scale over a block
  of the weight. DeepSeek's `quant_method: fp8` (`NAME_scale_inv` per `weight_block_size` block);
  compressed-tensors' `format: float-quantized` (`NAME_scale` per output channel, per tensor or per
  `block_structure` block). A checkpoint without quantization_config that holds FP8 tensors with `*_scale_inv` is
  read as DeepSeek's.
- `Mxfp4` (`formats/mxfp4.py`): gpt-oss's experts, `NAME_blocks` with `NAME_scales`, served as bf16 `NAME`.

Anything else is refused here, before a tensor is read, with one line naming the config field, its value and what
is served: serving quantized bytes as if they were bf16, or with another format's rule, would be silently wrong.

Adding a format (NVFP4, int4): one class in `expertd/formats/` over `Codec` — its naming (`stored_suffix`,
`aux_suffix`), `decoding` (a stored weight and its aux checked, and what they serve as), `check_aux` (aux tensors
the format cannot have), `check_push` (a pushed weight and its aux), its dequant entry points (`dequant`, `stream`,
`reference`) over its kernel beside a `*_reference` in `kernels/` — and its branch in `quantization_format`.
Nothing else branches on it.
"""

from __future__ import annotations

from .errors import CheckpointError
from .formats.codec import Codec, UnsupportedQuantization
from .formats.mxfp4 import Mxfp4
from .formats.scaled_fp8 import DEFAULT_BLOCK, ScaledFp8

__all__ = ["Codec", "Mxfp4", "ScaledFp8", "UnsupportedQuantization", "quantization_format"]

SERVED = ("quant_method 'fp8' (DeepSeek FP8 blocks), 'compressed-tensors' (float-quantized FP8 e4m3: channel, tensor "
          "or block weight scales, dynamic activations), 'mxfp4' (gpt-oss), or no quantization_config")


def quantization_format(config: dict, file: str | None = None) -> Codec:
    """The codec a config.json declares; UnsupportedQuantization (naming the field) for any expertd cannot serve."""
    qc = config.get("quantization_config")
    if qc is None:
        return ScaledFp8(None)
    if not isinstance(qc, dict):
        raise CheckpointError(f"quantization_config must be a mapping, got {type(qc).__name__}", file=file)
    method = qc.get("quant_method", "fp8")  # DeepSeek's own config names it; older copies may not
    if method == "compressed-tensors":
        return _compressed_tensors(qc, file)
    if method == "mxfp4":
        return Mxfp4(_names(qc, "modules_to_not_convert", file))
    if method != "fp8":
        raise UnsupportedQuantization(f"quantization_config.quant_method {method!r} is not served by this expertd; "
                                      f"it serves {SERVED}", file=file)
    for field, served in (("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None))):
        if qc.get(field) not in served:
            why = " (static activation scales would change the numerics)" if field == "activation_scheme" else ""
            raise UnsupportedQuantization(f"quantization_config.{field} {qc.get(field)!r} is not served{why}; "
                                          f"expertd serves {field} {served[0]!r}", file=file)
    return ScaledFp8("fp8", block_size=_pair(qc.get("weight_block_size", list(DEFAULT_BLOCK)),
                                             "quantization_config.weight_block_size", file))


def _compressed_tensors(qc: dict, file: str | None) -> ScaledFp8:
    """compressed-tensors' float-quantized FP8 weights with dynamic (or no) activation quantization."""
    def refuse(field: str, value, served: str, why: str = "") -> UnsupportedQuantization:
        return UnsupportedQuantization(f"quantization_config.{field} {value!r} is not served{why}; expertd serves "
                                       f"compressed-tensors {served}", file=file)

    if qc.get("format") != "float-quantized":
        raise refuse("format", qc.get("format"), "format 'float-quantized' (FP8 e4m3 weights)")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(field):
            raise refuse(field, qc[field], f"without {field}", " (it changes what the model computes)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config.config_groups must be a non-empty mapping of schemes", file=file)
    strategies, blocks = [], set()
    for key, group in groups.items():
        where = f"config_groups.{key}"
        weights = (group or {}).get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise CheckpointError(f"quantization_config.{where}.weights must be a mapping", file=file)
        for field, value, served in (("type", weights.get("type"), "float"), ("num_bits", weights.get("num_bits"), 8),
                                     ("symmetric", weights.get("symmetric", True), True),
                                     ("dynamic", weights.get("dynamic", False), False)):
            if value != served:
                raise refuse(f"{where}.weights.{field}", value, f"weights.{field} {served!r} (FP8 e4m3 weights)")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise refuse(f"{where}.weights.strategy", strategy, "weight strategies 'channel', 'tensor' and 'block'")
        if strategy == "block":
            blocks.add(_pair(weights.get("block_structure"), f"quantization_config.{where}.weights.block_structure",
                             file))
        strategies.append(strategy)
        for field in ("input_activations", "output_activations"):
            act = group.get(field)
            if act is None:
                continue
            if field == "output_activations" or not act.get("dynamic", False):
                what = "dynamic" if field == "input_activations" else None
                raise refuse(f"{where}.{field}", act if what is None else act.get("dynamic"),
                             f"{field} None{' or dynamic' if what else ''}",
                             " (static activation scales would change the numerics)")
    if len(blocks) > 1:
        raise refuse("config_groups", sorted(blocks), "one block_structure per checkpoint")
    return ScaledFp8("compressed-tensors", "_scale", tuple(dict.fromkeys(strategies)),
                     blocks.pop() if blocks else DEFAULT_BLOCK, _names(qc, "ignore", file))


def _pair(value, field: str, file: str | None) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(b, int) and b > 0 for b in value)):
        raise CheckpointError(f"{field} {value!r} must be [rows, columns] of positive ints", file=file)
    return value[0], value[1]


def _names(qc: dict, field: str, file: str | None) -> tuple[str, ...]:
    names = qc.get(field) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"quantization_config.{field} must be a list of module names, got {names!r}", file=file)
    return tuple(names)
