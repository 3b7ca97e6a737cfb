"""Plan what the daemon serves: one entry per model parameter, in the layout the worker's model uses.

With transformers 5.x, MoE experts are fused: `mlp.experts.gate_up_proj` is [E, 2I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` is [E, H, I]. The plan reads
these fusions from transformers' own conversion mapping for the model type, builds the model
skeleton on the meta device to learn every expected name and shape, and checks the checkpoint
against it: every tensor present, every quantized weight with well-formed aux tensors (the checkpoint's
format is a codec from `quantization`), expert shapes consistent. Each served tensor is the concatenation of its checkpoint sources in order, so each
per-expert checkpoint tensor stays addressable as a contiguous view of its fused block; a parameter
that transformers converts with any other op (transpose, chunk, interleave, ...) is computed at load
from all its sources (`PlannedTensor.computed`) and is no view of them.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from expertd.dtypes import DEQUANTIZED, FP8
from expertd.errors import MissingTensorError, ScaleError, ShapeError, UnsupportedDtypeError
from expertd.hf import Assembly, checkpoint_assembly, expert_name
from expertd.partition import ExpertBlock, ExpertParallel, expert_sharded

from .quantization import SCALE_DTYPES, Codec, Mxfp4, UnsupportedQuantization, quantization_format
from .reader import Checkpoint, TensorInfo

def is_fp8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSeek-V3 stores every linear weight inside the layers as FP8, except the router."""
    return (
        len(shape) == 2 and name.startswith("model.layers.") and name.endswith("proj.weight")
        or name.endswith("kv_a_proj_with_mqa.weight")
    )


@dataclass
class Source:
    """One checkpoint tensor feeding a served tensor. A quantized weight has its aux tensor in `scale` (an FP8
    weight's scale, MXFP4 blocks' scales) and the codec's `kind`; `shape` is what it serves as."""

    name: str
    info: TensorInfo
    scale: TensorInfo | None = None
    kind: str = "plain"  # "plain" (bytes as stored), "fp8" (scaled e4m3), "mxfp4" (blocks + scales)
    block: tuple[int, int] | None = None  # fp8: the (rows, columns) one scale covers
    served_shape: tuple[int, ...] | None = None  # mxfp4: the decoded shape; else the stored one
    scheme: str = ""  # how it is quantized, in words (inspect, doctor); "" for plain

    @property
    def shape(self) -> tuple[int, ...]:
        return self.served_shape or self.info.shape

    def rows(self, first: int, count: int) -> "Source":
        """Experts [first, first + count) of a pre-fused expert stack (outermost dimension the experts, in the
        weight and its aux alike): the same checkpoint tensor, fewer rows read."""
        return replace(
            self, info=self.info.rows(first, count), scale=self.scale.rows(first, count) if self.scale else None,
            served_shape=(count, *self.served_shape[1:]) if self.served_shape else None)


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[Source] = field(default_factory=list)
    computed: Assembly | None = None  # set when transformers' conversion is more than a rename or a stack
    experts: ExpertBlock | None = None  # an expert stack of which a partitioned daemon serves some experts
    decoded: torch.dtype | None = None  # the dtype its sources decode to, when the model loads it as `dtype` (a cast)

    @property
    def whole(self) -> bool:
        """Made from all its sources at once (computed, or cast after decoding), not part by part in place."""
        return self.computed is not None or self.decoded is not None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.sources[0].shape

    @property
    def source_names(self) -> list[str]:
        """The checkpoint names it is made of, each once (a partitioned pre-fused stack reads rows of one)."""
        return list(dict.fromkeys(s.name for s in self.sources))


@dataclass
class Plan:
    model_type: str
    layout: str  # "transformers-fused" when any fusion or computed conversion applies, else "checkpoint"
    codec: Codec  # the checkpoint's quantization format
    tensors: list[PlannedTensor]
    expert_parallel: ExpertParallel | None = None  # None: every expert is served

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def check_aux(ckpt: Checkpoint, codec: Codec) -> None:
    """Every aux tensor belongs to a quantized weight of its format, and no tensor is of a kind the format
    leaves out: a scale beside a bf16 weight (or none), MXFP4 scales without blocks, a compressed-tensors
    activation scale or zero point mean the checkpoint is not what its config claims, and dropping or
    serving them would be silently wrong."""
    names = ckpt.tensors
    for name, info in names.items():
        if codec.kind == "mxfp4":
            if name.endswith(codec.scales_suffix) and name[: -len(codec.scales_suffix)] + codec.blocks_suffix not in names:
                raise ScaleError(f"MXFP4 scales have no {name[: -len(codec.scales_suffix)] + codec.blocks_suffix!r}",
                                 file=info.file, tensor=name)
        elif codec.is_aux(name, names):
            weight = names[name[: -len(codec.suffix)]]
            if weight.dtype not in FP8:
                raise ScaleError(f"scale belongs to a {weight.dtype} weight, not an FP8 one", file=info.file, tensor=name)
        elif codec.method == "compressed-tensors" and name.rsplit(".", 1)[-1] in FOREIGN_AUX:
            raise UnsupportedQuantization(
                f"{name.rsplit('.', 1)[-1]} tensors are not served (quantization_config declares FP8 weights with "
                f"dynamic activations; a static scale or zero point would change the numerics)",
                file=info.file, tensor=name)


