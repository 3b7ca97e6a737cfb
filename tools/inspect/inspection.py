"""One pass over a source's tensors: a row of statistics per tensor, value samples and summed format errors."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import number_formats as fmts
from expertd.errors import CheckpointError, ExpertdError

from .groups import ErrorTable, group_keys, group_rank, totals
from .sources import InspectSource, Item
from .stats import error_dict, footprint, tensor_stats

log = logging.getLogger("expertd.inspect")


@dataclass
class Inspection:
    """Everything `inspect` computes, plus value samples for the plots (not written to stats.json)."""

    source: InspectSource
    formats: list[str]
    sample: int
    tensors: list[dict] = field(default_factory=list)
    samples: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    layer_samples: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    errors: ErrorTable = field(init=False)

    def __post_init__(self) -> None:
        self.errors = ErrorTable(self.formats)

    def run(self) -> "Inspection":
        items = self.source.items
        group_numel: dict[str, int] = defaultdict(int)
        for it in items:
            if _plotted(it):
                group_numel[it.group] += math.prod(it.shape)
        gen = torch.Generator().manual_seed(0)
        for k, it in enumerate(items):
            try:
                values = it.load()
            except ExpertdError:
                raise
            except Exception as exc:
                raise CheckpointError(f"reading failed: {exc}", tensor=it.name) from exc
            row = {"name": it.name, "component": it.component, "group": it.group, "role": it.role,
                   "dtype": str(it.dtype).removeprefix("torch."),
                   "values_dtype": str(values.dtype).removeprefix("torch."),
                   "shape": list(it.shape), "bytes": it.nbytes, "layer": it.layer, "expert": it.expert,
                   "footprint": footprint(it.shape, it.fp8_eligible), **tensor_stats(values)}
            if it.note:
                row["note"] = it.note
            if it.format:
                row["format"] = it.format
            if _plotted(it) and values.numel():
                flat = values.detach().reshape(-1).float()
                want = max(1, math.ceil(self.sample * flat.numel() / group_numel[it.group]))
                picked = flat if flat.numel() <= want else flat[torch.randint(flat.numel(), (want,), generator=gen)]
                picked = picked[torch.isfinite(picked)]
                self.samples[it.group].append(picked)
                if it.layer is not None:
                    self.layer_samples[it.layer].append(picked[: max(1, want // 4)])
                row["formats"] = self._compare(it, values)
            self.tensors.append(row)
            del values
            if (k + 1) % 500 == 0:
                log.info("inspected %d/%d tensors", k + 1, len(items))
        return self

    def _compare(self, it: Item, values: torch.Tensor) -> dict:
        out = {}
        keys = group_keys(it.component, it.group, it.layer, it.expert)
        for fmt, e in fmts.measure(values, self.formats).items():
            out[fmt] = error_dict(e)
            self.errors.add(fmt, keys, e)
        return out

    def to_dict(self) -> dict:
        return {"source": {"kind": self.source.kind, "where": self.source.where}, "formats": self.errors.summary(),
                "totals": totals(self.tensors), "tensors": self.tensors}

    def value_samples(self) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
        """The sampled values as plain arrays for the plots: per group (components first, in order) and per layer."""
        groups = [(g, torch.cat(parts)) for g, parts in self.samples.items() if parts]
        groups = sorted([(g, v) for g, v in groups if v.numel()], key=lambda gv: group_rank(gv[0]))
        layers = {k: torch.cat(self.layer_samples[k]).numpy() for k in sorted(self.layer_samples)}
        return {g: v.numpy() for g, v in groups}, layers


def _plotted(it: Item) -> bool:
    """Values worth drawing and quantizing: floating weights, activations and gradients (not scales or masks)."""
    return it.role not in ("scale", "mask") and it.dtype.is_floating_point and math.prod(it.shape) > 0
