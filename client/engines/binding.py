"""Zero copy where the engine allows it: parameters it uses exactly as served become the daemon's shared views.

Bound after the engine's post-load processing and only where the parameter still equals the served tensor byte for
byte (same name, shape and dtype): a parameter the engine fused (vLLM's qkv_proj, gate_up_proj), repacked (its CPU
kernel's experts) or replaced keeps its private copy. The views are read-only mappings: a forward pass never writes
a weight, an in-place reload would (and dies of SIGSEGV), hence the vLLM loader's `zero_copy: false`.
"""

from __future__ import annotations

import bisect
import math

import torch
from torch import nn

from expertd.client.residency import shared_ranges
from expertd.shm import same_bytes


def bind_shared(model: nn.Module, served: dict[str, torch.Tensor], feeds: dict[str, set[str]] | None = None
                ) -> list[str]:
    """Point each parameter of `model` that equals the served tensor of its name, or the one served tensor that fed
    it (`feeds`: gpt-oss's `embedding` is the checkpoint's `embed_tokens`), at that (shared) tensor; returns the names
    bound."""
    bound = []
    for name, param in model.named_parameters():
        fed = (feeds or {}).get(name) or ()
        view = served.get(name) if name in served else served.get(next(iter(fed))) if len(fed) == 1 else None
        if view is None or view.shape != param.shape or view.dtype != param.dtype or view.device != param.device:
            continue
        if param.data_ptr() != view.data_ptr() and same_bytes(param.data, view):
            param.data = view
            bound.append(name)
    return bound


def residency(model: nn.Module, shm_dir: str) -> dict[str, tuple[int, bool]]:
    """name -> (bytes, whether they lie in a read-only shared mapping of `shm_dir`), for every parameter and buffer
    of `model` (a tensor shared by two names is listed under the first)."""
    ranges = shared_ranges(shm_dir)
    starts = [lo for lo, _ in ranges]
    out, seen = {}, set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        key = (t.data_ptr(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        size, lo = t.numel() * t.element_size(), t.data_ptr()
        k = bisect.bisect_right(starts, lo) - 1
        out[name] = (size, t.device.type == "cpu" and (size == 0 or (k >= 0 and lo + size <= ranges[k][1])))
    return out


def accounting(model: nn.Module, loaded: dict, bound: list[str], derived: list[str]) -> dict[str, int]:
    """Bytes of the engine's weights by where they are: "served" (parameters mapping the daemon's tensors as
    served), "derived" (mapping its derived tensors), "private" (the model's other parameters), "kernels" (parameters
    a kernel emptied after packing its own copy, e.g. oneDNN's linear layers, counted at their loaded size: that
    copy is no parameter of the model). `loaded`: name -> (parameter, shape, dtype) as loaded."""
    params = dict(model.named_parameters())
    size = lambda names: sum(params[n].nbytes for n in names)  # noqa: E731
    kernels = sum(math.prod(shape) * dtype.itemsize for name, (_, shape, dtype) in loaded.items()
                  if name in params and params[name].numel() == 0 and math.prod(shape))
    return {"served": size(bound), "derived": size(derived), "kernels": kernels,
            "private": sum(p.nbytes for n, p in params.items() if n not in set(bound) | set(derived))}


def report(memory: dict[str, int], count: int, served_bytes: int) -> str:
    """One line of `accounting`'s figures for the engine's log."""
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    return (f"expertd: {count} parameter(s) map shared memory ({mib(memory['served'])} as served, "
            f"{mib(memory['derived'])} derived once per host); the model's other parameters hold "
            f"{mib(memory['private'])} privately, kernels' own packed copies {mib(memory['kernels'])} (of "
            f"{mib(served_bytes)} served)")
