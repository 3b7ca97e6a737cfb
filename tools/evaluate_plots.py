"""The pictures of `expertd evaluate`, from plain numbers: KL per format, and per layer."""

from __future__ import annotations

from .plotting import log_floor, log_lines, pyplot, save


def plot_kl(kl: dict[str, tuple[float, float]], out_dir: str):
    """Mean and max KL of each format (log axis; an exact format drawn at the floor and named)."""
    if not kl:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(kl)), 4), layout="constrained")
    names = list(kl)
    floor = log_floor([v for pair in kl.values() for v in pair])
    log_lines(ax, names, {"KL mean": [kl[f][0] for f in names], "KL max": [kl[f][1] for f in names]}, floor, marker="o")
    ax.set_xlabel("format")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    for label in ax.get_xticklabels():
        label.set_ha("right")
    ax.set_ylabel("KL(p || q) of the next token (nats)")
    ax.set_title("End-to-end cost of each format (lower is better)", fontsize=10)
    ax.legend(fontsize=7)
    return (save(fig, out_dir, "evaluate_kl.png"),
            "Mean and max KL divergence of the next-token distribution per format.")


def plot_kl_per_layer(per_layer: dict[str, dict[int, float]], out_dir: str):
    """Mean KL with one layer simulated at a time, one line per format."""
    per_layer = {f: v for f, v in per_layer.items() if v}
    if not per_layer:
        return None
    plt = pyplot()
    layers = sorted({k for v in per_layer.values() for k in v})
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(layers)), 4), layout="constrained")
    log_lines(ax, layers, {f: [v.get(k, float("nan")) for k in layers] for f, v in per_layer.items()})
    ax.set_xlabel("layer simulated (all others exact)")
    ax.set_ylabel("KL mean (nats)")
    ax.set_title("Which layers a format hurts", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    return save(fig, out_dir, "evaluate_kl_per_layer.png"), "Mean KL with one layer at a time in the format."


def draw(kl: dict[str, tuple[float, float]], per_layer: dict[str, dict[int, float]], out_dir: str) -> list[dict]:
    drawn = [plot_kl(kl, out_dir), plot_kl_per_layer(per_layer, out_dir)]
    return [{"file": f, "caption": c} for f, c in filter(None, drawn)]
