"""New generations into a running engine: what the load recorded, and the refresh that uses it.

At load the engine records which served checkpoint tensors fed each parameter (its weight loader's calls) and
every parameter as loaded (the object the engine's loaders write into, its shape and dtype), in its `EngineState`.
A refresh moves the lease to the daemon's latest generation and redoes the load for the modules whose parameters a
changed tensor fed, and for those only: their parameters as loaded again, the changed and unchanged tensors that
feed them through the model's own `load_weights`, the module's own post-load step (`Engine.post_load`: vLLM's
packing, oneDNN's handles), then the shared views: as served, or the daemon's derived expert layout (made once per
host: the first engine to refresh asks, the others map). Its output then equals a fresh engine on the new weights.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import contextmanager

import torch
from torch import nn

from expertd.errors import DerivedLimit
from expertd.index import moved
from expertd.leasing import pinned

from .binding import bind_shared
from .experts import expert_sources, fetch, share_experts
from .fused import share_fused
from .state import EngineState, state_of


@contextmanager
def recording(model: nn.Module, state: EngineState):
    """Record, while the model's `load_weights` runs inside, which checkpoint tensors feed each parameter; yields
    a function that wraps the weights iterator."""
    current = [None]
    originals, copies = {}, []

    def note(name):
        if current[0] is not None:
            state.feeds.setdefault(name, set()).add(current[0])

    for name, param in model.named_parameters():
        state.params[name] = (param, tuple(param.shape), param.dtype)

        def copy(*args, _name=name, _inner=param.copy_, **kwargs):  # loaders that write the parameter themselves
            note(_name)
            return _inner(*args, **kwargs)

        param.copy_ = copy
        copies.append(param)
        inner = getattr(param, "weight_loader", None)
        if inner is None:  # loaded by the engine's default loader, under its own name (unless copied into, above)
            state.feeds.setdefault(name, set()).add(name)
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
            state.params[name][0].weight_loader = inner
        for param in copies:
            del param.copy_


def release_replaced(model: nn.Module, state: EngineState) -> None:
    """Empty the loaded parameters the post-load step replaced (a packed copy, an emptied oneDNN weight): kept for
    a refresh to load into again, they must not keep their bytes. Then hand the freed private copies back to the
    system (glibc keeps freed heap memory for reuse otherwise: the engine's private memory would not shrink)."""
    current = {id(p) for p in model.parameters()}
    for param, _shape, dtype in state.params.values():
        if id(param) not in current and param.numel():
            param.data = torch.empty(0, dtype=dtype, device=param.device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def share(model: nn.Module, state: EngineState, sources: dict, shapes: dict, only: set[str] | None = None
          ) -> tuple[list[str], list[str]]:
    """Bind what the engine uses as served to the shared views, its repacked experts and what it fused or padded to
    the daemon's derived tensors (of the parameters `only` names, if given); (bound as served, bound derived)."""
    view = model if only is None else _Only(model, only)
    bound = bind_shared(view, state.tensors(), state.feeds)
    packed = share_experts(view, state, sources, shapes)
    fused = share_fused(model, state, only)
    return bound, packed + fused


def changed_tensors(client) -> tuple[int, int, set[str]]:
    """Move the client's lease to the latest generation: (old generation, new, the checkpoint tensors whose bytes
    differ)."""
    before = client.index()
    client.refresh()
    index = client.index()
    changed = moved(before.checkpoint_entries().values(), index.checkpoint_entries().values())
    return before.generation, index.generation, set(changed)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype is `dtype` inside (as the engine had it while it built and loaded the model)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def reload_modules(model: nn.Module, state: EngineState, owners: dict[str, list[str]]
                   ) -> tuple[list[str], list[str]]:
    """Load the modules `owners` names again from the current generation (their parameters as loaded, the model's
    own `load_weights`, each module's post-load step as at a first load), then share; (bound, derived) names."""
    modules = dict(model.named_modules())
    names = [f"{owner}.{leaf}" if owner else leaf for owner, leaves in owners.items() for leaf in leaves]
    fed = [name for name in names if name in state.feeds]
    for name in fed:  # the parameters as loaded, with room for the new bytes
        param, shape, dtype = state.params[name]
        owner, _, leaf = name.rpartition(".")
        param.data = torch.empty(shape, dtype=dtype, device=param.device)
        modules[owner]._parameters[leaf] = param
    tensors = state.tensors()
    feeding = sorted(set().union(*(state.feeds[name] for name in fed))) if fed else []
    with default_dtype(next(iter(state.params.values()))[2]):
        model.load_weights(iter([(name, tensors[name]) for name in feeding]))
    sources = expert_sources(_Only(model, fed), state.served(), state.feeds)
    for owner in owners:
        state.engine.post_load(modules[owner])
    shapes = {owner: {leaf: state.params[f"{owner}.{leaf}"][1:] for leaf in leaves} for owner, leaves in
              owners.items()}
    return share(model, state, sources, shapes, set(names))


def refresh_model(model: nn.Module) -> dict:
    """Follow the daemon's latest generation in this engine's model (see the module's docstring); a summary: the
    generation, how many checkpoint tensors changed, the parameters remapped, the modules reloaded, the parameters
    rebound, the seconds it took."""
    state = state_of(model)
    if state is None:
        raise TypeError("this engine's model was not loaded from expertd with zero_copy: nothing to refresh")
    t0 = time.perf_counter()
    try:
        with pinned(state.client, state.client.index().generation):  # its layouts live until the new ones are made
            old, new, changed = changed_tensors(state.client)
            hit = {name for name, fed in state.feeds.items() if fed & changed}
            again = sorted(name for name in hit if name in state.derived)  # the daemon's layout of the new bytes
            views = fetch(state.client, [state.derived[name] for name in again])
    except DerivedLimit as exc:  # the host's policy: those modules are loaded privately below, as at a first load
        state.log.warning("expertd: the daemon makes no derived layout of generation %d for %d parameter(s) of this "
                          "engine, their modules are loaded privately: %s", new, len(again), exc)
        for name in again:
            del state.derived[name]
        views, again = [], []
    params = dict(model.named_parameters())
    for name, view in zip(again, views):
        params[name].data = view
    owners = state.owners(hit - set(again))
    bound, packed = reload_modules(model, state, owners) if owners else ([], [])
    release_replaced(model, state)
    took = time.perf_counter() - t0
    state.log.info("expertd: generation %d -> %d: %d checkpoint tensor(s) changed; %d expert parameter(s) remapped "
                   "in the derived layout, %d module(s) reloaded in %.2f s", old, new, len(changed), len(again),
                   len(owners), took)
    return {"generation": new, "changed": len(changed), "remapped": again, "modules": sorted(owners),
            "rebound": sorted(bound + packed), "seconds": took}


def follow_hook(model: nn.Module, args) -> None:
    """A forward pre-hook (option `follow`): before the first step after the daemon published a newer generation
    (the client learns it from its heartbeats and replies), refresh. Requests in flight go on with the new weights."""
    state = state_of(model)
    if state is not None and state.client.latest_generation > state.client.index().generation:
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
