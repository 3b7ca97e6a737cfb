"""Which part of the model a tensor belongs to, and the sums `inspect` keeps per component, group, layer and expert."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import NamedTuple

from ..number_formats import FormatError

from .stats import FOOTPRINT_DTYPES, error_dict

COMPONENTS = ("embeddings", "attention", "dense MLP", "shared experts", "routed experts", "router", "norms", "other")
_LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")
_EXPERT_RE = re.compile(r"\.experts\.(\d+)(?:\.|$)")


def component_of(name: str) -> str:
    """The part of a transformer a parameter or module name belongs to."""
    if "embed" in name or name == "lm_head" or name.startswith("lm_head.") or ".lm_head" in name:
        return "embeddings"
    if "shared_expert" in name:
        return "shared experts"
    if ".experts." in name or name.endswith(".experts") or ".experts_" in name:
        return "routed experts"
    if ".mlp.gate." in name or name.endswith(".mlp.gate") or ".router" in name:
        return "router"
    if "attn" in name or "attention" in name:
        return "attention"
    if ".mlp." in name or name.endswith(".mlp"):
        return "dense MLP"
    if "norm" in name:
        return "norms"
    return "other"


def group_rank(label: str) -> tuple[int, str]:
    """The one order of groups in every table and picture: components as COMPONENTS lists them, then by name."""
    return (COMPONENTS.index(label) if label in COMPONENTS else len(COMPONENTS), label)


def layer_of(name: str) -> int | None:
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def expert_of(name: str) -> int | None:
    match = _EXPERT_RE.search(name)
    return int(match.group(1)) if match else None


class GroupKey(NamedTuple):
    """One row of a format-error table in stats.json: the table's name and the row's label."""

    table: str  # "overall" | "by_component" | "by_group" | "by_layer" | "by_expert"
    label: str
    layer: int | None = None
    expert: int | None = None


def group_keys(component: str, group: str, layer: int | None, expert: int | None) -> list[GroupKey]:
    """Every row a tensor's format error is summed into."""
    keys = [GroupKey("overall", "all"), GroupKey("by_component", component), GroupKey("by_group", group)]
    if layer is not None:
        keys.append(GroupKey("by_layer", str(layer), layer))
        if expert is not None:
            keys.append(GroupKey("by_expert", f"{layer}/{expert}", layer, expert))
    return keys


class ErrorTable:
    """Format errors summed per (format, GroupKey); additive, so spreads over layers and experts can be drawn."""

    def __init__(self, formats: list[str]):
        self.formats = formats
        self.sums: dict[tuple[str, GroupKey], FormatError] = defaultdict(FormatError)

    def add(self, fmt: str, keys: list[GroupKey], e: FormatError) -> None:
        for key in keys:
            self.sums[(fmt, key)].add(e)

    def summary(self) -> dict:
        """stats.json's "formats": overall, by component, group and layer, and a list of (layer, expert) cells."""
        out: dict = {"overall": {}, "by_component": {}, "by_group": {}, "by_layer": {}, "by_expert": {}}
        rank = {f: i for i, f in enumerate(self.formats)}
        for (fmt, key), e in sorted(self.sums.items(), key=lambda kv: (rank[kv[0][0]], kv[0][1].table, kv[0][1].label)):
            if key.table == "overall":
                out["overall"][fmt] = error_dict(e)
            elif key.table == "by_expert":
                out["by_expert"].setdefault(fmt, []).append({"layer": key.layer, "expert": key.expert, **error_dict(e)})
            else:
                out[key.table].setdefault(fmt, {})[key.label] = error_dict(e)
        for table in ("by_component", "by_group"):
            for fmt in out[table]:
                out[table][fmt] = dict(sorted(out[table][fmt].items(), key=lambda kv: group_rank(kv[0])))
        for fmt in out["by_layer"]:
            out["by_layer"][fmt] = dict(sorted(out["by_layer"][fmt].items(), key=lambda kv: int(kv[0])))
        return out


def totals(tensors: list[dict]) -> dict:
    """Tensors, elements and bytes by dtype and by component, and the memory footprint in each dtype."""
    by_dtype: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "numel": 0, "bytes": 0})
    by_component: dict[str, dict] = defaultdict(
        lambda: {"tensors": 0, "numel": 0, "bytes": 0, "footprint": dict.fromkeys([*FOOTPRINT_DTYPES, "fp8"], 0)})
    footprint_total = dict.fromkeys([*FOOTPRINT_DTYPES, "fp8"], 0)
    for t in tensors:
        d = by_dtype[t["dtype"]]
        d["tensors"] += 1
        d["numel"] += t["numel"]
        d["bytes"] += t["bytes"]
        c = by_component[t["component"]]
        c["tensors"] += 1
        c["numel"] += t["numel"]
        c["bytes"] += t["bytes"]
        if t["role"] != "scale":  # scales are part of the fp8 footprint already
            for k, v in t["footprint"].items():
                c["footprint"][k] += v
                footprint_total[k] += v
    return {
        "tensors": len(tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "by_dtype": dict(sorted(by_dtype.items())),
        "by_component": dict(sorted(by_component.items(), key=lambda kv: group_rank(kv[0]))),
        "footprint": footprint_total,
    }
