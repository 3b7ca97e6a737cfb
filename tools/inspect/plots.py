"""The pictures of `expertd inspect` (matplotlib, Agg backend, PNG).

Each `plot_*` function draws one figure from plain data (arrays of sampled values by label, or the
report dict's statistics and format errors), saves it under the output folder and returns
(file, caption), or None when the source has nothing to draw (no experts, no layers).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..plotting import log_floor, log_lines
from ..plotting import pyplot as _pyplot
from ..plotting import save as _save

HEATMAP_FORMATS = ("fp8_e4m3_block128", "mxfp8_e4m3", "mxfp4_e2m1", "hif8")


def _grid(plt, n: int, size=(4.0, 3.0)):
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def plot_histograms(groups: dict[str, np.ndarray], out_dir: str):
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = _grid(plt, len(groups))
    for ax, (group, values) in zip(axes, groups.items()):
        counts, edges = np.histogram(values, bins=200)
        ax.stairs(counts, edges, fill=True, color="tab:blue")  # one polygon: far faster than 200 bars
        ax.set_yscale("log")
        ax.set_title(f"{group} ({values.size:,} sampled values)", fontsize=9)
        ax.set_xlabel("value")
        ax.set_ylabel("count (log scale)")
    fig.suptitle("Value histograms")
    return _save(fig, out_dir, "histograms.png"), "Value histograms per group (log count), from a proportional sample."


def plot_boxplots(groups: dict[str, np.ndarray], layers: dict[int, np.ndarray], out_dir: str):
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if layers else 1, figsize=(14 if layers else 8, 4.5), squeeze=False,
                             layout="constrained")
    ax = axes[0][0]
    ax.boxplot(list(groups.values()), showfliers=False)
    ax.set_xticks(range(1, len(groups) + 1), list(groups), rotation=30, ha="right", fontsize=8)
    ax.set_title("per group (whiskers 1.5 IQR, outliers hidden)", fontsize=9)
    if layers:
        ax = axes[0][1]
        ax.boxplot(list(layers.values()), showfliers=False)
        ax.set_xticks(range(1, len(layers) + 1), [str(k) for k in layers], fontsize=8)
        ax.set_xlabel("layer")
        ax.set_title("per layer", fontsize=9)
    fig.suptitle("Box plots of values")
    return _save(fig, out_dir, "boxplots.png"), "Box plots of the sampled values per group and per layer."


def plot_qq(groups: dict[str, np.ndarray], out_dir: str):
    """Sample quantiles of the standardized values against the normal distribution's."""
    drawable = [(g, v) for g, v in groups.items() if v.size >= 8]
    if not drawable:
        return None
    plt = _pyplot()
    fig, axes = _grid(plt, len(drawable), (3.5, 3.5))
    for ax, (group, values) in zip(axes, drawable):
        v = torch.from_numpy(values).double()
        v = (v - v.mean()) / (v.std() if v.std() > 0 else 1.0)
        sample = v.sort().values
        if sample.numel() > 2000:
            sample = sample[torch.linspace(0, sample.numel() - 1, 2000).long()]
        p = (torch.arange(sample.numel(), dtype=torch.float64) + 0.5) / sample.numel()
        theory = torch.special.ndtri(p)
        ax.plot(theory.numpy(), sample.numpy(), ".", markersize=2)
        lim = float(max(theory.abs().max(), 1.0))
        ax.plot([-lim, lim], [-lim, lim], "r-", linewidth=0.8)
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("normal quantile")
        ax.set_ylabel("standardized value")
    fig.suptitle("QQ plots against a normal distribution")
    return _save(fig, out_dir, "qq.png"), "QQ plots: heavy tails bend away from the red line at both ends."


def _expert_matrix(report: dict, value) -> tuple[list[int], int, list[list[float]]] | None:
    """A layer x expert matrix of value(rows of that expert) over the routed experts' tensors."""
    cells: dict[tuple[int, int], list[dict]] = {}
    for t in report["tensors"]:
        if t.get("expert") is not None and t.get("layer") is not None:
            cells.setdefault((t["layer"], t["expert"]), []).append(t)
    if not cells:
        return None
    layers = sorted({k[0] for k in cells})
    experts = max(k[1] for k in cells) + 1
    matrix = [[value(cells.get((layer, e), [])) for e in range(experts)] for layer in layers]
    return layers, experts, matrix


