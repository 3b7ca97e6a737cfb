"""The checkpoint's quantization format, modelled once from config.json's `quantization_config` as a codec.

A codec says which checkpoint tensors are quantized weights and which are their auxiliary tensors, what
shape each aux must have, the dtype a weight is served in (bf16) and how its bytes dequantize. Every site
that reads a quantized checkpoint or a quantized push (planner, loader, updates, the client's `push_all`,
convert, inspect, doctor) asks the codec rather than testing names or formats. The formats served:

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

A codec reads names, shapes and dtypes only, never tensor values, so the client imports it too (a pushed
state dict is split by its names). Its `kind` names its dequant entry points (`expertd.server.load.dequant`:
one part written whole, one part streamed), which sit over its kernel and are the daemon's alone.

Adding a format (NVFP4, int4): one codec class here — its naming (`stored_suffix`, `aux_suffix`), `decoding`
(a stored weight and its aux checked, and what they serve as), `check_aux` (aux tensors the format cannot
have), `check_push` (a pushed weight and its aux) — and its branch in `quantization_format`; its kernel
beside a `*_reference` in `kernels/`; its `kind`'s entry in `server/load/dequant.py`. Nothing else branches on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .dtypes import DEQUANTIZED, FP8, SCALE_SUFFIX
from .errors import CheckpointError, ScaleError, ShapeError, UnsupportedDtypeError, UpdateRejected

SERVED = ("quant_method 'fp8' (DeepSeek FP8 blocks), 'compressed-tensors' (float-quantized FP8 e4m3: channel, tensor "
          "or block weight scales, dynamic activations), 'mxfp4' (gpt-oss), or no quantization_config")
DEFAULT_BLOCK = (128, 128)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # DeepSeek stores float32, Qwen and llmcompressor bf16
# compressed-tensors' other per-module tensors: static activation scales, zero points, group indices
FOREIGN_AUX = ("input_scale", "output_scale", "weight_zero_point", "input_zero_point", "weight_g_idx", "k_scale",
               "v_scale")


class UnsupportedQuantization(CheckpointError):
    """config.json's quantization_config names a format expertd does not serve."""


@dataclass(frozen=True)
class Decoding:
    """What a stored quantized weight serves as: its codec's `kind` (which dequant entry points make it), the
    decoded shape, the (rows, columns) one scale covers (FP8) and how it is quantized, in words."""

    kind: str
    shape: tuple[int, ...]
    block: tuple[int, int] | None = None
    scheme: str = ""


class Codec:
    """What every format answers (see the module docstring). Names: a quantized weight served as `NAME` is stored
    as `NAME + stored_suffix` with its aux tensor `NAME + aux_suffix`; any other tensor serves as itself."""

    kind: str  # its dequant entry points in expertd.server.load.dequant
    stored_suffix = ""
    aux_suffix = ""

    def aux_name(self, weight: str) -> str:
        return weight + self.aux_suffix

    def is_aux(self, name: str, names) -> bool:
        return name.endswith(self.aux_suffix) and name[: len(name) - len(self.aux_suffix)] + self.stored_suffix in names

    def logical(self, names) -> dict[str, tuple[str, str | None]]:
        """{served name: (stored tensor, aux tensor or None)} for every tensor that is not an aux."""
        out = {}
        for n in names:
            if self.is_aux(n, names):
                continue
            if not n.endswith(self.stored_suffix):
                out[n] = (n, None)
                continue
            base = n[: len(n) - len(self.stored_suffix)]
            aux = self.aux_name(base)
            out[base] = (n, aux if aux in names else None)
        return out

    def shape_of(self, name: str, info) -> tuple[int, ...]:
        """The shape stored tensor `info` (a reader's TensorInfo) serves as under the name `name`."""
        return info.shape

    def quantized(self, name: str, info) -> bool:
        """Whether stored tensor `info`, serving `name`, is a weight in this format's quantized form."""
        raise NotImplementedError

    def decoding(self, name: str, info, aux) -> Decoding | None:
        """How stored tensor `info` serves as `name` with its aux tensor `aux` (or None), both checked before a
        byte is read; None: it is no quantized weight of this format and serves as stored."""
        raise NotImplementedError

    def check_aux(self, tensors: dict) -> None:
        """Refuse a checkpoint (`tensors`: name -> TensorInfo) with aux tensors its format cannot have."""

    def check_push(self, stored: str, spec, aux: str | None, aux_spec, want) -> Decoding | None:
        """A pushed tensor `stored` ((shape, dtype name) in `spec`) with its aux, checked against what it replaces
        (`want`: shape and dtype as the index lists them); None: it is not quantized and must match `want` as is."""
        raise NotImplementedError


