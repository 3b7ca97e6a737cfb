"""`expertd inspect`: what a checkpoint, a running daemon or an activation capture holds, as numbers.

Every tensor is read once, one at a time (FP8 weights dequantized with their scales, so the values
are the ones the model computes with): its dtype, shape and bytes, min/max/mean/std, the fraction of
zeros and of non-finite values, and the error every low-precision format of `formats.py` would make
on it. Totals go by dtype and by component (attention, dense MLP, shared and routed experts, router,
embeddings, norms), with the memory the model would take in bf16, fp16, fp32 and fp8. Format errors
are summed over components, layers and (layer, expert) pairs, so their spread can be drawn.

The results land in OUT/stats.json and OUT/stats.md; `plots.py` draws the pictures and index.html.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from expertd.errors import CheckpointError, ExpertdError

from . import formats as fmts
from .generate import is_fp8_weight
from .layout import SCALE_SUFFIX
from .reader import Checkpoint

log = logging.getLogger("expertd.inspect")

COMPONENTS = ("embeddings", "attention", "dense MLP", "shared experts", "routed experts", "router", "norms", "other")
FOOTPRINT_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
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


def layer_of(name: str) -> int | None:
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def expert_of(name: str) -> int | None:
    match = _EXPERT_RE.search(name)
    return int(match.group(1)) if match else None


@dataclass
class Item:
    """One tensor to inspect; `load` returns the values the model computes with."""

    name: str
    dtype: torch.dtype  # as stored (checkpoint, capture) or as served (daemon)
    shape: tuple[int, ...]
    nbytes: int
    component: str
    group: str  # what histograms and box plots pool: the component, or a capture's direction
    role: str  # "weight" | "scale" | "activation" | "gradient"
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
        fp8 = info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
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

                def load(path=path, key=key) -> torch.Tensor:
                    with safe_open(path, framework="pt") as f:
                        return f.get_tensor(key)

                role = "activation" if entry["direction"] == "forward" else "gradient"
                items.append(Item(f"{prefix}{entry['file'].removesuffix('.safetensors')}:{key}", dtype, shape,
                                  math.prod(shape) * dtype.itemsize, component, f"{entry['direction']} {entry['tensor']}",
                                  role, load, entry.get("layer"), None, True))
    return items


def is_endpoint(src: str) -> bool:
    return src.startswith(("ipc://", "tcp://"))


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


def tensor_stats(x: torch.Tensor) -> dict:
    """min/max/mean/std/rms over the finite values, their sum of squares; fractions of zeros and non-finite values."""
    n = x.numel()
    if n == 0:
        return {"numel": 0, "zeros": 0.0, "nonfinite": 0.0}
    v = x.detach().reshape(-1)
    v = v.double() if not v.is_floating_point() or v.dtype == torch.float64 else v.float()
    zeros = n - int(torch.count_nonzero(v))
    bad = 0
    if not math.isfinite(float(v.abs().amax())):  # the slow mask only when there is something to drop
        finite = torch.isfinite(v)
        bad = n - int(finite.sum())
        v = v[finite]
    out = {"numel": n, "zeros": zeros / n, "nonfinite": bad / n}
    if v.numel():
        lo, hi = torch.aminmax(v)
        mean = float(v.sum(dtype=torch.float64)) / v.numel()
        sq = fmts.sum_squares(v)
        var = max(sq / v.numel() - mean * mean, 0.0)
        out.update(min=float(lo), max=float(hi), mean=json_number(mean), std=json_number(math.sqrt(var)),
                   absmax=max(-float(lo), float(hi)), rms=json_number(math.sqrt(sq / v.numel())), sumsq=json_number(sq))
    return out


def footprint(item: Item) -> dict[str, int]:
    """Bytes the tensor takes in each dtype; fp8 means e4m3 + float32 128x128 block scales where eligible."""
    n = math.prod(item.shape)
    out = {k: n * size for k, size in FOOTPRINT_DTYPES.items()}
    if item.fp8_eligible and item.shape:
        rows = math.prod(item.shape[:-1]) if len(item.shape) > 1 else 1
        blocks = -(-rows // fmts.BLOCK) * -(-item.shape[-1] // fmts.BLOCK)
        out["fp8"] = n + 4 * blocks
    else:
        out["fp8"] = 2 * n
    return out


def json_number(x: float) -> float | str:
    """Strict JSON has no inf or nan: those are written as strings."""
    return x if math.isfinite(x) else str(x)


def _error_dict(e: fmts.FormatError) -> dict:
    return {"rel_error": json_number(e.rel_error), "snr_db": json_number(e.snr_db)}


@dataclass
class Inspection:
    """Everything `inspect` computes, plus value samples for the plots (not written to stats.json)."""

    source: Source
    formats: list[str]
    sample: int
    tensors: list[dict] = field(default_factory=list)
    samples: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    layer_samples: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[tuple, fmts.FormatError] = field(default_factory=lambda: defaultdict(fmts.FormatError))

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
                   "dtype": str(it.dtype).removeprefix("torch."), "values_dtype": str(values.dtype).removeprefix("torch."),
                   "shape": list(it.shape), "bytes": it.nbytes, "layer": it.layer, "expert": it.expert,
                   "footprint": footprint(it), **tensor_stats(values)}
            if it.note:
                row["note"] = it.note
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
        for fmt, e in fmts.measure(values, self.formats).items():
            out[fmt] = _error_dict(e)
            for key in (("all",), ("component", it.component), ("group", it.group), ("layer", it.layer),
                        ("expert", it.layer, it.expert)):
                if None not in key:
                    self.errors[(fmt, *key)].add(e)
        return out

    # --- summaries -------------------------------------------------------------------------

    def totals(self) -> dict:
        by_dtype: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "numel": 0, "bytes": 0})
        by_component: dict[str, dict] = defaultdict(
            lambda: {"tensors": 0, "numel": 0, "bytes": 0, "footprint": dict.fromkeys([*FOOTPRINT_DTYPES, "fp8"], 0)})
        footprint_total = dict.fromkeys([*FOOTPRINT_DTYPES, "fp8"], 0)
        for t in self.tensors:
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
        order = {c: i for i, c in enumerate(COMPONENTS)}
        return {
            "tensors": len(self.tensors),
            "bytes": sum(t["bytes"] for t in self.tensors),
            "by_dtype": dict(sorted(by_dtype.items())),
            "by_component": dict(sorted(by_component.items(), key=lambda kv: order.get(kv[0], 99))),
            "footprint": footprint_total,
        }

    def format_summary(self) -> dict:
        out: dict = {"overall": {}, "by_component": {}, "by_group": {}, "by_layer": {}, "by_expert": {}}
        rank = {f: i for i, f in enumerate(self.formats)}
        for (fmt, *key), e in sorted(self.errors.items(), key=lambda kv: (rank[kv[0][0]], str(kv[0][1:]))):
            if key[0] == "all":
                out["overall"][fmt] = _error_dict(e)
            elif key[0] == "component":
                out["by_component"].setdefault(fmt, {})[key[1]] = _error_dict(e)
            elif key[0] == "group":
                out["by_group"].setdefault(fmt, {})[key[1]] = _error_dict(e)
            elif key[0] == "layer":
                out["by_layer"].setdefault(fmt, {})[str(key[1])] = _error_dict(e)
            else:
                out["by_expert"].setdefault(fmt, []).append({"layer": key[1], "expert": key[2], **_error_dict(e)})
        for fmt in out["by_layer"]:
            out["by_layer"][fmt] = dict(sorted(out["by_layer"][fmt].items(), key=lambda kv: int(kv[0])))
        return out

    def to_dict(self) -> dict:
        return {"source": {"kind": self.source.kind, "where": self.source.where}, "formats": self.format_summary(),
                "totals": self.totals(), "tensors": self.tensors}


def _plotted(it: Item) -> bool:
    """Values worth drawing and quantizing: floating weights, activations and gradients (not scales)."""
    return it.role != "scale" and it.dtype.is_floating_point and math.prod(it.shape) > 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fmt_num(x) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def markdown(report: dict) -> str:
    """The readable stats file: totals, footprint, format errors, then one row per tensor."""
    totals, formats = report["totals"], report["formats"]
    lines = [f"# expertd inspect: {report['source']['kind']} {report['source']['where']}", "",
             f"{totals['tensors']} tensors, {_fmt_bytes(totals['bytes'])} as stored.", "", "## By dtype", "",
             "| dtype | tensors | elements | bytes |", "|---|---:|---:|---:|"]
    lines += [f"| {d} | {v['tensors']} | {v['numel']:,} | {_fmt_bytes(v['bytes'])} |" for d, v in totals["by_dtype"].items()]
    keys = [*FOOTPRINT_DTYPES, "fp8"]
    lines += ["", "## By component (memory footprint per dtype)", "",
              "| component | tensors | elements | as stored | " + " | ".join(keys) + " |", "|---|" + "---:|" * (3 + len(keys))]
    for c, v in totals["by_component"].items():
        lines.append(f"| {c} | {v['tensors']} | {v['numel']:,} | {_fmt_bytes(v['bytes'])} | "
                     + " | ".join(_fmt_bytes(v["footprint"][k]) for k in keys) + " |")
    lines.append("| **total** | | | | " + " | ".join(f"**{_fmt_bytes(totals['footprint'][k])}**" for k in keys) + " |")
    lines += ["", "fp8: e4m3 with float32 128x128 block scales for the tensors DeepSeek-V3 stores so, bf16 for the rest.", ""]
    if formats["overall"]:
        comps = sorted({c for v in formats["by_component"].values() for c in v}, key=lambda c: (COMPONENTS + (c,)).index(c))
        lines += ["## Quantization formats: relative error ||x - q(x)|| / ||x|| (SNR dB)", "",
                  "| format | overall | " + " | ".join(comps) + " |", "|---|---:|" + "---:|" * len(comps)]
        for fmt, e in formats["overall"].items():
            cells = [formats["by_component"].get(fmt, {}).get(c) for c in comps]
            lines.append(f"| {fmt} | {_fmt_num(e['rel_error'])} ({_fmt_num(e['snr_db'])}) | "
                         + " | ".join(f"{_fmt_num(x['rel_error'])} ({_fmt_num(x['snr_db'])})" if x else "" for x in cells) + " |")
        lines.append("")
    lines += ["## Tensors", "", "| name | dtype | shape | bytes | min | max | mean | std | zeros | non-finite |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in report["tensors"]:
        lines.append(f"| {t['name']} | {t['dtype']} | {'x'.join(map(str, t['shape'])) or 'scalar'} | {t['bytes']:,} | "
                     + " | ".join(_fmt_num(t.get(k)) for k in ("min", "max", "mean", "std", "zeros", "nonfinite")) + " |")
    return "\n".join(lines) + "\n"


def inspect(src: str, out_dir: str, formats: list[str] | None = None, sample: int = 100_000, plots: bool = True,
            timeout: float = 30.0, token: str | None = None) -> dict:
    """Inspect `src` (checkpoint folder, daemon endpoint or capture folder); write stats, plots and index.html."""
    formats = list(fmts.FORMATS) if formats is None else formats
    unknown = [f for f in formats if f not in fmts.FORMATS]
    if unknown:
        raise ValueError(f"unknown format(s) {unknown}; known: {', '.join(fmts.FORMATS)}")
    with open_source(src, timeout=timeout, token=token) as source:
        inspection = Inspection(source, formats, sample).run()
    report = inspection.to_dict()
    os.makedirs(out_dir, exist_ok=True)
    report["plots"] = []
    if plots:
        from .plots import draw_all, write_html

        report["plots"] = draw_all(inspection, report, out_dir)
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    with open(os.path.join(out_dir, "stats.md"), "w") as f:
        f.write(markdown(report))
    if plots:
        write_html(report, out_dir)
    return report
