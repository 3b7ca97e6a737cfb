"""What `inspect` reads: a checkpoint folder, a daemon endpoint or a capture folder, as a list of tensors to load."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from expertd.protocol import is_endpoint
from expertd.dtypes import FP8
from expertd.errors import CheckpointError
from ..hif8 import hif8_decode
from expertd.quantization import ScaledFp8, UnsupportedQuantization, quantization_format

from expertd.server.load.layout import Source, is_fp8_weight, make_source
from expertd.server.load.checkpoint import Checkpoint
from .groups import component_of, expert_of, layer_of


MASK_KEYS = ("attention_mask", "causal_mask", "position_ids", "cache_position")


@dataclass
class Item:
    """One tensor to inspect; `load` returns the values the model computes with."""

    name: str
    dtype: torch.dtype  # as stored (checkpoint, capture) or as served (daemon)
    shape: tuple[int, ...]
    nbytes: int
    component: str
    group: str  # what histograms and box plots pool: the component, or a capture's direction
    role: str  # "weight" | "scale" | "activation" | "gradient" | "mask"
    load: Callable[[], torch.Tensor]
    layer: int | None = None
    expert: int | None = None
    fp8_eligible: bool = False  # would be FP8 with 128x128 block scales in DeepSeek-V3's recipe
    note: str | None = None
    format: str | None = None  # how it is stored ("fp8 e4m3, per-channel scale", "bfloat16", ...)


@dataclass
class InspectSource:
    """What `inspect` reads, listed: where it is and its tensors."""

    kind: str  # "checkpoint" | "daemon" | "capture"
    where: str
    items: list[Item]
    config: dict | None = None


def _checkpoint_items(ckpt: Checkpoint) -> list[Item]:
    """Each stored tensor: a quantized weight loads as the daemon serves it (dequantized by its format, which
    `format` names), its aux tensors as stored; a format expertd does not serve loads as stored, noted."""
    from expertd.server.load.filling import dequantized

    try:
        codec = quantization_format(ckpt.config, os.path.join(ckpt.folder, "config.json"))
    except UnsupportedQuantization as exc:
        codec, unserved = ScaledFp8(None), f"{exc}: values read as stored"
    else:
        unserved = None
    logical = codec.logical(ckpt.tensors)
    owners = {aux: name for name, (_, aux) in logical.items() if aux is not None}
    sources, notes = {}, {}
    for name, (stored, aux) in logical.items():
        try:
            sources[stored] = make_source(ckpt, codec, name, stored, aux)
        except CheckpointError as exc:  # shown, not raised: inspect is how one finds out what is wrong
            sources[stored], notes[stored] = Source(name, ckpt.tensors[stored]), f"{type(exc).__name__}: {exc}"

    def loader(name: str) -> Callable[[], torch.Tensor]:
        src = sources.get(name)
        return (lambda: dequantized(ckpt, src)) if src is not None and unserved is None else (lambda: ckpt.read(name))

    items = []
    for name, info in ckpt.tensors.items():
        owner = owners.get(name, name)
        src = sources.get(name)
        fp8 = info.dtype in FP8
        note = unserved or notes.get(name)
        if note is None and fp8 and (src is None or src.scale is None):
            note = f"FP8 without its {codec.aux_name(name)!r}: values read unscaled"
        fmt = f"scale of {sources[logical[owner][0]].scheme or 'its weight'}" if name in owners else (
            src.scheme if src is not None and src.scheme else str(info.dtype).removeprefix("torch."))
        component = component_of(owner)
        items.append(Item(name, info.dtype, info.shape, info.nbytes, component, component,
                          "scale" if name in owners else "weight", loader(name), layer_of(owner), expert_of(owner),
                          fp8 or is_fp8_weight(name, info.shape), note, fmt))
    return items


def _capture_items(folder: str) -> list[Item]:
    from safetensors import safe_open

    from ..capture_manifest import MANIFEST, read_manifest

    folders = [folder] if os.path.exists(os.path.join(folder, MANIFEST)) else sorted(
        os.path.join(folder, d) for d in os.listdir(folder) if os.path.exists(os.path.join(folder, d, MANIFEST)))
    if not folders:  # files without a manifest (a run that crashed): their metadata tells the rest
        folders = [folder]
    items = []
    for sub in folders:
        prefix = "" if sub == folder else os.path.basename(sub) + "/"
        for entry in read_manifest(sub)["files"]:
            path = os.path.join(sub, entry["file"])
            if not os.path.exists(path):
                raise CheckpointError("capture manifest names a file that does not exist", file=path)
            for key, meta in entry["tensors"].items():
                dtype = getattr(torch, meta["dtype"])
                shape = tuple(meta["shape"])
                component = component_of(entry["module"])
                codes = entry.get("encoding") == "hif8" and dtype == torch.uint8  # HiFloat8 codes: decoded
                dtype = torch.float32 if codes else dtype

                def load(path=path, key=key, codes=codes) -> torch.Tensor:
                    with safe_open(path, framework="pt") as f:
                        t = f.get_tensor(key)
                    return hif8_decode(t) if codes else t

                role = "activation" if entry["direction"] == "forward" else "gradient"
                if key.rsplit(".", 1)[-1] in MASK_KEYS:  # additive masks hold float min: not values to draw
                    role = "mask"
                items.append(Item(f"{prefix}{entry['file'].removesuffix('.safetensors')}:{key}", dtype, shape,
                                  math.prod(shape) * dtype.itemsize, component,
                                  f"{entry['direction']} {entry['tensor']}",
                                  role, load, entry.get("layer"), None, True))
    return items


def attention_maps(items: list[Item], limit: int = 24) -> dict[str, np.ndarray]:
    """Per-head attention probabilities [heads, query, key] (first batch row) of a capture's attention
    modules, by file label; the first `limit` in file order."""
    maps = {}
    for it in items:
        if it.group == "forward attention_probs" and len(it.shape) == 4 and len(maps) < limit:
            maps[it.name.removesuffix(":probs")] = it.load()[0].float().numpy()
    return maps


def is_capture(src: str) -> bool:
    """A capture folder: a manifest (here or one level down) or capture files, and no config.json."""
    from ..capture_manifest import MANIFEST

    if not os.path.isdir(src) or os.path.exists(os.path.join(src, "config.json")):
        return False
    names = os.listdir(src)
    return MANIFEST in names or any(os.path.exists(os.path.join(src, d, MANIFEST)) for d in names) or any(
        n.endswith(".safetensors") and n[:6].isdigit() for n in names)


@contextmanager
def open_source(src: str, timeout: float = 30.0, token: str | None = None):
    """The tensors of a checkpoint folder, a daemon endpoint or a capture folder."""
    if is_endpoint(src):
        from expertd.client import ExpertClient

        client = ExpertClient(src, timeout=timeout, heartbeat=False, **({"token": token} if token else {}))
        try:
            index = client.index()
            views = client.tensors()
            items = []
            for name, view in views.items():
                component = component_of(name)
                items.append(Item(name, view.dtype, tuple(view.shape), view.numel() * view.element_size(), component,
                                  component, "weight", lambda v=view: v, layer_of(name), expert_of(name),
                                  is_fp8_weight(name, tuple(view.shape))))
            yield InspectSource("daemon", f"{src} (generation {index.generation})", items, index.config)
        finally:
            client.close()
    elif is_capture(src):
        yield InspectSource("capture", os.path.abspath(src), _capture_items(src))
    else:
        ckpt = Checkpoint.open(src)
        try:
            yield InspectSource("checkpoint", ckpt.folder, _checkpoint_items(ckpt), ckpt.config)
        finally:
            ckpt.close()
