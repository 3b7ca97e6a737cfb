"""`expertd evaluate`: what a number format costs end to end, measured on the next-token distribution.

For each format, on one fixed token batch, the model runs under `expertd.tools.simulate` (weights
and/or activations of the chosen modules in that format) and is compared with the unsimulated run:

- KL(p || q) of the next-token distribution, p unsimulated, q simulated (mean and max over positions);
- top-1 agreement: the fraction of positions whose argmax token is the same;
- max |delta logit| over every position and vocabulary entry.

Log-softmax and KL are taken in float64, so a format that reproduces the served weights bit for bit
(`bf16` on a bf16 model) reports exactly 0 and 1. `--per-layer` also simulates one decoder layer at a
time. The model comes from a daemon (zero copy: `ExpertClient.load_model()`) or from a checkpoint
folder (FP8 weights dequantized with the pure-torch reference, bf16 folders read as they are).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from .number_formats import resolve_format
from expertd.index import write_json_atomic

log = logging.getLogger("expertd.evaluate")

RESULT = "evaluate.json"


def load_checkpoint_model(folder: str, dtype: torch.dtype = torch.bfloat16):
    """A model built from a checkpoint folder: FP8 weights dequantized by the reference kernel (one copy)."""
    from expertd.client import restore
    from expertd.fusion import parts_of
    from expertd.hf import empty_model, fusions_for
    from expertd.hf_dtypes import loaded_dtypes
    from expertd.quantization import quantization_format

    from expertd.server.load.layout import make_source
    from expertd.server.load.checkpoint import Checkpoint

    ckpt = Checkpoint.open(folder)
    try:
        codec = quantization_format(ckpt.config, os.path.join(ckpt.folder, "config.json"))
        tensors = {}
        for name, (stored, aux) in codec.logical(ckpt.tensors).items():
            t = ckpt.read(stored)
            src = make_source(ckpt, codec, name, stored, aux) if aux is not None else None
            if src is not None and src.decoding is not None:
                t = src.codec.reference(t, ckpt.read(aux), src.block, dtype)
            elif t.is_floating_point() and t.dtype != dtype and t.dim() >= 2:
                t = t.to(dtype)
            tensors[name] = t
        config = dict(ckpt.config)
    finally:
        ckpt.close()
    config.pop("quantization_config", None)
    model = empty_model(config, dtype)
    fusions = fusions_for(model.config.model_type)
    want = loaded_dtypes(model, dtype)  # from_pretrained's dtypes: fp32 where transformers keeps it (router bias)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        parts = None if name in tensors else parts_of(fusions, name, tuple(p.shape))
        if parts is not None and all(n in tensors for n, _ in parts[1]):  # stack per-expert matrices: one copy
            tensors[name] = torch.cat([tensors.pop(n).reshape(-1) for n, _ in parts[1]]).view(p.shape)
        if name in tensors and name in want and tensors[name].dtype != want[name]:
            tensors[name] = tensors[name].to(want[name])
    restore(model, tensors, strict=True, dtypes=want, unexpected=False)
    return model.eval()


def token_batch(tokens: str | None, random: int | None, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] token ids: from a file (a JSON list of lists, or one sequence of integers per line)
    or `random` ids drawn with a fixed seed (default 64)."""
    if tokens:
        with open(tokens) as f:
            text = f.read()
        try:
            rows = json.loads(text)
            rows = [rows] if rows and isinstance(rows[0], int) else rows
        except json.JSONDecodeError:
            rows = [[int(t) for t in line.replace(",", " ").split()] for line in text.splitlines() if line.strip()]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError(f"{tokens}: needs one or more token sequences of equal length")
        ids = torch.tensor(rows, dtype=torch.long)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"{tokens}: token ids must lie in [0, {vocab_size})")
        return ids
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (1, random or 64), generator=gen)


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(ids.to(device)).logits.double().cpu()


def compare(base: torch.Tensor, sim: torch.Tensor) -> dict:
    """KL(base || sim) per position (mean and max), top-1 agreement and max |delta logit|."""
    logp, logq = torch.log_softmax(base, -1), torch.log_softmax(sim, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp(min=0).reshape(-1)  # rounding may leave -1e-17
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((base.argmax(-1) == sim.argmax(-1)).double().mean()),
            "max_abs_dlogit": float((base - sim).abs().max())}


