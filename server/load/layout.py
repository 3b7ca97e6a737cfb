"""Plan what the daemon serves: one entry per model parameter, in the layout the worker's model uses.

With transformers 5.x, MoE experts are fused: `mlp.experts.gate_up_proj` is [E, 2I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` is [E, H, I]. The plan reads
these fusions from transformers' own conversion mapping for the model type, builds the model
skeleton on the meta device to learn every expected name and shape, and checks the checkpoint
against it: every tensor present, every quantized weight with well-formed aux tensors (the checkpoint's
format is a class from `expertd.formats`, picked by `expertd.quantization`), expert shapes consistent. Each
served tensor is the concatenation of its checkpoint sources in order, so each
per-expert checkpoint tensor stays addressable as a contiguous view of its fused block; a parameter
that transformers converts with any other op (transpose, chunk, interleave, ...) is computed at load
from all its sources (`PlannedTensor.computed`) and is no view of them.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from expertd.errors import MissingTensorError, ScaleError, ShapeError
from expertd.formats.codec import Codec, Decoding
from expertd.hf import Assembly, checkpoint_assembly, expert_name
from expertd.partition import ExpertBlock, ExpertParallel, expert_sharded, fused_experts
from expertd.quantization import quantization_format

from ..shm.heap import collection_paused
from .checkpoint import Checkpoint, TensorInfo
from .layout_cache import LayoutCache


def is_fp8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSeek-V3 stores every linear weight inside the layers as FP8, except the router."""
    return (
        len(shape) == 2 and name.startswith("model.layers.") and name.endswith("proj.weight")
        or name.endswith("kv_a_proj_with_mqa.weight")
    )


@dataclass
class Source:
    """One checkpoint tensor feeding a served tensor. A quantized weight has its aux tensor in `scale` (an FP8
    weight's scale, MXFP4 blocks' scales) and what its codec decodes it to in `decoding`."""

    name: str
    info: TensorInfo
    scale: TensorInfo | None = None
    decoding: Decoding | None = None  # None: served as stored

    @property
    def shape(self) -> tuple[int, ...]:
        return self.decoding.shape if self.decoding else self.info.shape

    @property
    def codec(self) -> Codec | None:
        """Its format, whose dequant entry points make it; None: served as stored."""
        return self.decoding.codec if self.decoding else None

    @property
    def block(self) -> tuple[int, int] | None:
        """FP8: the (rows, columns) one scale covers."""
        return self.decoding.block if self.decoding else None

    @property
    def scheme(self) -> str:
        """How it is quantized, in words (inspect, doctor); "" for plain."""
        return self.decoding.scheme if self.decoding else ""

    def rows(self, first: int, count: int) -> "Source":
        """Experts [first, first + count) of a pre-fused expert stack (outermost dimension the experts, in the
        weight and its aux alike): the same checkpoint tensor, fewer rows read."""
        d = self.decoding
        return replace(self, info=self.info.rows(first, count),
                       scale=self.scale.rows(first, count) if self.scale else None,
                       decoding=replace(d, shape=(count, *d.shape[1:])) if d else None)


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
    layout_cached: bool = False  # transformers' answer read from the layout cache (transformers not imported)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def make_source(ckpt: Checkpoint, codec: Codec, name: str, stored: str, aux: str | None) -> Source:
    """The source serving `name` from checkpoint tensor `stored` (and its aux), checked by the codec."""
    info, scale = ckpt.tensors[stored], ckpt.tensors[aux] if aux is not None else None
    decoding = codec.decoding(name, info, scale)
    return Source(name, info, scale, decoding) if decoding else Source(name, info)


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


def read_packed(ckpt: Checkpoint, infos: list[TensorInfo], gap: int = 16 << 10, run: int = 4 << 20) -> bytearray:
    """The bytes of `infos` back to back, in their order: tensors of one shard at most `gap` bytes apart are read
    in one call with what lies between them, in runs of at most `run` bytes (tens of thousands of small scales
    beside small weights cost a few reads, not one each; copying a small gap costs less than a call)."""
    out = bytearray(sum(i.nbytes for i in infos))
    mem, at = memoryview(out), [0, *itertools.accumulate(i.nbytes for i in infos)]
    order = sorted(range(len(infos)), key=lambda k: (infos[k].file, infos[k].offset))
    first = 0
    while first < len(order):
        head = infos[order[first]]
        end, last = head.offset + head.nbytes, first + 1
        while last < len(order):
            info = infos[order[last]]
            if info.file != head.file or info.offset - end > gap or info.offset + info.nbytes - head.offset > run:
                break
            end, last = max(end, info.offset + info.nbytes), last + 1
        span = bytearray(end - head.offset)
        ckpt.read_into(head, 0, memoryview(span))
        for k in order[first:last]:
            begin = infos[k].offset - head.offset
            mem[at[k]: at[k + 1]] = span[begin: begin + infos[k].nbytes]
        first = last
    return out