@dataclass(frozen=True)
class ScaledFp8(Codec):
    """FP8 e4m3 weights, each with a `NAME + suffix` scale over blocks of it (see the module docstring)."""

    method: str | None  # "fp8", "compressed-tensors"; None: no quantization_config
    suffix: str = SCALE_SUFFIX
    strategies: tuple[str, ...] = ("block",)  # of "block", "channel", "tensor": what the config declares
    block_size: tuple[int, int] = DEFAULT_BLOCK  # the "block" strategy's (rows, columns)
    ignore: tuple[str, ...] = ()  # modules the config leaves unquantized (informational: their weights are bf16)

    kind = "fp8"

    @property
    def aux_suffix(self) -> str:
        return self.suffix

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

    def quantized(self, name: str, info) -> bool:
        return info.dtype == DEQUANTIZED

    def decoding(self, name: str, info, aux) -> Decoding | None:
        if info.dtype not in FP8:
            return None
        if info.dtype != DEQUANTIZED:
            raise UnsupportedDtypeError(f"{info.dtype} weights cannot be dequantized (FP8 scales are for "
                                        f"float8_e4m3fn)", file=info.file, tensor=info.name)
        if aux is None:
            raise ScaleError(f"FP8 weight has no {self.aux_name(name)!r}; refusing to serve FP8 bytes as if they "
                             f"were bf16", file=info.file, tensor=info.name)
        if len(info.shape) != 2:
            raise ShapeError(f"FP8 weight must be 2-D for block dequant, has shape {list(info.shape)}",
                             file=info.file, tensor=info.name)
        try:
            block = self.block_for(info.shape, aux.shape)
        except ValueError:
            want = " or ".join(f"{list(s)} ({strategy})" for strategy, s in self.expected_scale(info.shape))
            raise ScaleError(f"scale shape {list(aux.shape)} does not fit weight {list(info.shape)}; expected {want}",
                             file=aux.file, tensor=aux.name) from None
        if aux.dtype not in SCALE_DTYPES:
            raise ScaleError(f"scale dtype {aux.dtype} is not one of {', '.join(map(str, SCALE_DTYPES))}",
                             file=aux.file, tensor=aux.name)
        return Decoding(self.kind, info.shape, block, self.scheme(info.shape, aux.shape))

    def check_aux(self, tensors: dict) -> None:
        """A scale beside a bf16 weight (or none), a compressed-tensors activation scale or zero point mean the
        checkpoint is not what its config claims: dropping or serving them would be silently wrong."""
        for name, info in tensors.items():
            if self.is_aux(name, tensors):
                weight = tensors[name[: -len(self.suffix)]]
                if weight.dtype not in FP8:
                    raise ScaleError(f"scale belongs to a {weight.dtype} weight, not an FP8 one", file=info.file,
                                     tensor=name)
            elif self.method == "compressed-tensors" and name.rsplit(".", 1)[-1] in FOREIGN_AUX:
                raise UnsupportedQuantization(
                    f"{name.rsplit('.', 1)[-1]} tensors are not served (quantization_config declares FP8 weights "
                    f"with dynamic activations; a static scale or zero point would change the numerics)",
                    file=info.file, tensor=name)

    def check_push(self, stored: str, spec, aux: str | None, aux_spec, want) -> Decoding | None:
        shape, dtype = spec
        if dtype != str(DEQUANTIZED) or want.dtype != str(torch.bfloat16) or shape != want.shape:
            return None
        if aux is None:
            raise UpdateRejected(f"FP8 tensor {stored!r} needs its {self.aux_name(stored)!r} pushed with it")
        s_shape, s_dtype = aux_spec
        if len(shape) != 2 or s_dtype not in tuple(map(str, SCALE_DTYPES)):
            raise UpdateRejected(f"FP8 tensor {stored!r} must be 2-D with a float32 (or bf16/fp16) scale, got "
                                 f"{shape} with {s_dtype} {aux!r}")
        try:
            block = self.block_for(tuple(shape), tuple(s_shape))
        except ValueError:
            want_scale = " or ".join(f"{list(w)} ({how})" for how, w in self.expected_scale(tuple(shape)))
            raise UpdateRejected(f"scale {aux!r} must have shape {want_scale} for {stored!r} {shape}, "
                                 f"got {s_shape}") from None
        return Decoding(self.kind, tuple(shape), block)


