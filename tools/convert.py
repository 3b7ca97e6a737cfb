"""`expertd convert`: a quantized checkpoint (DeepSeek FP8, compressed-tensors FP8, MXFP4) to plain bf16.

Unlike DeepSeek's fp8_cast_bf16.py, which prints a warning and copies FP8 bytes through when a
`*_scale_inv` is missing, the whole source is validated before DST is touched, by the same codec the
daemon plans with (`quantization`): every FP8 weight needs a scale of the shape its format declares
with finite positive values, every scale needs its FP8 weight, MXFP4 blocks need their scales.
Weights are dequantized as the daemon does (`dequant.write_part`: bit for bit each format's
definition), other tensors are copied byte for byte.

Each output shard is streamed: its safetensors header is computed from the plan, then tensors are
dequantized and written one at a time, so memory stays at one tensor whatever the model size. A
shard is written under a temporary name and renamed when complete; the index is written last.
A state file records the source fingerprint and the options, so an interrupted run resumes from
its completed shards and a rerun over a finished DST does nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from expertd.dtypes import FP8, SAFETENSORS_TAGS
from expertd.errors import CheckpointError
from expertd.index import write_json_atomic
from expertd.quantization import Codec, quantization_format
from expertd.units import parse_size

from expertd.server.load.layout import Source, check_scale_values, make_source
from expertd.server.load.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint

log = logging.getLogger("expertd.convert")

STATE_FILE = ".expertd-convert.json"
STATE_VERSION = 1
PARTIAL_SUFFIX = ".partial"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # HuggingFace's "5GB"


@dataclass
class OutTensor:
    """One tensor of the output: a source, dequantized by its format when it is quantized."""

    source: Source
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class OutShard:
    file: str
    tensors: list[OutTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def header(self) -> bytes:
        """The safetensors header (length prefix included): tensors back to back in list order."""
        entries: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in self.tensors:
            entries[t.name] = {"dtype": SAFETENSORS_TAGS[t.dtype], "shape": list(t.shape),
                               "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    @property
    def file_size(self) -> int:
        return len(self.header()) + self.nbytes


@dataclass
class ConversionPlan:
    source: Checkpoint
    codec: Codec
    shards: list[OutShard]
    kept_fp8: list[str]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        return {t.name: s.file for s in self.shards for t in s.tensors}


@dataclass
class ConvertResult:
    written: list[str]
    skipped: list[str]
    noop: bool
    nbytes: int


def plan_conversion(ckpt: Checkpoint, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                    keep_fp8_where_unscaled: bool = False) -> ConversionPlan:
    """Validate every tensor and scale of the source and assign output tensors to shards; reads only scales."""
    codec = quantization_format(ckpt.config, os.path.join(ckpt.folder, "config.json"))
    outputs: list[OutTensor] = []
    kept: list[str] = []
    codec.check_aux(ckpt.tensors)
    for name, (stored, aux) in codec.logical(ckpt.tensors).items():
        info = ckpt.tensors[stored]
        if info.dtype in FP8 and aux is None and keep_fp8_where_unscaled:
            log.warning("%s has no scale: kept as %s (--keep-fp8-where-unscaled)", name, info.dtype)
            kept.append(name)
            outputs.append(OutTensor(Source(name, info), info.dtype))
            continue
        src = make_source(ckpt, codec, name, stored, aux)  # e5m2 weight; missing or misshapen aux: a typed error
        if src.scale is not None:
            check_scale_values(ckpt, src.scale)
        outputs.append(OutTensor(src, torch.bfloat16 if src.scale is not None else info.dtype))

    shards: list[OutShard] = []
    filled = 0
    for t in outputs:  # greedy, in source order; a tensor larger than the limit gets a shard of its own
        if not shards or shards[-1].tensors and filled + t.nbytes > max_shard_size:
            shards.append(OutShard(""))
            filled = 0
        shards[-1].tensors.append(t)
        filled += t.nbytes
    for k, shard in enumerate(shards):
        shard.file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    return ConversionPlan(ckpt, codec, shards, kept)


# config.json names the weights' dtype `torch_dtype` (transformers 4.x) or `dtype` (5.x).
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")


def output_config(config: dict) -> dict:
    """config.json of the bf16 checkpoint: no quantization_config, dtype bfloat16 under every key a transformers
    version reads."""
    return {**{k: v for k, v in config.items() if k != "quantization_config"},
            **dict.fromkeys(CONFIG_DTYPE_KEYS, "bfloat16")}


def _fingerprint(ckpt: Checkpoint) -> str:
    """A digest of the source's config and every shard's header and size: what the output depends on."""
    digest = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    for path in sorted({info.file for info in ckpt.tensors.values()}):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            digest.update(os.path.basename(path).encode() + f.read(n))
        digest.update(str(os.path.getsize(path)).encode())
    return digest.hexdigest()


def _state(plan: ConversionPlan, keep_fp8_where_unscaled: bool) -> dict:
    return {
        "version": STATE_VERSION,
        "source": plan.source.folder,
        "fingerprint": _fingerprint(plan.source),
        "keep_fp8_where_unscaled": keep_fp8_where_unscaled,
        "shards": [{"file": s.file, "size": s.file_size, "header_sha256": hashlib.sha256(s.header()).hexdigest()}
                   for s in plan.shards],
    }


def _same_state(old: dict, new: dict) -> bool:
    """A state from another source folder still matches when the content and options do."""
    return {k: v for k, v in old.items() if k != "source"} == {k: v for k, v in new.items() if k != "source"}


def _shard_complete(path: str, shard: OutShard) -> bool:
    """A shard left by an earlier run: complete when its size and header are the planned ones."""
    try:
        if os.path.getsize(path) != shard.file_size:
            return False
        header = shard.header()
        with open(path, "rb") as f:
            return f.read(len(header)) == header
    except FileNotFoundError:
        return False


def _check_destination(src: str, dst: str, state: dict) -> dict | None:
    """The state of an earlier conversion into DST, if it matches this one; refuses any other DST content."""
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError("destination exists and is not a folder", file=dst)
    if os.path.isdir(dst) and os.path.samefile(src, dst):
        raise CheckpointError("destination is the source folder", file=dst)
    if not os.path.isdir(dst) or not os.listdir(dst):
        return None
    state_path = os.path.join(dst, STATE_FILE)
    try:
        with open(state_path) as f:
            old = json.load(f)
    except FileNotFoundError:
        raise CheckpointError("destination is not empty and holds no expertd conversion; refusing to overwrite it",
                              file=dst) from None
    except ValueError as exc:
        raise CheckpointError(f"conversion state is not valid JSON: {exc}", file=state_path) from exc
    if not _same_state(old, state):
        raise CheckpointError(
            "destination holds a conversion of another checkpoint or with other options; remove it first", file=dst
        )
    return old


def _copy_atomic(src: str, dst: str) -> None:
    tmp = dst + PARTIAL_SUFFIX
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _copy_side_files(ckpt: Checkpoint, dst: str) -> None:
    """Tokenizer, generation config, modeling code...: every top-level file that is not weights or index."""
    shards = {os.path.basename(info.file) for info in ckpt.tensors.values()}
    for entry in sorted(os.scandir(ckpt.folder), key=lambda e: e.name):
        name = entry.name
        if name.startswith(".") or name in shards or name in (INDEX_FILE, "config.json"):
            continue
        if not entry.is_file():
            log.warning("not copying %s: only top-level files are copied", entry.path)
        elif name.endswith(".safetensors") or name == SINGLE_FILE:
            log.warning("not copying %s: a safetensors file the index does not name", entry.path)
        else:
            _copy_atomic(entry.path, os.path.join(dst, name))


def _write_tensor(f, tensor: torch.Tensor) -> None:
    if tensor.numel():
        f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_shard(plan: ConversionPlan, shard: OutShard, path: str, device: torch.device, bar) -> None:
    """Stream one shard to `path` + '.partial', then rename: a file under the final name is always complete."""
    from expertd.server.load.filling import dequantized

    tmp = path + PARTIAL_SUFFIX
    ckpt = plan.source
    with open(tmp, "wb") as f:
        f.write(shard.header())
        for t in shard.tensors:
            src = t.source
            data = dequantized(ckpt, src, device)
            if data.dtype != t.dtype or tuple(data.shape) != t.shape:  # the plan and the reader disagree: a bug
                raise CheckpointError(f"read {data.dtype}{list(data.shape)}, planned {t.dtype}{list(t.shape)}",
                                      file=src.info.file, tensor=t.name)
            _write_tensor(f, data)
            del data
            bar.update(t.nbytes)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def convert(src: str, dst: str, *, device: str = "auto", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
            keep_fp8_where_unscaled: bool = False, progress: bool = False) -> ConvertResult:
    """Convert checkpoint folder `src` into a bf16 HuggingFace checkpoint in `dst`; resumable, idempotent."""
    from expertd.server.load.loader import resolve_device

    dev = resolve_device(device)
    ckpt = Checkpoint.open(src)
    try:
        plan = plan_conversion(ckpt, parse_size(max_shard_size), keep_fp8_where_unscaled)
        state = _state(plan, keep_fp8_where_unscaled)
        dst = os.path.abspath(dst)
        previous = _check_destination(ckpt.folder, dst, state)
        paths = [os.path.join(dst, s.file) for s in plan.shards]
        done = [previous is not None and _shard_complete(p, s) for p, s in zip(paths, plan.shards)]
        if all(done) and os.path.exists(os.path.join(dst, INDEX_FILE)):
            log.info("%s is already a complete conversion of %s: nothing to do", dst, ckpt.folder)
            return ConvertResult([], [s.file for s in plan.shards], True, plan.nbytes)

        os.makedirs(dst, exist_ok=True)
        index_path = os.path.join(dst, INDEX_FILE)
        if os.path.exists(index_path):  # a shard is to be rewritten: no index may name it meanwhile
            os.unlink(index_path)
        write_json_atomic(os.path.join(dst, STATE_FILE), state, indent=2, sort_keys=False)
        write_json_atomic(os.path.join(dst, "config.json"), output_config(ckpt.config), indent=2, sort_keys=False)
        _copy_side_files(ckpt, dst)
        written, skipped = [], []
        with tqdm(total=plan.nbytes, initial=sum(s.nbytes for s, d in zip(plan.shards, done) if d), unit="B",
                  unit_scale=True, unit_divisor=1024, desc="expertd convert", disable=not progress) as bar:
            for shard, path, complete in zip(plan.shards, paths, done):
                if complete:
                    skipped.append(shard.file)
                    continue
                _write_shard(plan, shard, path, dev, bar)
                written.append(shard.file)
        write_json_atomic(index_path, {"metadata": {"total_size": plan.nbytes},
                                       "weight_map": dict(sorted(plan.weight_map().items()))},
                          indent=2, sort_keys=False)
        if skipped:
            log.info("resumed: %d shard(s) kept from an earlier run, %d written", len(skipped), len(written))
        return ConvertResult(written, skipped, False, plan.nbytes)
    finally:
        ckpt.close()