# compressed-tensors' other per-module tensors: static activation scales, zero points, group indices
FOREIGN_AUX = ("input_scale", "output_scale", "weight_zero_point", "input_zero_point", "weight_g_idx", "k_scale",
               "v_scale")


def make_source(ckpt: Checkpoint, codec: Codec, name: str, stored: str, aux: str | None) -> Source:
    """The source serving `name` from checkpoint tensor `stored` (and its aux), checked against the codec."""
    info = ckpt.tensors[stored]
    if codec.kind == "mxfp4" and stored != name:
        return _mxfp4_source(ckpt, codec, name, info, aux)
    if info.dtype not in FP8:
        return Source(name, info)
    if info.dtype != DEQUANTIZED:
        raise UnsupportedDtypeError(f"{info.dtype} weights cannot be dequantized (FP8 scales are for float8_e4m3fn)",
                                    file=info.file, tensor=info.name)
    if aux is None:
        raise ScaleError(
            f"FP8 weight has no {codec.aux_name(name)!r}; refusing to serve FP8 bytes as if they were bf16",
            file=info.file, tensor=info.name,
        )
    scale = ckpt.tensors[aux]
    if len(info.shape) != 2:
        raise ShapeError(f"FP8 weight must be 2-D for block dequant, has shape {list(info.shape)}", file=info.file,
                         tensor=info.name)
    try:
        block = codec.block_for(info.shape, scale.shape)
    except ValueError:
        want = " or ".join(f"{list(s)} ({strategy})" for strategy, s in codec.expected_scale(info.shape))
        raise ScaleError(f"scale shape {list(scale.shape)} does not fit weight {list(info.shape)}; expected {want}",
                         file=scale.file, tensor=scale.name) from None
    if scale.dtype not in SCALE_DTYPES:
        raise ScaleError(f"scale dtype {scale.dtype} is not one of {', '.join(map(str, SCALE_DTYPES))}",
                         file=scale.file, tensor=scale.name)
    return Source(name, info, scale, "fp8", block, scheme=codec.scheme(info.shape, scale.shape))


def _mxfp4_source(ckpt: Checkpoint, codec: Mxfp4, name: str, blocks: TensorInfo, aux: str | None) -> Source:
    if aux is None:
        raise ScaleError(f"MXFP4 blocks have no {name + codec.scales_suffix!r}; refusing to serve packed e2m1 codes",
                         file=blocks.file, tensor=blocks.name)
    scales = ckpt.tensors[aux]
    if blocks.dtype != torch.uint8 or len(blocks.shape) < 3 or blocks.shape[-1] != codec.BYTES:
        raise ShapeError(f"MXFP4 blocks must be uint8 [..., rows, groups, {codec.BYTES}] ({codec.GROUP} e2m1 values a "
                         f"group, two a byte); found {blocks.dtype} {list(blocks.shape)}",
                         file=blocks.file, tensor=blocks.name)
    if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
        raise ScaleError(f"MXFP4 scales must be uint8 {list(blocks.shape[:-1])} (one e8m0 a group of "
                         f"{blocks.name}); found {scales.dtype} {list(scales.shape)}", file=scales.file, tensor=scales.name)
    return Source(name, blocks, scales, "mxfp4", served_shape=codec.served_shape(blocks.shape),
                  scheme=codec.scheme(blocks.shape, scales.shape))


