"""The files `inspect` writes from its report dict: stats.json, stats.md and the index.html that shows the plots."""

from __future__ import annotations

import html
import json
import os

from .groups import group_rank
from .stats import FOOTPRINT_DTYPES


FP8_NOTE = ("fp8: e4m3 with float32 128x128 block scales for the tensors DeepSeek-V3 stores so (the ones already "
            "stored in fp8, and their kind elsewhere), bf16 for the rest (norms, router, embeddings).")
E5M2_NOTE = (
    "fp8_e5m2_block128 can show a higher error than fp8_e5m2_tensor on weights that were stored as e4m3 with "
    "128x128 block scales. This is not a defect: a block's e5m2 scale maps its amax (448 x its e4m3 scale) to "
    "57344, so each e4m3 value q becomes 128 q and keeps its 3-bit mantissa; every value with an odd last bit then "
    "lands halfway (up to the bf16 rounding of the dequantized weight) between two e5m2 values (2 mantissa bits): "
    "the largest possible rounding error, on about half the values. A per-tensor scale is not aligned with the "
    "blocks and spreads the values over the grid. An independent numpy re-implementation of e5m2 block scaling "
    "gives the same numbers on such a tensor, and on Gaussian values (no e4m3 grid) block and per-tensor e5m2 "
    "agree within 0.2%.")


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


def write_report(report: dict, out_dir: str, page: bool = True) -> None:
    """stats.json (strict JSON), stats.md and, with `page`, index.html."""
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    with open(os.path.join(out_dir, "stats.md"), "w") as f:
        f.write(markdown(report))
    if page:
        write_html(report, out_dir)


def markdown(report: dict) -> str:
    """The readable stats file: totals, footprint, format errors, then one row per tensor."""
    totals, formats = report["totals"], report["formats"]
    lines = [f"# expertd inspect: {report['source']['kind']} {report['source']['where']}", "",
             f"{totals['tensors']} tensors, {_fmt_bytes(totals['bytes'])} as stored.", "", "## By dtype", "",
             "| dtype | tensors | elements | bytes |", "|---|---:|---:|---:|"]
    lines += [f"| {d} | {v['tensors']} | {v['numel']:,} | {_fmt_bytes(v['bytes'])} |"
              for d, v in totals["by_dtype"].items()]
    keys = [*FOOTPRINT_DTYPES, "fp8"]
    lines += ["", "## By component (memory footprint per dtype)", "",
              "| component | tensors | elements | as stored | " + " | ".join(keys) + " |",
              "|---|" + "---:|" * (3 + len(keys))]
    for c, v in totals["by_component"].items():
        lines.append(f"| {c} | {v['tensors']} | {v['numel']:,} | {_fmt_bytes(v['bytes'])} | "
                     + " | ".join(_fmt_bytes(v["footprint"][k]) for k in keys) + " |")
    lines.append("| **total** | | | | " + " | ".join(f"**{_fmt_bytes(totals['footprint'][k])}**" for k in keys) + " |")
    lines += ["", FP8_NOTE, ""]
    if formats["overall"]:
        comps = sorted({c for v in formats["by_component"].values() for c in v}, key=group_rank)
        lines += ["## Quantization formats: relative error ||x - q(x)|| / ||x|| (SNR dB)", "",
                  "| format | overall | " + " | ".join(comps) + " |", "|---|---:|" + "---:|" * len(comps)]
        for fmt, e in formats["overall"].items():
            cells = [formats["by_component"].get(fmt, {}).get(c) for c in comps]
            lines.append(f"| {fmt} | {_fmt_num(e['rel_error'])} ({_fmt_num(e['snr_db'])}) | "
                         + " | ".join(f"{_fmt_num(x['rel_error'])} ({_fmt_num(x['snr_db'])})" if x else ""
                                      for x in cells) + " |")
        lines += ["", "0 (inf): an exact round trip.", ""]
        if {"fp8_e5m2_tensor", "fp8_e5m2_block128"} <= set(formats["overall"]):
            lines += [E5M2_NOTE, ""]
    lines += ["## Tensors", "",
              "| name | dtype | format | shape | bytes | min | max | mean | std | zeros | non-finite |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in report["tensors"]:
        lines.append(f"| {t['name']} | {t['dtype']} | {t.get('format', '')} | "
                     f"{'x'.join(map(str, t['shape'])) or 'scalar'} | {t['bytes']:,} | "
                     + " | ".join(_fmt_num(t.get(k)) for k in ("min", "max", "mean", "std", "zeros", "nonfinite"))
                     + " |")
    return "\n".join(lines) + "\n"

def write_html(report: dict, out_dir: str) -> str:
    """index.html: summary tables and every picture, linking stats.md and stats.json."""
    e = html.escape
    totals, formats = report["totals"], report["formats"]
    keys = ["bf16", "fp16", "fp32", "fp8"]
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>expertd inspect</title><style>"
             "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}"
             "figure{display:inline-block;margin:1em;vertical-align:top}img{max-width:100%}</style></head><body>",
             f"<h1>expertd inspect</h1><p>{e(report['source']['kind'])}: <code>{e(report['source']['where'])}</code> — "
             f"{totals['tensors']} tensors, {_fmt_bytes(totals['bytes'])} as stored. "
             "<a href='stats.md'>stats.md</a> · <a href='stats.json'>stats.json</a></p>",
             "<h2>Memory by component and dtype</h2><table><tr><th>component</th><th>tensors</th><th>as stored</th>"
             + "".join(f"<th>{k}</th>" for k in keys) + "</tr>"]
    for c, v in totals["by_component"].items():
        parts.append(f"<tr><td>{e(c)}</td><td>{v['tensors']}</td><td>{_fmt_bytes(v['bytes'])}</td>"
                     + "".join(f"<td>{_fmt_bytes(v['footprint'][k])}</td>" for k in keys) + "</tr>")
    parts += ["<tr><th>total</th><th></th><th>" + _fmt_bytes(totals["bytes"]) + "</th>"
              + "".join(f"<th>{_fmt_bytes(totals['footprint'][k])}</th>" for k in keys) + "</tr></table>",
              f"<p><small>{e(FP8_NOTE)}</small></p>"]
    if formats["overall"]:
        parts.append("<h2>Quantization formats</h2><table>"
                     "<tr><th>format</th><th>relative error</th><th>SNR (dB)</th></tr>")
        parts += [f"<tr><td>{e(f)}</td><td>{_fmt_num(v['rel_error'])}</td><td>{_fmt_num(v['snr_db'])}</td></tr>"
                  for f, v in formats["overall"].items()]
        parts.append("</table><p><small>0 / inf: an exact round trip.</small></p>")
        if {"fp8_e5m2_tensor", "fp8_e5m2_block128"} <= set(formats["overall"]):
            parts.append(f"<p><small>{e(E5M2_NOTE)}</small></p>")
    parts.append("<h2>Pictures</h2>")
    parts += [f"<figure><img src='{e(p['file'])}' alt='{e(p['caption'])}'>"
              f"<figcaption>{e(p['caption'])}</figcaption></figure>"
              for p in report["plots"]]
    parts.append("</body></html>\n")
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path
