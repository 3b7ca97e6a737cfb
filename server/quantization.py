"""The checkpoint's quantization format, modelled once from config.json's `quantization_config` as a codec.

A codec says which checkpoint tensors are quantized weights and which are their auxiliary tensors, what
shape each aux must have, the dtype a weight is served in (bf16) and how its bytes dequantize. Every site
that reads a quantized checkpoint (planner, loader, updates, convert, inspect, doctor) asks the codec
rather than testing names. The formats served:

- `ScaledFp8`: float8_e4m3fn weights with one scale tensor each, y = bf16(float32(w) * float32(s)) with s
  broadcast over a block of the weight. DeepSeek's `quant_method: fp8` stores `NAME_scale_inv` per
  `weight_block_size` block; compressed-tensors (`quant_method: compressed-tensors`, `format:
  float-quantized`, what llmcompressor writes) stores `NAME_scale` per output channel ([out, 1]), per
  tensor ([1]) or per `block_structure` block. A checkpoint without quantization_config that holds FP8
  tensors with `*_scale_inv` is read as DeepSeek's.
- `Mxfp4`: gpt-oss's experts, `NAME_blocks` (uint8 [..., R, G, 16]: two e2m1 codes a byte, 32 values a
  group) with `NAME_scales` (uint8 e8m0 [..., R, G], bias 127), served as the bf16 `NAME` [..., G*32, R]
  that transformers' own decoder makes (`integrations/mxfp4.py`).

Anything else is refused here, before a tensor is read, with one line naming the config field, its value
and what is served: serving quantized bytes as if they were bf16, or with another format's rule, would
be silently wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from expertd.dtypes import SCALE_SUFFIX
from expertd.errors import CheckpointError

SERVED = ("quant_method 'fp8' (DeepSeek FP8 blocks), 'compressed-tensors' (float-quantized FP8 e4m3: channel, tensor "
          "or block weight scales, dynamic activations), 'mxfp4' (gpt-oss), or no quantization_config")
DEFAULT_BLOCK = (128, 128)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # DeepSeek stores float32, Qwen and llmcompressor bf16


class UnsupportedQuantization(CheckpointError):
    """config.json's quantization_config names a format expertd does not serve."""


@dataclass(frozen=True)
class ScaledFp8:
    """FP8 e4m3 weights, each with a `NAME + suffix` scale over blocks of it (see the module docstring)."""

    method: str | None  # "fp8", "compressed-tensors"; None: no quantization_config
    suffix: str = SCALE_SUFFIX
    strategies: tuple[str, ...] = ("block",)  # of "block", "channel", "tensor": what the config declares
    block_size: tuple[int, int] = DEFAULT_BLOCK  # the "block" strategy's (rows, columns)
    ignore: tuple[str, ...] = ()  # modules the config leaves unquantized (informational: their weights are bf16)

    kind = "fp8"
    packed = False  # the weight is one tensor with the served shape

    def aux_name(self, weight: str) -> str:
        return weight + self.suffix

    def is_aux(self, name: str, names) -> bool:
        return name.endswith(self.suffix) and name[: -len(self.suffix)] in names

    def logical(self, names) -> dict[str, tuple[str, str | None]]:
        """{served name: (weight tensor, aux tensor or None)} for every tensor that is not an aux."""
        return {n: (n, self.aux_name(n) if self.aux_name(n) in names else None)
                for n in names if not self.is_aux(n, names)}

    def expected_scale(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(strategy, scale shape) each declared strategy expects for a weight of `shape`."""
        m, n = shape
        out = []
        for strategy in self.strategies:
            if strategy == "channel":
                out.append((strategy, (m, 1)))
            elif strategy == "tensor":
                out.extend((strategy, s) for s in ((1,), (1, 1), ()))
            else:
                out.append((strategy, (math.ceil(m / self.block_size[0]), math.ceil(n / self.block_size[1]))))
        return out

    def block_for(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
        """The (rows, columns) one scale covers in a weight of `shape` whose scale has `scale_shape` (checked)."""
        m, n = shape
        strategy = self.strategy_of(shape, scale_shape)
        return {"channel": (1, max(n, 1)), "tensor": (max(m, 1), max(n, 1))}.get(strategy, self.block_size)

    def strategy_of(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        """The declared strategy a scale of `scale_shape` follows for a weight of `shape`; ValueError for none."""
        for strategy, want in self.expected_scale(shape):
            if tuple(scale_shape) == want:
                return strategy
        raise ValueError(f"scale shape {list(scale_shape)} fits no declared strategy")

    def scheme(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        """How one weight is quantized, in words ("fp8 e4m3, per-channel bf16 scale")."""
        strategy = self.strategy_of(shape, scale_shape)
        how = f"{self.block_size[0]}x{self.block_size[1]} block" if strategy == "block" else f"per-{strategy}"
        return f"fp8 e4m3, {how} scale"

    def describe(self) -> str:
        parts = [f"{s} {self.block_size[0]}x{self.block_size[1]}" if s == "block" else f"per-{s}"
                 for s in self.strategies]
        return f"FP8 e4m3 ({self.method or 'fp8'}: {', '.join(parts)}; *{self.suffix})"


@dataclass(frozen=True)
class Mxfp4:
    """gpt-oss MXFP4 experts: `NAME_blocks` + `NAME_scales` served as bf16 `NAME` (see the module docstring)."""

    ignore: tuple[str, ...] = ()  # modules_to_not_convert

    method = "mxfp4"
    kind = "mxfp4"
    packed = True  # the served tensor is decoded from two tensors and transposed: no part of it is stored as is
    blocks_suffix = "_blocks"
    scales_suffix = "_scales"
    GROUP = 32  # values per e8m0 scale
    BYTES = 16  # bytes per group (two e2m1 codes each)

    def aux_name(self, weight: str) -> str:
        return weight + self.scales_suffix

    def is_aux(self, name: str, names) -> bool:
        return name.endswith(self.scales_suffix) and name[: -len(self.scales_suffix)] + self.blocks_suffix in names

    def logical(self, names) -> dict[str, tuple[str, str | None]]:
        """{served name: (weight tensor, aux tensor or None)}: `X_blocks` serves as `X` with `X_scales`."""
        out = {}
        for n in names:
            if n.endswith(self.blocks_suffix):
                base = n[: -len(self.blocks_suffix)]
                scales = base + self.scales_suffix
                out[base] = (n, scales if scales in names else None)
            elif not self.is_aux(n, names):
                out[n] = (n, None)
        return out

    def scheme(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        return "mxfp4 e2m1, e8m0 scale per 32"

    def served_shape(self, blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, rows, groups, _ = blocks_shape
        return (*lead, groups * self.GROUP, rows)

    def describe(self) -> str:
        return "MXFP4 (gpt-oss: *_blocks e2m1 + *_scales e8m0, 32 per group)"


Codec = ScaledFp8 | Mxfp4


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
