"""What every picture of the tools shares: the Agg backend, saving, and log axes that show exact zeros."""

from __future__ import annotations

import math
import os


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig, out_dir: str, file: str) -> str:
    fig.savefig(os.path.join(out_dir, file), dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    return file


def log_floor(values) -> float:
    """Where exact (zero) points sit on a log axis: a decade under the smallest positive value."""
    positive = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    return 10.0 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-12


def log_lines(ax, xs: list, series: dict[str, list[float]], floor: float | None = None, marker: str = "o-") -> None:
    """One line per series on a log y axis; zeros (exact round trips) drawn as hollow markers at the axis
    floor and named in the legend, so an exact format shows as a full line, not as a missing one."""
    floor = floor or log_floor([v for ys in series.values() for v in ys])
    positions = list(range(len(xs)))
    for name, ys in series.items():
        has_line = any(y > 0 for y in ys)  # a series with no positive point keeps its colour but no legend entry
        line, = ax.plot(positions, [y if y > 0 else math.nan for y in ys], marker,
                        label=name if has_line else "_" + name, markersize=3)
        zeros = [i for i, y in enumerate(ys) if y == 0]
        if zeros:
            ax.plot(zeros, [floor] * len(zeros), "v", mfc="none", color=line.get_color(), markersize=7,
                    label=f"{name}: exact (0), drawn at the floor")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xticks(positions, [str(x) for x in xs])