def check_scales(ckpt: Checkpoint, scales: list[TensorInfo]) -> None:
    """`check_scale_values` for many scales: read into one buffer per dtype and checked at once (tens
    of thousands of small scales cost one numpy pass, not one each); a failure is named by the
    per-scale check."""
    by_dtype: dict[torch.dtype, list[TensorInfo]] = {}
    for scale in scales:
        by_dtype.setdefault(scale.dtype, []).append(scale)
    for dtype, infos in by_dtype.items():
        buf = read_packed(ckpt, infos)
        if dtype == torch.uint8:  # MXFP4's e8m0: every byte but 0xff is a power of two
            ok = not buf or int(np.frombuffer(buf, np.uint8).max()) != 0xFF
        else:
            values = torch.frombuffer(buf, dtype=dtype).float().numpy() if buf else np.zeros(0, np.float32)
            ok = bool(((values > 0) & (values < np.inf)).all())  # NaN fails both, -inf and 0 the first
        if not ok:
            for info in infos:
                check_scale_values(ckpt, info)


@collection_paused()
def plan_checkpoint(ckpt: Checkpoint, check_values: bool = True, partition: ExpertParallel | None = None,
                    layouts: LayoutCache | None = None) -> Plan:
    """Check the checkpoint against the model its config describes and plan every served tensor.

    Which checkpoint tensors make which parameter is read from transformers' own loading rules for the
    model (renames, expert stacks, other ops): each served tensor is exactly what transformers would put
    in the parameter; for renames and stacks each of its checkpoint sources is a contiguous part of it.
    With `partition`, an expert stack holds only the experts of the partition's ranks (their blocks back
    to back) and only their checkpoint tensors are sources: the others are never read. With `layouts`, transformers'
    answer is read from that cache where an earlier start left it (`layout_cache`).
    """
    config = ckpt.config
    codec = quantization_format(config, os.path.join(ckpt.folder, "config.json"))  # refuses formats it cannot serve
    codec.check_aux(ckpt.tensors)  # aux tensors the format cannot have: named, not the tensor they would hide
    sources = _Sources(ckpt, codec)
    ask = layouts.assembly if layouts is not None else checkpoint_assembly
    assembly, unused, expected = ask(config, list(sources.served))
    sharded = expert_sharded(config) if partition is not None else None
    planned: list[PlannedTensor] = []
    for param, (shape, dtype) in expected.items():
        how = assembly.get(param)
        if how is None:
            raise MissingTensorError(
                f"checkpoint lacks a tensor the model needs (for parameter {param!r})", file=ckpt.folder, tensor=param
            )
        if how.computed:  # source shapes are the converter's business: the result is checked at load
            srcs = [sources(n) for n in how.sources]
            t = PlannedTensor(param, shape, _one_dtype(srcs, f"sources of {param}"), srcs, how)
        elif how.patterns:
            t = _stacked(param, shape, how.sources, len(how.patterns), sources, partition)
        else:
            t = _renamed(param, shape, how.sources[0], sources, partition if sharded and sharded(param) else None)
        if dtype != t.dtype and dtype.is_floating_point and t.dtype.is_floating_point:
            t.decoded, t.dtype = t.dtype, dtype  # served in the dtype the model loads it as (keep-in-fp32 rules)
        planned.append(t)

    # Tensors the model does not use (e.g. DeepSeek-V3's multi-token-prediction layer) are still
    # served under their checkpoint names, so `tensors()` covers the whole checkpoint (of a partition: its experts).
    for name in unused if partition is None else unused_share(unused, partition):
        src = sources(name)
        planned.append(PlannedTensor(name, src.shape, served_dtype(src), [src]))

    if check_values:
        check_scales(ckpt, [s.scale for t in planned for s in t.sources if s.scale is not None])
    layout = "transformers-fused" if any(len(t.source_names) > 1 or t.computed for t in planned) else "checkpoint"
    return Plan(config.get("model_type", ""), layout, codec, planned, partition,
                layouts is not None and layouts.hit)


