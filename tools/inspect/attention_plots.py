"""Per-head attention heatmaps (query x key) from a capture's attention probabilities, as plain arrays."""

from __future__ import annotations

import math
import re

import numpy as np

from ..plotting import pyplot, save

MAX_HEADS = 16  # heads drawn per module (the first ones); the rest are in the capture files


def plot_attention_maps(maps: dict[str, np.ndarray], out_dir: str) -> list[tuple[str, str]]:
    """One PNG per attention module: a grid of its heads' probabilities [query, key] (first batch row)."""
    plt = pyplot()
    out = []
    for label, probs in maps.items():
        heads = min(probs.shape[0], MAX_HEADS)
        cols = min(4, heads)
        rows = math.ceil(heads / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols, 3.0 * rows), squeeze=False, layout="constrained")
        for h, ax in enumerate(axes.flat):
            if h >= heads:
                ax.set_visible(False)
                continue
            image = ax.imshow(probs[h], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"head {h}", fontsize=8)
            ax.set_xlabel("key position", fontsize=7)
            ax.set_ylabel("query position", fontsize=7)
        fig.colorbar(image, ax=list(axes.flat), label="attention probability", shrink=0.8)
        shown = f"{heads} of {probs.shape[0]} heads" if heads < probs.shape[0] else f"{heads} heads"
        fig.suptitle(f"Attention probabilities: {label} ({shown})")
        file = "attention_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label) + ".png"
        out.append((save(fig, out_dir, file), f"Per-head attention probabilities of {label} (query x key)."))
    return out
