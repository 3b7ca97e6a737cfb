"""Plan what the daemon serves: one entry per model parameter, in the layout the worker's model uses.

With transformers 5.x, MoE experts are fused: `mlp.experts.gate_up_proj` is [E, 2I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` is [E, H, I]. The plan reads
these fusions from transformers' own conversion mapping for the model type, builds the model
skeleton on the meta device to learn every expected name and shape, and checks the checkpoint
against it: every tensor present, every FP8 weight with a well-formed scale, expert shapes
consistent. Each served tensor is the concatenation of its checkpoint sources in order, so each
per-expert checkpoint tensor stays addressable as a contiguous view of its fused block; a parameter
that transformers converts with any other op (transpose, chunk, interleave, ...) is computed at load
from all its sources (`PlannedTensor.computed`) and is no view of them.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from expertd.dtypes import DEQUANTIZED, FP8, SCALE_SUFFIX
from expertd.errors import CheckpointError, MissingTensorError, ScaleError, ShapeError, UnsupportedDtypeError
from expertd.hf import Assembly, checkpoint_assembly, expert_name
from expertd.partition import ExpertBlock, ExpertParallel

from .quantization import quantization_format
from .reader import Checkpoint, TensorInfo

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # DeepSeek stores float32, Qwen bf16; used as float32


def is_fp8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSeek-V3 stores every linear weight inside the layers as FP8, except the router."""
    return (
        len(shape) == 2 and name.startswith("model.layers.") and name.endswith("proj.weight")
        or name.endswith("kv_a_proj_with_mqa.weight")
    )


@dataclass
class Source:
    """One checkpoint tensor feeding a served tensor; `scale` is set for FP8 weights."""

    name: str
    info: TensorInfo
    scale: TensorInfo | None = None


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[Source] = field(default_factory=list)
    computed: Assembly | None = None  # set when transformers' conversion is more than a rename or a stack
    experts: ExpertBlock | None = None  # an expert stack of which a partitioned daemon serves some experts

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def source_shape(self) -> tuple[int, ...]:
        return self.sources[0].info.shape


@dataclass
class Plan:
    model_type: str
    layout: str  # "transformers-fused" when any fusion or computed conversion applies, else "checkpoint"
    block_size: tuple[int, int]
    tensors: list[PlannedTensor]
    expert_parallel: ExpertParallel | None = None  # None: every expert is served

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def block_size_of(config: dict, file: str | None = None) -> tuple[int, int]:
    """The FP8 block size a config declares (its quantization format checked: see `quantization`)."""
    return quantization_format(config, file).block_size


def check_scale_pairs(ckpt: Checkpoint) -> None:
    """Every `*_scale_inv` must belong to an FP8 weight: a scale beside a bf16 weight (or none) means
    the checkpoint is not what it claims, and dropping the scale would serve wrong values silently."""
    for name, info in ckpt.tensors.items():
        if name.endswith(SCALE_SUFFIX):
            weight = ckpt.tensors.get(name[: -len(SCALE_SUFFIX)])
            if weight is None or weight.dtype not in FP8:
                what = "no weight" if weight is None else f"a {weight.dtype} weight"
                raise ScaleError(f"scale belongs to {what}, not an FP8 one", file=info.file, tensor=name)


def attach_scale(ckpt: Checkpoint, info: TensorInfo, block: tuple[int, int]) -> TensorInfo | None:
    """The scale of an FP8 weight, checked; None for a weight that is not FP8."""
    if info.dtype not in FP8:
        return None
    if info.dtype != DEQUANTIZED:
        raise UnsupportedDtypeError(
            f"{info.dtype} weights cannot be dequantized (DeepSeek-V3 block scales are for float8_e4m3fn)",
            file=info.file, tensor=info.name,
        )
    scale = ckpt.tensors.get(info.name + SCALE_SUFFIX)
    if scale is None:
        raise ScaleError(
            f"FP8 weight has no {info.name + SCALE_SUFFIX!r}; refusing to serve FP8 bytes as if they were bf16",
            file=info.file,
            tensor=info.name,
        )
    if len(info.shape) != 2:
        raise ShapeError(f"FP8 weight must be 2-D for block dequant, has shape {list(info.shape)}", file=info.file, tensor=info.name)
    want = (math.ceil(info.shape[0] / block[0]), math.ceil(info.shape[1] / block[1]))
    if scale.shape != want:
        raise ScaleError(
            f"scale shape {list(scale.shape)} does not fit weight {list(info.shape)} with {block[0]}x{block[1]} blocks; "
            f"expected {list(want)}",
            file=scale.file,
            tensor=scale.name,
        )
    if scale.dtype not in SCALE_DTYPES:
        raise ScaleError(f"scale dtype {scale.dtype} is not one of {', '.join(map(str, SCALE_DTYPES))}",
                         file=scale.file, tensor=scale.name)
    return scale