def _layer_modules(model, modules) -> dict[int, list[str]]:
    from .capture import split_layer
    from .simulate import simulated_modules

    by_layer: dict[int, list[str]] = {}
    for name, _ in simulated_modules(model, modules):
        layer, _ = split_layer(name)
        if layer is not None:
            by_layer.setdefault(layer, []).append(name)
    return dict(sorted(by_layer.items()))


def evaluate_model(model, ids: torch.Tensor, formats: list[str], modules=None, weights: bool = True,
                   activations: bool = True, per_layer: bool = False) -> dict:
    """The cost of each format on `model` for the token batch `ids` (see the module docstring)."""
    from .simulate import simulate

    if not (weights or activations):
        raise ValueError("evaluate: weights and activations both off: nothing to simulate")
    formats = [resolve_format(f) for f in formats]
    modules = list(modules or ["*"])
    base = _logits(model, ids)
    layers = _layer_modules(model, modules) if per_layer else {}
    results = {}
    for fmt in formats:
        kw = {"weights": fmt if weights else None, "activations": fmt if activations else None}
        with simulate(model, modules=modules, **kw) as sim:
            row = compare(base, _logits(model, ids))
        row["modules_simulated"] = len(sim.modules)
        if per_layer:
            row["per_layer"] = {}
            for layer, names in layers.items():
                with simulate(model, modules=names, **kw):
                    row["per_layer"][str(layer)] = compare(base, _logits(model, ids))
        log.info("%s: KL mean %.3g, top-1 %.4f", fmt, row["kl_mean"], row["top1_agreement"])
        results[fmt] = row
    return {"tokens": list(ids.shape), "modules": modules, "weights": weights, "activations": activations,
            "per_layer": per_layer, "formats": results}


def markdown(result: dict, where: str) -> str:
    what = " and ".join(k for k in ("weights", "activations") if result[k])
    lines = [f"# expertd evaluate: {where}", "",
             f"{what} of modules {', '.join(result['modules'])} simulated, on {result['tokens'][0]} x "
             f"{result['tokens'][1]} tokens; compared with the unsimulated model.", "",
             "| format | modules | KL mean | KL max | top-1 agreement | max abs delta logit |",
             "|---|---|---|---|---|---|"]
    for fmt, r in result["formats"].items():
        lines.append(f"| {fmt} | {r['modules_simulated']} | {r['kl_mean']:.3g} | {r['kl_max']:.3g} | "
                     f"{r['top1_agreement']:.4f} | {r['max_abs_dlogit']:.3g} |")
    if result["per_layer"]:
        formats = list(result["formats"])
        layers = list(next(iter(result["formats"].values()))["per_layer"]) if formats else []
        lines += ["", "## KL mean with one layer simulated at a time", "",
                  "| layer | " + " | ".join(formats) + " |", "|---" * (len(formats) + 1) + "|"]
        for layer in layers:
            lines.append(f"| {layer} | " + " | ".join(f"{result['formats'][f]['per_layer'][layer]['kl_mean']:.3g}"
                                                        for f in formats) + " |")
    lines += ["", "KL is KL(p || q), p the unsimulated and q the simulated next-token distribution, in nats; "
              "0 and agreement 1 mean the format reproduces the model exactly.", ""]
    return "\n".join(lines)


def write_outputs(result: dict, out_dir: str, where: str, plots: bool = True) -> dict:
    """OUT/evaluate.json, evaluate.md and the pictures."""
    os.makedirs(out_dir, exist_ok=True)
    result = {"source": where, **result, "plots": []}
    if plots:
        from .evaluate_plots import draw

        kl = {f: (r["kl_mean"], r["kl_max"]) for f, r in result["formats"].items()}
        per_layer = {f: {int(k): v["kl_mean"] for k, v in r.get("per_layer", {}).items()}
                     for f, r in result["formats"].items()}
        result["plots"] = draw(kl, per_layer if result["per_layer"] else {}, out_dir)
    write_json_atomic(os.path.join(out_dir, RESULT), result)
    with open(os.path.join(out_dir, "evaluate.md"), "w") as f:
        f.write(markdown(result, where))
    return result
