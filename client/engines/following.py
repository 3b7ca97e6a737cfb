"""New generations into a running engine: what the load recorded, and the refresh that uses it.

At load the engine records which served checkpoint tensors fed each parameter (its weight loader's calls) and
every parameter as loaded (the object vLLM's loaders write into, its shape and dtype). A refresh moves the lease
to the daemon's latest generation and redoes the load for the modules whose parameters a changed tensor fed, and
for those only: their parameters as loaded again, the changed and unchanged tensors that feed them through the
model's own `load_weights`, the module's own post-load step (vLLM's packing, oneDNN's handles), then the shared
views: as served, or the daemon's derived expert layout (made once per host: the first engine to refresh asks,
the others map). Its output then equals a fresh engine on the new weights.
"""

from __future__ import annotations

import ctypes
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from expertd.index import moved

from .binding import bind_shared
from .derive import expert_sources, fetch, share_experts
from .fused import share_fused

log = logging.getLogger("vllm.expertd")


@dataclass
class Loaded:
    """What a load recorded for later refreshes (kept on the model as `_expertd_loaded`)."""

    client: object
    feeds: dict[str, set[str]] = field(default_factory=dict)  # parameter name -> checkpoint tensors that fed it
    params: dict[str, tuple[nn.Parameter, tuple, torch.dtype]] = field(default_factory=dict)  # as loaded
    derived: dict[str, dict] = field(default_factory=dict)  # parameter name -> the request of its derived layout

    def owners(self, names) -> dict[str, list[str]]:
        """module name -> its loaded parameters' leaf names, for the modules owning `names`."""
        out: dict[str, list[str]] = {}
        for name in self.params:
            owner, _, leaf = name.rpartition(".")
            out.setdefault(owner, []).append(leaf)
        wanted = {name.rpartition(".")[0] for name in names}
        return {owner: leaves for owner, leaves in out.items() if owner in wanted}


@contextmanager
def recording(model: nn.Module, loaded: Loaded):
    """Record, while the model's `load_weights` runs inside, which checkpoint tensors feed each parameter; yields
    a function that wraps the weights iterator."""
    current = [None]
    originals, copies = {}, []

    def note(name):
        if current[0] is not None:
            loaded.feeds.setdefault(name, set()).add(current[0])

    for name, param in model.named_parameters():
        loaded.params[name] = (param, tuple(param.shape), param.dtype)

        def copy(*args, _name=name, _inner=param.copy_, **kwargs):  # loaders that write the parameter themselves
            note(_name)
            return _inner(*args, **kwargs)

        param.copy_ = copy
        copies.append(param)
        inner = getattr(param, "weight_loader", None)
        if inner is None:  # loaded by vLLM's default loader, under its own name (unless copied into, above)
            loaded.feeds.setdefault(name, set()).add(name)
            continue
        originals[name] = inner

        def record(*args, _name=name, _inner=inner, **kwargs):
            note(_name)
            return _inner(*args, **kwargs)

        param.weight_loader = record

    def tagged(weights):
        for name, tensor in weights:
            current[0] = name
            yield name, tensor
        current[0] = None

    try:
        yield tagged
    finally:
        for name, inner in originals.items():
            loaded.params[name][0].weight_loader = inner
        for param in copies:
            del param.copy_