class _Sources:
    """The checkpoint's tensors by the names the model sees (the codec's), each made a checked `Source` when asked."""

    def __init__(self, ckpt: Checkpoint, codec: Codec):
        self.ckpt, self.codec = ckpt, codec
        self.served = codec.logical(ckpt.tensors)  # {name the model sees: (stored tensor, aux tensor)}
        self.answers: dict[tuple, tuple] = {}  # (own name?, dtypes, shapes) -> (served shape, decoding)

    def __call__(self, name: str, want: tuple[int, ...] | None = None, what: str = "") -> Source:
        """The source serving `name`; with `want`, the shape it serves as checked first (before its aux)."""
        stored, aux = self.served[name]
        tensors = self.ckpt.tensors
        info = tensors[stored]
        scale = tensors[aux] if aux is not None else None
        # A codec's answers depend on the name only through whether it is the stored tensor's own (MXFP4's
        # blocks serve under another), otherwise on dtypes and shapes: tens of thousands of experts ask a few
        # questions, answered once each (~10 us saved per expert weight).
        key = (stored == name, info.dtype, info.shape, None if scale is None else (scale.dtype, scale.shape))
        known = self.answers.get(key)
        shape = known[0] if known is not None else self.codec.shape_of(name, info)
        if want is not None and shape != want:
            raise ShapeError(f"shape {list(shape)} does not match {what} {list(want)}", file=info.file, tensor=stored)
        if known is None:  # checked by the codec (errors name this tensor); only what passed is remembered
            known = self.answers[key] = (shape, make_source(self.ckpt, self.codec, name, stored, aux).decoding)
        decoding = known[1]
        return Source(name, info, scale, decoding) if decoding else Source(name, info)


def _renamed(param: str, shape: tuple[int, ...], name: str, sources: _Sources,
             partition: ExpertParallel | None) -> PlannedTensor:
    """One checkpoint tensor as the parameter; with `partition`, a pre-fused expert stack [E, ...] (gpt-oss) of
    which it serves its ranks' rows: the stored tensor and its aux must have the experts outermost too, so each
    rank's experts are one contiguous run of their bytes."""
    src = sources(name, shape, f"the model's {param!r}")
    if partition is None:  # an expert stack is read expert by expert: a reload rewrites only the experts that changed
        return PlannedTensor(param, shape, served_dtype(src), _by_expert(param, shape, src))
    share = partition.block(shape[0], param)
    for info in (src.info, src.scale):
        if info is not None and share.stack_rows(info.shape) is None:
            raise ShapeError(f"a partitioned daemon serves some experts of {param} {list(shape)}, but this stored "
                             f"tensor {list(info.shape)} does not have its {share.total} experts outermost",
                             file=info.file, tensor=info.name)
    return PlannedTensor(param, (share.count, *shape[1:]), served_dtype(src),
                         [src.rows(first, count) for first, count in share.stack_rows(src.info.shape)], experts=share)


def _by_expert(param: str, shape: tuple[int, ...], src: Source) -> list[Source]:
    """A pre-fused expert stack [E, R, C] (gpt-oss) as E sources, one per expert's rows, where its stored tensor and
    aux have the experts outermost: each expert is then a part of its own (digested, compared with the previous
    generation's and written on its own, `expert_ranges`). Else the one source."""
    experts = fused_experts(param, shape)
    if not experts or any(info is not None and tuple(info.shape[:1]) != (experts,) for info in (src.info, src.scale)):
        return [src]
    return [src.rows(e, 1) for e in range(experts)]


def _stacked(param: str, shape: tuple[int, ...], names: list[str], per_expert: int, sources: _Sources,
             partition: ExpertParallel | None) -> PlannedTensor:
    """Per-expert checkpoint tensors (`per_expert` each) back to back as an expert stack [E, ...]; with
    `partition`, only its ranks' experts."""
    experts = len(names) // per_expert
    if len(shape) >= 2 and experts < shape[0]:
        raise MissingTensorError(
            f"checkpoint lacks a tensor the model needs (expert {experts} of {shape[0]} for parameter {param!r})",
            file=sources.ckpt.folder, tensor=expert_name(names[0::per_expert], experts),
        )
    if len(shape) < 2 or experts != shape[0] or shape[1] % per_expert:
        raise ShapeError(f"{experts} experts of {per_expert} part(s) cannot make {param} {list(shape)}",
                         file=sources.ckpt.tensors[names[0]].file, tensor=names[0])
    part = (shape[1] // per_expert, *shape[2:])
    share = None
    if partition is not None:
        share = partition.block(experts, param)
        names = [n for e in share.experts() for n in names[e * per_expert: (e + 1) * per_expert]]
        shape = (share.count, *shape[1:])
    srcs = [sources(n, part, f"one expert's part of {param} {list(shape)}:") for n in names]
    return PlannedTensor(param, shape, _one_dtype(srcs, f"experts of {param}"), srcs, experts=share)


def _one_dtype(srcs: list[Source], what: str) -> torch.dtype:
    dtypes = {served_dtype(s) for s in srcs}
    if len(dtypes) != 1:
        raise ShapeError(f"{what} mix dtypes {sorted(map(str, dtypes))}", file=srcs[0].info.file, tensor=srcs[0].name)
    return dtypes.pop()


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
