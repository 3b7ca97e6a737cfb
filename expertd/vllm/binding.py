"""Zero copy where vLLM allows it: parameters that vLLM uses exactly as served become the daemon's shared views.

Bound after vLLM's post-load processing and only where the parameter still equals the served tensor byte for byte
(same name, shape and dtype): a parameter vLLM fused (qkv_proj, gate_up_proj), repacked (its CPU kernel's experts)
or replaced keeps its private copy. The views are read-only mappings: a forward pass never writes a weight, an
in-place reload would (and dies of SIGSEGV), hence the loader's `zero_copy: false`.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from expertd.client.residency import shared_ranges


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
        if param.data_ptr() != view.data_ptr() and torch.equal(param.data, view):
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


def report(model: nn.Module, served_bytes: int, bound: list[str], derived: list[str]) -> str:
    """One line: the parameters bound to shared memory (as served, or the daemon's derived expert layout) and the
    bytes the model's other parameters hold privately. Kernels' own copies (oneDNN's packed linear weights) are
    no parameter of the model and are not counted here."""
    params = dict(model.named_parameters())
    size = lambda names: sum(params[n].nbytes for n in names)  # noqa: E731
    private = sum(p.nbytes for n, p in params.items() if n not in set(bound) | set(derived))
    return (f"expertd: {len(bound) + len(derived)} parameter(s) map shared memory ({size(bound) / 2**20:.2f} MiB as "
            f"served, {size(derived) / 2**20:.2f} MiB in the daemon's derived expert layout); the model's other "
            f"parameters hold {private / 2**20:.2f} MiB privately (of {served_bytes / 2**20:.2f} MiB served)")
