"""Stacked experts in the engine's own layout, once per host: found with the engine's own steps, made by the daemon,
mapped by all.

An engine's MoE kernel may keep its experts padded and packed for the CPU's ISA (vLLM's CPU kernel), a layout that
does not depend on the values, and a model's loader may rearrange each expert as it loads it (gpt-oss's transposed,
interleaved gate/up). Both are found with probes (`probes`): the loader on one probe expert under the served name,
the engine's post-load step on a stand-in module (`Engine.probe`, the adapter's). The result is a gather index
(`expertd.derived`); the daemon gathers its served expert stack by it into a segment of the generation, once per
host; every engine checks that the daemon's bytes equal its own post-load result, then maps them instead. A layer
whose layout is not such a gather (or whose probe fails) keeps the engine's private copy, said in one log line.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from expertd import derived
from expertd.errors import DerivedLimit
from expertd.messages import GatherItem
from expertd.shm import same_bytes

from .probes import Positions, digit_count, digits
from .state import EngineState

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
REQUEST_BYTES = 768 << 10  # a derived tensor request's items, under the daemon's message cap


def _layer(name: str) -> str | None:
    found = LAYER.search(name)
    return found.group(1) if found else None


def expert_sources(model: nn.Module, served: dict[str, torch.Tensor], feeds: dict[str, set[str]] | None = None
                   ) -> dict[str, tuple[str, torch.Tensor | None]]:
    """Before the engine's post-load step: parameter name -> (served name, load index) for each stacked parameter (3 or
    more dimensions: experts) that is a served tensor of its layer as loaded (index None), or that the model's
    `load_weights` made from one served tensor (`feeds`) by a value-independent rearrangement within each expert
    (gpt-oss's transposed, interleaved gate/up): its gather index, found by loading probes (`load_layout`)."""
    by_layer: dict[tuple, list[str]] = {}
    for name, t in served.items():
        if t.dim() >= 3:
            by_layer.setdefault((_layer(name), tuple(t.shape), t.dtype), []).append(name)
    out = {}
    for name, param in model.named_parameters():
        if param.dim() < 3 or param.device.type != "cpu":
            continue
        for candidate in by_layer.get((_layer(name), tuple(param.shape), param.dtype), []):
            if same_bytes(param.data, served[candidate]):
                out[name] = (candidate, None)
                break
        else:
            fed = (feeds or {}).get(name) or set()
            feed = next(iter(fed)) if len(fed) == 1 else None
            source = served.get(feed) if feed is not None else None
            if source is not None and source.dtype == param.dtype and source.shape[0] == param.shape[0] \
                    and source.numel() == param.numel():
                index = load_layout(model, param, feed, source)
                if index is not None:
                    out[name] = (feed, index)
    return out


def load_layout(model: nn.Module, param: nn.Parameter, feed: str, source: torch.Tensor) -> torch.Tensor | None:
    """Where the model's `load_weights` puts each element of one expert of `source` in `param`'s expert (a gather
    index), found by loading probes under the served name `feed`; the loaded bytes are put back. None where the
    result is not such a rearrangement (checked again on the real bytes: `share_experts` compares)."""
    saved = param.data.clone()
    n = source[0].numel()
    found = Positions(padding=False)  # a load fills every element of the parameter
    try:
        for digit in range(digit_count(n)):
            probe_values = digits(torch.arange(n), digit, source.dtype).reshape(source[:1].shape)
            model.load_weights(iter([(feed, probe_values.expand(source.shape).contiguous())]))
            if found.add(param.data[0], digit) is not None:
                return None
    except (KeyError, AssertionError, RuntimeError, ValueError):
        return None
    finally:
        param.data.copy_(saved)
    index = found.result()
    return index if bool((index < n).all()) else None


def share_experts(model: nn.Module, state: EngineState, sources: dict, loaded: dict[str, dict]) -> list[str]:
    """After the engine's post-load step: map each expert parameter the engine repacked onto the daemon's derived
    tensor of it (`sources`: `expert_sources`' result; `loaded`: module name -> its parameters as loaded (shape,
    dtype)). Returns the parameter names bound; `state.derived` gets, for each, the request that makes it (a
    refresh asks again on the new generation)."""
    modules = dict(model.named_modules())
    names = {id(m): name for name, m in modules.items()}
    wanted = _expert_requests(modules, state, sources, loaded)
    views = fetch_refusable(state, [item for _, _, item in wanted], "expert")
    bound = []
    for (module, leaf, item), view in zip(wanted, views):
        param = getattr(module, leaf)
        if same_bytes(param.data, view):
            param.data = view
            bound.append(f"{names[id(module)]}.{leaf}")
            state.derived[bound[-1]] = item
        else:
            state.log.warning("expertd: the daemon's layout of %s differs from the engine's: kept private",
                              item.name)
            state.refused.append(f"{names[id(module)]}.{leaf}")
    return bound


def _expert_requests(modules: dict[str, nn.Module], state: EngineState, sources: dict, loaded: dict[str, dict]
                     ) -> list[tuple[nn.Module, str, GatherItem]]:
    """(module, leaf, the daemon's request of its derived layout) for each expert parameter of `sources` whose
    module's post-load layout the engine's probe finds (probed once per kind of module)."""
    by_module: dict[str, dict[str, tuple]] = {}
    for name, source in sources.items():
        owner, _, leaf = name.rpartition(".")
        by_module.setdefault(owner, {})[leaf] = source
    probed: dict[tuple, dict | None] = {}
    encoded: dict[bytes, tuple[bytes, int]] = {}
    wanted = []
    for owner, leaves in by_module.items():
        module = modules[owner]
        shapes = {leaf: loaded[owner][leaf][0] for leaf in leaves}
        key = tuple(sorted((leaf, shape, loaded[owner][leaf][1]) for leaf, shape in shapes.items()))
        if key not in probed:
            try:
                probed[key] = state.engine.probe(module, shapes, loaded[owner])
            except (ValueError, RuntimeError, TypeError, AttributeError) as exc:
                state.log.info("expertd: %s keeps the engine's private layout of its experts (%s)", owner, exc)
                probed[key] = None
        if probed[key] is None:
            continue
        for leaf, (served_name, at_load) in leaves.items():
            index = probed[key][leaf]
            if at_load is not None:  # the load's own rearrangement first, then the post-load step's
                index = torch.where(index >= 0, at_load[index.clamp(min=0)], index)
            raw = index.to(torch.int32).numpy().tobytes()
            if raw not in encoded:
                encoded[raw] = (derived.encode(index), index.numel())
            deflated, length = encoded[raw]
            wanted.append((module, leaf, derived.request(served_name, deflated, length,
                                                         tuple(getattr(module, leaf).shape))))
    return wanted


def fetch_refusable(state: EngineState, items: list[GatherItem], what: str) -> list[torch.Tensor]:
    """`fetch_ahead`, or [] where the daemon refuses to make them (DerivedLimit: a reader's share of derived bytes
    is the host's policy), said in one line: the parameters keep the engine's private copy."""
    try:
        return fetch_ahead(state, items)
    except DerivedLimit as exc:
        state.log.warning("expertd: the daemon makes no derived layout of %d %s parameter(s) for this engine, they "
                          "keep its private copy: %s", len(items), what, exc)
        return []


def fetch_ahead(state: EngineState, items: list[GatherItem]) -> list[torch.Tensor]:
    """The daemon's derived tensors `items` asks for, and with them what `state.ahead` names for each (kept in
    `state.fetched`, not bound: see `mapping`): one derivation job on the daemon for a model's experts. Where the
    daemon's limits refuse them together, `items` alone."""
    extra = [more for item in items for more in state.ahead(item)] if state.ahead else []
    try:
        views = fetch(state.client, items + extra, len(extra))
    except DerivedLimit:
        if not extra:
            raise
        views, extra = fetch(state.client, items), []
    state.fetched.update((item_key(item), view) for item, view in zip(extra, views[len(items):]))
    return views[:len(items)]


def item_key(item: GatherItem) -> tuple:
    return item.name, tuple(item.also or ()), tuple(item.shape), item.blocks, item.length, item.index


def fetch(client, items: list[GatherItem], trusted: int = 0) -> list[torch.Tensor]:
    """The daemon's derived tensors `items` asks for, in requests under the message cap; the last `trusted` not
    checksummed (`ExpertClient.derived`)."""
    views, left = [], len(items)
    for batch in _batches(items):
        left -= len(batch)
        views.extend(client.derived(batch, max(0, min(len(batch), trusted - left))))
    return views


def _batches(items: list[GatherItem]) -> list[list[GatherItem]]:
    out, size = [[]], 0
    for entry in items:
        nbytes = len(entry.index) + 512
        if out[-1] and size + nbytes > REQUEST_BYTES:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return [batch for batch in out if batch]