def check_scale_values(ckpt: Checkpoint, scale: TensorInfo) -> None:
    """Scales must be finite and positive: a NaN or zero scale silently ruins a whole block (an MXFP4 e8m0
    scale byte 0xff is its NaN)."""
    values = ckpt.view(scale)
    if values.dtype == torch.uint8:
        bad = values == 0xFF
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            raise ScaleError(f"e8m0 scale byte 0xff (NaN) at group {where}: the group's 32 values would be NaN",
                             file=scale.file, tensor=scale.name)
        return
    flat = values.reshape(-1).float().numpy()  # bf16 / fp16 scales are used as float32: exact
    if flat.size and bool(((flat > 0) & (flat < np.inf)).all()):  # NaN fails both, -inf and 0 the first
        return
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ScaleError(
            f"scale has non-finite or non-positive values (first at block {list(where)}: {values[where].item()})",
            file=scale.file,
            tensor=scale.name,
        )


def check_scales(ckpt: Checkpoint, scales: list[TensorInfo]) -> None:
    """`check_scale_values` for many scales: read into one buffer per dtype and checked at once (tens
    of thousands of small scales cost one numpy pass, not one each); a failure is named by the
    per-scale check."""
    by_dtype: dict[torch.dtype, list[TensorInfo]] = {}
    for scale in scales:
        by_dtype.setdefault(scale.dtype, []).append(scale)
    for dtype, infos in by_dtype.items():
        buf = bytearray(sum(i.nbytes for i in infos))
        mem, at = memoryview(buf), 0
        for info in infos:
            ckpt.read_into(info, 0, mem[at: at + info.nbytes])
            at += info.nbytes
        if dtype == torch.uint8:  # MXFP4's e8m0: every byte but 0xff is a power of two
            ok = not buf or int(np.frombuffer(buf, np.uint8).max()) != 0xFF
        else:
            values = torch.frombuffer(buf, dtype=dtype).float().numpy() if buf else np.zeros(0, np.float32)
            ok = bool(((values > 0) & (values < np.inf)).all())  # NaN fails both, -inf and 0 the first
        if not ok:
            for info in infos:
                check_scale_values(ckpt, info)


