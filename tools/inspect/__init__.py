"""`expertd inspect`: what a checkpoint, a running daemon or an activation capture holds, as numbers.

Every tensor is read once, one at a time (FP8 weights dequantized with their scales, so the values
are the ones the model computes with): its dtype, shape and bytes, min/max/mean/std, the fraction of
zeros and of non-finite values, and the error every low-precision format of `expertd.tools.number_formats` would
make on it. Totals go by dtype and by component (attention, dense MLP, shared and routed experts,
router, embeddings, norms), with the memory the model would take in bf16, fp16, fp32 and fp8. Format
errors are summed over components, layers and (layer, expert) pairs, so their spread can be drawn.

`sources` turns the source into tensors to load, `inspection` walks them (`stats` per tensor,
`groups` for the sums), `report` writes OUT/stats.json, stats.md and index.html, `plots` the PNGs
(`attention_plots` the per-head heatmaps of a capture made with `attention_probs=True`).
"""

from __future__ import annotations

import os

from .. import number_formats as fmts

from .groups import component_of
from .inspection import Inspection
from .report import write_report
from .sources import attention_maps, open_source

__all__ = ["component_of", "inspect"]


def inspect(src: str, out_dir: str, formats: list[str] | None = None, sample: int = 100_000, plots: bool = True,
            timeout: float = 30.0, token: str | None = None) -> dict:
    """Inspect `src` (checkpoint folder, daemon endpoint or capture folder); write stats, plots and index.html."""
    formats = list(fmts.FORMATS) if formats is None else formats
    unknown = [f for f in formats if f not in fmts.FORMATS]
    if unknown:
        raise ValueError(f"unknown format(s) {unknown}; known: {', '.join(fmts.FORMATS)}")
    with open_source(src, timeout=timeout, token=token) as source:
        inspection = Inspection(source, formats, sample).run()
        attention = attention_maps(source.items) if plots and source.kind == "capture" else {}
    report = inspection.to_dict()
    os.makedirs(out_dir, exist_ok=True)
    report["plots"] = []
    if plots:
        from .plots import draw_all

        report["plots"] = draw_all(*inspection.value_samples(), report, out_dir, attention)
    write_report(report, out_dir, page=plots)
    return report