def release_replaced(model: nn.Module, loaded: Loaded) -> None:
    """Empty the loaded parameters the post-load step replaced (a packed copy, an emptied oneDNN weight): kept for
    a refresh to load into again, they must not keep their bytes. Then hand the freed private copies back to the
    system (glibc keeps freed heap memory for reuse otherwise: the engine's private memory would not shrink)."""
    current = {id(p) for p in model.parameters()}
    for param, _shape, dtype in loaded.params.values():
        if id(param) not in current and param.numel():
            param.data = torch.empty(0, dtype=dtype, device=param.device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def share(model: nn.Module, loaded: Loaded, sources: dict, shapes: dict, only: set[str] | None = None
          ) -> tuple[list[str], list[str]]:
    """Bind what vLLM uses as served to the shared views, its repacked experts and what it fused or padded to the
    daemon's derived tensors (of the parameters `only` names, if given); (bound as served, bound derived)."""
    view = model if only is None else _Only(model, only)
    bound = bind_shared(view, loaded.client.tensors(), loaded.feeds)
    packed = share_experts(view, loaded.client, sources, shapes, loaded.derived)
    fused = share_fused(model, loaded.client, loaded.feeds, loaded.params, loaded.derived, only)
    return bound, packed + fused


def changed_tensors(client) -> tuple[int, int, set[str]]:
    """Move the client's lease to the latest generation: (old generation, new, the checkpoint tensors whose bytes
    differ)."""
    before = client.index()
    client.refresh()
    index = client.index()
    changed = moved(before.checkpoint_entries().values(), index.checkpoint_entries().values())
    return before.generation, index.generation, set(changed)


def reload_modules(model: nn.Module, loaded: Loaded, owners: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """Load the modules `owners` names again from the current generation (their parameters as loaded, the model's
    own `load_weights`, each module's post-load step as at a first load), then share; (bound, derived) names."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    modules = dict(model.named_modules())
    names = [f"{owner}.{leaf}" if owner else leaf for owner, leaves in owners.items() for leaf in leaves]
    fed = [name for name in names if name in loaded.feeds]
    for name in fed:  # the parameters as loaded, with room for the new bytes
        param, shape, dtype = loaded.params[name]
        owner, _, leaf = name.rpartition(".")
        param.data = torch.empty(shape, dtype=dtype, device=param.device)
        modules[owner]._parameters[leaf] = param
    tensors = loaded.client.tensors()
    feeding = sorted(set().union(*(loaded.feeds[name] for name in fed))) if fed else []
    with set_default_torch_dtype(next(iter(loaded.params.values()))[2]):
        model.load_weights(iter([(name, tensors[name]) for name in feeding]))
    sources = expert_sources(_Only(model, fed), loaded.client.served_tensors(), loaded.feeds)
    for owner in owners:
        method = getattr(modules[owner], "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            continue
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None  # vLLM's MoE post-load step packs for its kernel at a first load only
        method.process_weights_after_loading(modules[owner])
    shapes = {owner: {leaf: loaded.params[f"{owner}.{leaf}"][1:] for leaf in leaves} for owner, leaves in
              owners.items()}
    return share(model, loaded, sources, shapes, set(names))


def refresh_model(model: nn.Module) -> dict:
    """Follow the daemon's latest generation in this engine's model (see the module's docstring); a summary."""
    loaded: Loaded | None = getattr(model, "_expertd_loaded", None)
    if loaded is None:
        raise TypeError("this engine's model was not loaded with load_format 'expertd' and zero_copy: nothing to "
                        "refresh")
    t0 = time.perf_counter()
    old, new, changed = changed_tensors(loaded.client)
    hit = {name for name, fed in loaded.feeds.items() if fed & changed}
    params = dict(model.named_parameters())
    again = sorted(name for name in hit if name in loaded.derived)  # the daemon's layout of the new bytes
    for name, view in zip(again, fetch(loaded.client, [loaded.derived[name] for name in again])):
        params[name].data = view
    owners = loaded.owners(hit - set(again))
    bound, packed = reload_modules(model, loaded, owners) if owners else ([], [])
    release_replaced(model, loaded)
    took = time.perf_counter() - t0
    log.info("expertd: generation %d -> %d: %d checkpoint tensor(s) changed; %d expert parameter(s) remapped in the "
             "derived layout, %d module(s) reloaded in %.2f s", old, new, len(changed), len(again), len(owners), took)
    return {"generation": new, "changed": len(changed), "remapped": again, "modules": sorted(owners),
            "rebound": sorted(bound + packed), "seconds": took}


def follow_hook(model: nn.Module, args) -> None:
    """A forward pre-hook (option `follow`): before the first step after the daemon published a newer generation
    (the client learns it from its heartbeats and replies), refresh. Requests in flight go on with the new weights."""
    client = model._expertd_loaded.client
    if client.latest_generation > client.index().generation:
        with torch.inference_mode(False):
            refresh_model(model)


class _Only(nn.Module):
    """`model` seen through the parameters `names` only (what binding looks at, for the reloaded modules)."""

    def __init__(self, model: nn.Module, names):
        super().__init__()
        self.__dict__["_model"], self.__dict__["_names"] = model, set(names)

    def named_parameters(self, *args, **kwargs):
        return ((n, p) for n, p in self._model.named_parameters() if n in self._names)

    def named_modules(self, *args, **kwargs):
        return self._model.named_modules(*args, **kwargs)

    def load_weights(self, weights):
        return self._model.load_weights(weights)