def _heatmap(plt, layers, experts, matrix, title, label, out_dir, file, log=False):
    from matplotlib.colors import LogNorm

    data = np.array(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=(max(5, 0.25 * experts + 2), max(2.5, 0.35 * len(layers) + 1.5)))
    positive = data[np.isfinite(data) & (data > 0)]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if log and positive.size else None
    image = ax.imshow(data, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
    ax.set_yticks(range(len(layers)), [str(k) for k in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label=label)
    return _save(fig, out_dir, file)


def plot_expert_heatmaps(report: dict, out_dir: str) -> list[tuple[str, str]]:
    plt = _pyplot()
    out = []
    weights = lambda ts: [t for t in ts if t["role"] == "weight" and "sumsq" in t]  # noqa: E731
    norm = _expert_matrix(report, lambda ts: math.sqrt(sum(_as_float(t["sumsq"]) for t in weights(ts)))
                          if weights(ts) else math.nan)
    if norm is not None:
        out.append((_heatmap(plt, *norm, "Frobenius norm of each routed expert's weights", "norm", out_dir,
                             "experts_norm.png"), "Weight norm per routed expert and layer."))
    scales = lambda ts: [t for t in ts if t["role"] == "scale" and "mean" in t]  # noqa: E731
    scale = _expert_matrix(report, lambda ts: (sum(t["mean"] * t["numel"] for t in scales(ts))
                                               / sum(t["numel"] for t in scales(ts))) if scales(ts) else math.nan)
    if scale is not None and any(math.isfinite(x) for row in scale[2] for x in row):
        out.append((_heatmap(plt, *scale, "Mean FP8 block scale (scale_inv) per routed expert", "mean scale_inv",
                             out_dir, "experts_scale.png", log=True), "Mean block scale per routed expert and layer."))
    by_expert = report["formats"]["by_expert"]
    for fmt in [f for f in HEATMAP_FORMATS if f in by_expert]:
        cells = {(c["layer"], c["expert"]): c["rel_error"] for c in by_expert[fmt]}
        layers = sorted({k[0] for k in cells})
        experts = max(k[1] for k in cells) + 1
        matrix = [[_as_float(cells.get((layer, e))) for e in range(experts)] for layer in layers]
        out.append((_heatmap(plt, layers, experts, matrix, f"{fmt}: relative error per routed expert", "relative error",
                             out_dir, f"experts_error_{fmt}.png", log=True),
                    f"How the {fmt} error spreads across layers and routed experts."))
    return out


def _as_float(x) -> float:
    if x is None:
        return math.nan
    return float(x)  # "inf" / "nan" strings included


def plot_format_summary(report: dict, out_dir: str):
    overall = report["formats"]["overall"]
    if not overall:
        return None
    plt = _pyplot()
    names = list(overall)
    rel = [_as_float(overall[f]["rel_error"]) for f in names]
    snr = [_as_float(overall[f]["snr_db"]) for f in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4), layout="constrained")
    floor = log_floor(rel)
    a.bar(names, [r if math.isfinite(r) and r > 0 else math.nan for r in rel], color="tab:red", label="relative error")
    exact = [i for i, r in enumerate(rel) if r == 0]
    if exact:  # a log axis has no place for 0: a marker at its floor, named
        a.plot(exact, [floor] * len(exact), "v", color="black", markersize=8, label="exact round trip (error 0)")
    a.set_yscale("log")
    a.set_ylim(bottom=floor / 2)
    a.set_ylabel("||x - q(x)|| / ||x||")
    a.set_title("relative error (lower is better)", fontsize=9)
    a.legend(fontsize=7)
    b.bar(names, [s if math.isfinite(s) else math.nan for s in snr], color="tab:green")
    for i, s in enumerate(snr):
        if s == math.inf:
            b.annotate("exact", (i, 0), ha="center", va="bottom", fontsize=7)
    b.set_ylabel("SNR (dB)")
    b.set_title("signal-to-quantization-noise ratio (higher is better)", fontsize=9)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_ha("right")
    fig.suptitle("Quantization formats on these values")
    return _save(fig, out_dir, "formats_summary.png"), "Error of each format over all values."


def _plot_lines(report: dict, out_dir: str, key: str, file: str, xlabel: str, title: str):
    table = report["formats"][key]
    if not table:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = list(dict.fromkeys(x for cells in table.values() for x in cells))  # the table's order (groups: group_rank)
    log_lines(ax, xs, {fmt: [_as_float(cells.get(x, {}).get("rel_error")) for x in xs] for fmt, cells in table.items()})
    ax.set_xticks(range(len(xs)), xs, rotation=30 if key != "by_layer" else 0,
                  ha="right" if key != "by_layer" else "center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative error")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out_dir, file), title + "."


def draw_all(groups: dict[str, np.ndarray], layers: dict[int, np.ndarray], report: dict, out_dir: str,
             attention: dict[str, np.ndarray] | None = None) -> list[dict]:
    """Every picture the data allows; returns [{"file", "caption"}] in display order.

    `groups` holds the sampled values per group in display order, `layers` per layer; `report` is
    what stats.json holds; `attention` per-head attention probabilities [heads, query, key] by label.
    """
    from .attention_plots import plot_attention_maps

    drawn = [plot_histograms(groups, out_dir), plot_boxplots(groups, layers, out_dir),
             plot_qq(groups, out_dir), plot_format_summary(report, out_dir),
             _plot_lines(report, out_dir, "by_layer", "formats_by_layer.png", "layer",
                         "Relative error of each format per layer"),
             _plot_lines(report, out_dir, "by_group", "formats_by_group.png", "group",
                         "Relative error of each format per group")]
    drawn += plot_expert_heatmaps(report, out_dir)
    drawn += plot_attention_maps(attention or {}, out_dir)
    return [{"file": f, "caption": c} for f, c in filter(None, drawn)]

