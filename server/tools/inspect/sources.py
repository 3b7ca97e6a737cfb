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
from expertd.hif8 import hif8_decode

from ...layout import SCALE_SUFFIX, is_fp8_weight
from ...reader import Checkpoint
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


@dataclass
class Source:
    kind: str  # "checkpoint" | "daemon" | "capture"
    where: str
    items: list[Item]
    config: dict | None = None


def _checkpoint_items(ckpt: Checkpoint) -> list[Item]:
    from expertd.kernels import weight_dequant

    block = (ckpt.config.get("quantization_config") or {}).get("weight_block_size", [128, 128])[0]

    def loader(name: str, scale: str | None) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            x = ckpt.read(name)
            if scale is None:
                return x
            return weight_dequant(x, ckpt.read(scale), block, out_dtype=torch.bfloat16, name=name, device="cpu")

        return load

    items = []
    for name, info in ckpt.tensors.items():
        is_scale = name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in ckpt.tensors
        owner = name[: -len(SCALE_SUFFIX)] if is_scale else name
        fp8 = info.dtype in FP8
        scale = name + SCALE_SUFFIX if fp8 and name + SCALE_SUFFIX in ckpt.tensors else None
        note = "FP8 without *_scale_inv: values read unscaled" if fp8 and scale is None else None
        component = component_of(owner)
        items.append(Item(name, info.dtype, info.shape, info.nbytes, component, component,
                          "scale" if is_scale else "weight", loader(name, scale), layer_of(owner), expert_of(owner),
                          fp8 or is_fp8_weight(name, info.shape), note))
    return items


def _capture_items(folder: str) -> list[Item]:
    from safetensors import safe_open

    from expertd.client.capture import MANIFEST, read_manifest

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
                                  math.prod(shape) * dtype.itemsize, component, f"{entry['direction']} {entry['tensor']}",
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
    from expertd.client.capture import MANIFEST

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
            yield Source("daemon", f"{src} (generation {index.generation})", items, index.config)
        finally:
            client.close()
    elif is_capture(src):
        yield Source("capture", os.path.abspath(src), _capture_items(src))
    else:
        ckpt = Checkpoint.open(src)
        try:
            yield Source("checkpoint", ckpt.folder, _checkpoint_items(ckpt), ckpt.config)
        finally:
            ckpt.close()