def check_scale_values(ckpt: Checkpoint, scale: TensorInfo) -> None:
    """Scales must be finite and positive: a NaN or zero scale silently ruins a whole block."""
    values = ckpt.view(scale)
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
        values = torch.frombuffer(buf, dtype=dtype).float().numpy() if buf else np.zeros(0, np.float32)
        if not bool(((values > 0) & (values < np.inf)).all()):  # NaN fails both, -inf and 0 the first
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
    block = block_size_of(config, os.path.join(ckpt.folder, "config.json"))  # refuses formats it cannot serve
    weights = [n for n in ckpt.tensors if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in ckpt.tensors)]
    assembly, unused, expected = checkpoint_assembly(config, weights)
    planned: list[PlannedTensor] = []

    def source(name: str, param: str, want_shape: tuple[int, ...], what: str) -> Source:
        """The checkpoint tensor `name` for `param`, shape checked before its scale."""
        info = ckpt.tensors[name]
        if info.shape != want_shape:
            raise ShapeError(f"shape {list(info.shape)} does not match {what} {list(want_shape)}", file=info.file, tensor=name)
        return Source(name, info, attach_scale(ckpt, info, block))

    for param, (shape, _) in expected.items():
        how = assembly.get(param)
        if how is None:
            raise MissingTensorError(
                f"checkpoint lacks a tensor the model needs (for parameter {param!r})", file=ckpt.folder, tensor=param
            )
        if how.computed:  # source shapes are the converter's business: the result is checked at load
            srcs = [Source(n, ckpt.tensors[n], attach_scale(ckpt, ckpt.tensors[n], block)) for n in how.sources]
            dtypes = {served_dtype(s) for s in srcs}
            if len(dtypes) != 1:
                raise ShapeError(f"sources of {param} mix dtypes {sorted(map(str, dtypes))}", file=srcs[0].info.file,
                                 tensor=srcs[0].name)
            planned.append(PlannedTensor(param, shape, dtypes.pop(), srcs, how))
            continue
        if not how.patterns:
            src = source(how.sources[0], param, shape, f"the model's {param!r}")
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
            partition.check_experts(experts, param)
            share = ExpertBlock(experts, tuple(partition.ranges(experts)))
            names = [n for e in share.experts() for n in how.sources[e * per_expert: (e + 1) * per_expert]]
            shape = (share.count, *shape[1:])
        srcs = [source(n, param, part, f"one expert's part of {param} {list(shape)}:") for n in names]
        dtypes = {served_dtype(s) for s in srcs}
        if len(dtypes) != 1:
            raise ShapeError(f"experts of {param} mix dtypes {sorted(map(str, dtypes))}", file=srcs[0].info.file, tensor=srcs[0].name)
        planned.append(PlannedTensor(param, shape, dtypes.pop(), srcs, experts=share))

    check_scale_pairs(ckpt)  # after the model's own tensors, so a missing weight is named as such

    # Tensors the model does not use (e.g. DeepSeek-V3's multi-token-prediction layer) are still
    # served under their checkpoint names, so `tensors()` covers the whole checkpoint (of a partition: its experts).
    for name in unused if partition is None else unused_share(unused, partition):
        info = ckpt.tensors[name]
        src = Source(name, info, attach_scale(ckpt, info, block))
        planned.append(PlannedTensor(name, info.shape, served_dtype(src), [src]))

    if check_values:
        check_scales(ckpt, [s.scale for t in planned for s in t.sources if s.scale is not None])
    layout = "transformers-fused" if any(len(t.sources) > 1 or t.computed for t in planned) else "checkpoint"
    return Plan(model_type, layout, block, planned, partition)


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