def plan_checkpoint(ckpt: Checkpoint, check_values: bool = True, partition: ExpertParallel | None = None) -> Plan:
    """Check the checkpoint against the model its config describes and plan every served tensor.

    Which checkpoint tensors make which parameter is read from transformers' own loading rules for the
    model (renames, expert stacks, other ops): each served tensor is exactly what transformers would put
    in the parameter; for renames and stacks each of its checkpoint sources is a contiguous part of it.
    With `partition`, an expert stack holds only the experts of the partition's ranks (their blocks back
    to back) and only their checkpoint tensors are sources: the others are never read.
    """
    config = ckpt.config
    model_type = config.get("model_type", "")
    codec = quantization_format(config, os.path.join(ckpt.folder, "config.json"))  # refuses formats it cannot serve
    served = codec.logical(ckpt.tensors)  # {name the model sees: (stored tensor, aux tensor)}
    assembly, unused, expected = checkpoint_assembly(config, list(served))
    planned: list[PlannedTensor] = []
    by_expert = expert_sharded(config) if partition is not None else None
    if isinstance(codec, Mxfp4):  # scales without their blocks: say so, not that the decoded tensor is missing
        check_aux(ckpt, codec)

    def source(name: str, param: str | None = None, want_shape: tuple[int, ...] | None = None, what: str = "") -> Source:
        """The source serving checkpoint name `name` (for `param`: shape checked before its aux)."""
        stored, aux = served[name]
        info = ckpt.tensors[stored]
        shape = codec.served_shape(info.shape) if isinstance(codec, Mxfp4) and stored != name else info.shape
        if want_shape is not None and shape != want_shape:
            raise ShapeError(f"shape {list(shape)} does not match {what} {list(want_shape)}", file=info.file,
                             tensor=stored)
        return make_source(ckpt, codec, name, stored, aux)

    for param, (shape, _) in expected.items():
        how = assembly.get(param)
        if how is None:
            raise MissingTensorError(
                f"checkpoint lacks a tensor the model needs (for parameter {param!r})", file=ckpt.folder, tensor=param
            )
        if how.computed:  # source shapes are the converter's business: the result is checked at load
            srcs = [source(n) for n in how.sources]
            dtypes = {served_dtype(s) for s in srcs}
            if len(dtypes) != 1:
                raise ShapeError(f"sources of {param} mix dtypes {sorted(map(str, dtypes))}", file=srcs[0].info.file,
                                 tensor=srcs[0].name)
            planned.append(PlannedTensor(param, shape, dtypes.pop(), srcs, how))
            continue
        if not how.patterns:
            src = source(how.sources[0], param, shape, f"the model's {param!r}")
            if partition is not None and by_expert(param):  # a pre-fused expert stack (gpt-oss): its ranks' rows
                share = _share(partition, src, shape, param)
                planned.append(PlannedTensor(param, (share.count, *shape[1:]), served_dtype(src),
                                             [src.rows(first, count) for first, count in share.ranges], experts=share))
            else:
                planned.append(PlannedTensor(param, shape, served_dtype(src), [src]))
            continue
        per_expert = len(how.patterns)
        experts = len(how.sources) // per_expert
        if len(shape) >= 2 and experts < shape[0]:
            raise MissingTensorError(
                f"checkpoint lacks a tensor the model needs (expert {experts} of {shape[0]} for parameter {param!r})",
                file=ckpt.folder, tensor=expert_name(how.sources[0::per_expert], experts),
            )
        if len(shape) < 2 or experts != shape[0] or shape[1] % per_expert:
            raise ShapeError(f"{experts} experts of {per_expert} part(s) cannot make {param} {list(shape)}",
                             file=ckpt.tensors[how.sources[0]].file, tensor=how.sources[0])
        part = (shape[1] // per_expert, *shape[2:])
        names, share = how.sources, None
        if partition is not None:
            share = partition.block(experts, param)
            names = [n for e in share.experts() for n in how.sources[e * per_expert: (e + 1) * per_expert]]
            shape = (share.count, *shape[1:])
        srcs = [source(n, param, part, f"one expert's part of {param} {list(shape)}:") for n in names]
        dtypes = {served_dtype(s) for s in srcs}
        if len(dtypes) != 1:
            raise ShapeError(f"experts of {param} mix dtypes {sorted(map(str, dtypes))}", file=srcs[0].info.file, tensor=srcs[0].name)
        planned.append(PlannedTensor(param, shape, dtypes.pop(), srcs, experts=share))

    for t in planned:  # served in the dtype the model loads it as (transformers' keep-in-fp32 rules)
        want = expected[t.name][1]
        if want != t.dtype and want.is_floating_point and t.dtype.is_floating_point:
            t.decoded, t.dtype = t.dtype, want

    check_aux(ckpt, codec)  # after the model's own tensors, so a missing weight is named as such

    # Tensors the model does not use (e.g. DeepSeek-V3's multi-token-prediction layer) are still
    # served under their checkpoint names, so `tensors()` covers the whole checkpoint (of a partition: its experts).
    for name in unused if partition is None else unused_share(unused, partition):
        src = source(name)
        planned.append(PlannedTensor(name, src.shape, served_dtype(src), [src]))

    if check_values:
        check_scales(ckpt, [s.scale for t in planned for s in t.sources if s.scale is not None])
    layout = "transformers-fused" if any(len(t.source_names) > 1 or t.computed for t in planned) else "checkpoint"
    return Plan(model_type, layout, codec, planned, partition)


def _share(partition: ExpertParallel, src: Source, shape: tuple[int, ...], param: str) -> ExpertBlock:
    """The experts of a pre-fused stack `param` [E, ...] a partition serves; the stored tensor (and its aux) must
    have the experts outermost too, so each rank's experts are one contiguous run of its bytes."""
    experts = shape[0]
    share = partition.block(experts, param)
    for info in (src.info, src.scale):
        if info is not None and (not info.shape or info.shape[0] != experts):
            raise ShapeError(f"a partitioned daemon serves some experts of {param} {list(shape)}, but this stored "
                             f"tensor {list(info.shape)} does not have its {experts} experts outermost",
                             file=info.file, tensor=info.name)
    return share


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def unused_share(names: list[str], partition: ExpertParallel) -> list[str]:
    """Of the tensors the model does not use, those a partition serves: per-expert tensors (`....experts.N....`)
    of its ranks' experts when their layer's expert count divides into the partition's size; all others."""
    matches = [(name, _EXPERT.match(name)) for name in names]
    layers: dict[str, set[int]] = {}
    for _, m in matches:
        if m:
            layers.setdefault(m.group(1), set()).add(int(m.group(2)))
    out = []
    for name, m in matches:
        experts = len(layers[m.group(1)]) if m else 0
        if m is None or experts % partition.size or partition.serves(int(m.group(2)), experts):
            out.append(name)
    return out


def served_dtype(src: Source) -> torch.dtype:
    """FP8 weights are served dequantized to bf16; everything else in its stored dtype."""
    return torch.bfloat16 if src.scale is not None else src.info.dtype