@dataclass(frozen=True)
class Mxfp4(Codec):
    """gpt-oss MXFP4 experts: `NAME_blocks` + `NAME_scales` served as bf16 `NAME` (see the module docstring)."""

    ignore: tuple[str, ...] = ()  # modules_to_not_convert

    method = "mxfp4"
    kind = "mxfp4"
    stored_suffix = "_blocks"  # the served `NAME` is decoded from `NAME_blocks` and `NAME_scales` and transposed:
    aux_suffix = "_scales"  # no part of it is stored as is
    GROUP = 32  # values per e8m0 scale
    BYTES = 16  # bytes per group (two e2m1 codes each)

    def scheme(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
        return "mxfp4 e2m1, e8m0 scale per 32"

    def served_shape(self, blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, rows, groups, _ = blocks_shape
        return (*lead, groups * self.GROUP, rows)

    def describe(self) -> str:
        return "MXFP4 (gpt-oss: *_blocks e2m1 + *_scales e8m0, 32 per group)"

    def shape_of(self, name: str, info) -> tuple[int, ...]:
        return self.served_shape(info.shape) if self.quantized(name, info) else info.shape

    def quantized(self, name: str, info) -> bool:
        return info.name != name

    def decoding(self, name: str, info, aux) -> Decoding | None:
        if not self.quantized(name, info):
            return None
        if aux is None:
            raise ScaleError(f"MXFP4 blocks have no {self.aux_name(name)!r}; refusing to serve packed e2m1 codes",
                             file=info.file, tensor=info.name)
        if info.dtype != torch.uint8 or len(info.shape) < 3 or info.shape[-1] != self.BYTES:
            raise ShapeError(f"MXFP4 blocks must be uint8 [..., rows, groups, {self.BYTES}] ({self.GROUP} e2m1 "
                             f"values a group, two a byte); found {info.dtype} {list(info.shape)}",
                             file=info.file, tensor=info.name)
        if aux.dtype != torch.uint8 or aux.shape != info.shape[:-1]:
            raise ScaleError(f"MXFP4 scales must be uint8 {list(info.shape[:-1])} (one e8m0 a group of "
                             f"{info.name}); found {aux.dtype} {list(aux.shape)}", file=aux.file, tensor=aux.name)
        return Decoding(self.kind, self.served_shape(info.shape), scheme=self.scheme(info.shape, aux.shape))

    def check_aux(self, tensors: dict) -> None:
        """Scales without their blocks: said so, not that the decoded tensor is missing."""
        for name, info in tensors.items():
            if name.endswith(self.aux_suffix) and not self.is_aux(name, tensors):
                blocks = name[: -len(self.aux_suffix)] + self.stored_suffix
                raise ScaleError(f"MXFP4 scales have no {blocks!r}", file=info.file, tensor=name)

    def check_push(self, stored: str, spec, aux: str | None, aux_spec, want) -> Decoding | None:
        if not stored.endswith(self.stored_suffix):
            return None
        shape, dtype = spec
        if aux is None:
            scales = stored[: -len(self.stored_suffix)] + self.aux_suffix
            raise UpdateRejected(f"MXFP4 blocks {stored!r} need their {scales!r} pushed with them")
        s_shape, s_dtype = aux_spec
        if (dtype != "torch.uint8" or len(shape) < 3 or shape[-1] != self.BYTES or s_dtype != "torch.uint8"
                or s_shape != shape[:-1] or list(self.served_shape(tuple(shape))) != want.shape
                or want.dtype != "torch.bfloat16"):
            raise UpdateRejected(
                f"MXFP4 {stored!r} {dtype} {shape} with {aux!r} {s_dtype} {s_shape} cannot make the served "
                f"{want.dtype} {want.shape}: blocks must be uint8 [..., rows, groups, {self.BYTES}] decoding to "
                f"[..., groups*32, rows], scales uint8 [..., rows, groups]")
        return Decoding(self.kind, tuple(want.shape))


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
