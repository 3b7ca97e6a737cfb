"""An engine that maps instead of loads: one real layer per kind loaded and checked, the others bound as-is.

vLLM's own load writes every weight into the engine's private parameters and then repacks them. An engine whose
daemon serves the weights needs neither for most of them: what the engine uses as served, and what it derives by a
value-independent rearrangement (the experts' packed layout, fused q/k/v), is already in shared memory or made
there once per host. So the load goes:

1. `dry_feeds`: the model's own `load_weights` runs into meta twins of the parameters (nothing read or written) over
   the served tensors of the first layer of each served kind and those outside layers: which served tensors feed
   each parameter, and that every parameter is fed (the other layers' feeds: their first's, renamed).
2. `plan`: layers whose parameters and feeds have the same names (up to the layer number), shapes and dtypes are
   of one kind; the first layer of each kind and the parameters outside layers are loaded for real, run through
   the engine's own post-load step and bound as a first engine binds them, every derived tensor checked byte for
   byte against the engine's own result (`share`). A mismatch (a post-load step that is not a pure rearrangement)
   refuses the whole map: the loader falls back to the private load, naming the parameter.
3. Every other layer's module takes its representative's bindings with the layer number changed: the served
   tensor of the same name, or the same derivation request on its own sources (named by a digest of the request
   and the sources' checksums: no other bytes can stand under that name). A module whose representative kept a
   private or kernel-packed copy (oneDNN's dense layers) is loaded from shared memory and post-processed as today.
4. `Engine.finish` runs the engine's post-load step for the mapped modules as for weights already processed.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from expertd.errors import DerivedLimit, ModelMismatch
from expertd.shm import same_bytes

from .experts import expert_sources, fetch, item_key
from .following import recording, share
from .state import EngineState

LAYER = re.compile(r"(?<![^.])layers\.(\d+)\.")


class NotMappable(Exception):
    """The engine cannot map this model; the message says which parameter and why (the loader loads privately)."""


def layer_of(name: str) -> int | None:
    found = LAYER.search(name)
    return int(found.group(1)) if found else None


def in_layer(name: str, number: int) -> str:
    """`name` with its layer number changed to `number`."""
    return LAYER.sub(f"layers.{number}.", name, count=1)


@contextmanager
def on_meta(model: nn.Module):
    """Every parameter of `model` replaced by a twin on the meta device (same class, shape, dtype and attributes:
    its weight loader): loaders write nowhere. The real parameters are back in their modules afterwards."""
    swapped, twins = [], {}
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            twin = twins.get(id(param))  # a parameter two modules hold (gpt-oss's sinks) gets one twin
            if twin is None:
                twin = nn.Parameter.__new__(type(param), torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                            False)
                twin.__dict__.update(param.__dict__)
                twins[id(param)] = twin
            module._parameters[leaf] = twin
            swapped.append((module, leaf, param))
    try:
        yield
    finally:
        for module, leaf, param in swapped:
            module._parameters[leaf] = param


def dry_feeds(model: nn.Module, state: EngineState, tensors: dict, endpoint: str, folder: str) -> set | None:
    """Record which served tensors feed each parameter (`state.feeds`) and every parameter as built
    (`state.params`), by the model's own `load_weights` into meta twins; what it returned as loaded.

    It runs over the tensors outside layers and those of the first layer of each kind of served layer (the same
    tensor names up to the layer number, shapes and dtypes: `served_kinds`); every other layer's feeds are its
    first's, renamed, where its parameters are the first's renamed with the same shapes and dtypes. Where one is not
    (a model whose layers of one served kind differ), it runs over every served tensor."""
    real = dict(model.named_parameters())
    firsts = served_kinds(tensors)
    fed = {n: t for n, t in tensors.items() if layer_of(n) is None or firsts.get(layer_of(n)) is None}
    renamed = False, None
    if len(fed) < len(tensors):
        try:
            renamed = _renamed_feeds(state, firsts, _dry_run(model, state, fed, endpoint, folder))
        except (ModelMismatch, NotMappable):  # a load_weights that wants every layer's tensors: given them below
            pass
    done, loaded = renamed
    if not done:
        state.feeds.clear()
        loaded = _dry_run(model, state, tensors, endpoint, folder)
    for name, (_, shape, dtype) in list(state.params.items()):
        state.params[name] = (real[name], shape, dtype)
    return loaded


def served_kinds(tensors: dict) -> dict[int, int | None]:
    """layer -> the first layer whose served tensors have the same names (up to the layer number), shapes and
    dtypes (None for that first layer itself)."""
    kinds: dict[int, list] = {}
    for name, t in tensors.items():
        number = layer_of(name)
        if number is not None:
            kinds.setdefault(number, []).append((LAYER.sub("layers.#.", name), tuple(t.shape), t.dtype))
    first: dict[tuple, int] = {}
    out: dict[int, int | None] = {}
    for number in sorted(kinds):
        rep = first.setdefault(tuple(sorted(kinds[number], key=lambda k: k[0])), number)
        out[number] = None if rep == number else rep
    return out


def _dry_run(model: nn.Module, state: EngineState, tensors: dict, endpoint: str, folder: str) -> set | None:
    with on_meta(model):
        with recording(model, state) as tagged:
            try:
                return model.load_weights(tagged(iter(tensors.items())))
            except (KeyError, AssertionError) as exc:  # as the private load says it
                raise ModelMismatch(f"the daemon at {endpoint} serves tensors that {folder}'s model "
                                    f"({type(model).__name__}) cannot take: {type(exc).__name__}: {exc}") from exc
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
                raise NotMappable(f"its load_weights does not run on meta parameters ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from exc


def _renamed_feeds(state: EngineState, firsts: dict[int, int | None], loaded: set | None) -> tuple[bool, set | None]:
    """Each layer's feeds as its first's renamed (`dry_feeds`): (True, what was loaded so), or (False, None) where a
    layer's parameters are not its first's renamed, with the same shapes and dtypes."""
    by_layer: dict[int, list[str]] = {}
    for name in state.params:
        by_layer.setdefault(layer_of(name), []).append(name)
    out = set(loaded) if loaded is not None else None
    for number, rep in firsts.items():
        if rep is None:
            continue
        mine = by_layer.get(number, [])
        if sorted(in_layer(n, rep) for n in mine) != sorted(by_layer.get(rep, [])):
            return False, None
        for name in mine:
            theirs = in_layer(name, rep)
            if state.params[name][1:] != state.params[theirs][1:]:
                return False, None
            state.feeds[name] = {in_layer(f, number) for f in state.feeds.get(theirs, ())}
            if out is not None and theirs in out:
                out.add(name)
    return True, out


def kind(state: EngineState, names: list[str]) -> tuple:
    """What makes layers interchangeable: their parameters' names, shapes and dtypes and their feeds' names, up to
    the layer number."""
    out = []
    for name in names:
        _, shape, dtype = state.params[name]
        feeds = tuple(sorted(LAYER.sub("layers.#.", f) for f in state.feeds.get(name, ())))
        out.append((LAYER.sub("layers.#.", name), shape, str(dtype), feeds))
    return tuple(sorted(out))


@dataclass
class Plan:
    """Which parameters are loaded for real (`private`: outside layers, and the representatives), and for every
    other layer its representative."""

    private: list[str] = field(default_factory=list)
    of: dict[int, int] = field(default_factory=dict)  # layer -> its representative layer
    layers: dict[int, list[str]] = field(default_factory=dict)  # layer -> its parameters


def plan(state: EngineState) -> Plan:
    out = Plan()
    for name in state.params:
        number = layer_of(name)
        if number is None:
            out.private.append(name)
        else:
            out.layers.setdefault(number, []).append(name)
    first: dict[tuple, int] = {}
    for number in sorted(out.layers):
        rep = first.setdefault(kind(state, out.layers[number]), number)
        if rep == number:
            out.private += out.layers[number]
        else:
            out.of[number] = rep
    return out


def load_private(model: nn.Module, state: EngineState, names: list[str], tensors: dict) -> dict:
    """Load the parameters `names` for real through the model's own `load_weights` (their feeds only; for a
    parameter whose loader wrote past the recording, every served tensor of its layer), before the post-load step;
    the experts' sources (`expert_sources`) among them."""
    from .following import _Only

    feeding = set()
    for name in names:
        fed = state.feeds.get(name, set()) & tensors.keys()
        feeding |= fed or {f for f in tensors if layer_of(f) == layer_of(name)}
    model.load_weights(iter([(f, tensors[f]) for f in sorted(feeding)]))
    found = discover(model, state, names, tensors)
    for name, feed in found.items():  # the same tensor feeds the same parameter of every other layer of its kind
        for other in state.params:
            if LAYER.sub("layers.#.", other) == LAYER.sub("layers.#.", name) and other != name and \
                    not state.feeds.get(other, set()) & tensors.keys():
                state.feeds[other] = {in_layer(feed, layer_of(other))} if layer_of(other) is not None else {feed}
    return expert_sources(_Only(model, names), state.served(), state.feeds)


def discover(model: nn.Module, state: EngineState, names: list[str], tensors: dict) -> dict[str, str]:
    """For each loaded parameter of `names` whose loader wrote it past the recording (`param.data.copy_`: gpt-oss's
    sinks), the one served tensor of its layer holding the same bytes, recorded as what feeds it."""
    params, found = dict(model.named_parameters()), {}
    for name in names:
        if state.feeds.get(name, set()) & tensors.keys():
            continue
        param = params[name]
        same = [f for f, t in tensors.items() if layer_of(f) == layer_of(name) and t.dtype == param.dtype
                and t.numel() == param.numel() and same_bytes(t.reshape(-1), param.data.reshape(-1))]
        if len(same) == 1:
            state.feeds[name] = {same[0]}
            found[name] = same[0]
    return found


def post_load(model: nn.Module, state: EngineState, names: list[str]) -> list[nn.Module]:
    """The engine's post-load step on the modules owning `names`, as at a first load; those modules."""
    modules = dict(model.named_modules())
    done = []
    for owner in state.owners(names):
        state.engine.post_load(modules[owner])
        done.append(modules[owner])
    return done


def bindings(model: nn.Module, state: EngineState, names: list[str]) -> dict[str, tuple[str, object]]:
    """How each parameter of `names` ended up after `share`: ("served", served name), ("derived", its request),
    ("kernel", None) where a kernel emptied it for its own packed copy, ("private", None) otherwise."""
    params, served = dict(model.named_parameters()), state.tensors()
    out = {}
    for name in names:
        param = params[name]
        fed = state.feeds.get(name) or ()
        source = name if name in served else next(iter(fed)) if len(fed) == 1 else None
        if name in state.derived:
            out[name] = ("derived", state.derived[name])
        elif source in served and served[source].data_ptr() == param.data_ptr() and param.numel():
            out[name] = ("served", source)
        else:
            out[name] = ("kernel" if param.numel() == 0 else "private", None)
    return out


def translate(how: tuple[str, object], number: int):
    """A representative's binding for layer `number`: the served tensor or the derivation request of its layer."""
    what, value = how
    if what == "served":
        return what, in_layer(value, number)
    also = value.also and [in_layer(name, number) for name in value.also]  # ABSENT stays as it is
    return what, dataclasses.replace(value, name=in_layer(value.name, number), also=also)


def mapped_modules(state: EngineState, layout: Plan, how: dict, served: dict) -> dict[str, tuple]:
    """parameter -> its translated binding, for every module of a non-representative layer whose representative
    module is bound whole (each parameter served or derived) and whose feeds are the representative's, renamed."""
    out = {}
    for number, rep in layout.of.items():
        for owner, leaves in state.owners(layout.layers[number]).items():
            rep_owner = in_layer(owner + ".", rep)[:-1]
            names = [f"{owner}.{leaf}" for leaf in leaves]
            reps = [f"{rep_owner}.{leaf}" for leaf in leaves]
            if any(how.get(r, ("private",))[0] not in ("served", "derived") for r in reps):
                continue
            moved = {n: translate(how[r], number) for n, r in zip(names, reps)}
            if all(state.feeds.get(n, set()) == {in_layer(f, number) for f in state.feeds.get(r, ())}
                   and (moved[n][0] != "served" or _fits(served.get(moved[n][1]), state.params[n]))
                   for n, r in zip(names, reps)):
                out.update(moved)
    return out


def _fits(view: torch.Tensor | None, built: tuple) -> bool:
    return view is not None and tuple(view.shape) == built[1] and view.dtype == built[2]


def map_model(model: nn.Module, state: EngineState, tensors: dict) -> None:
    """The map (see the module's docstring), after `dry_feeds`. Where a representative's derived bytes differ from
    the engine's own post-load result, every layer is loaded privately as without a map (one log line names the
    parameter)."""
    layout = plan(state)
    state.ahead = lambda item: _ahead(layout, item)  # the other layers' derivations made with the checked ones'
    done = _private_round(model, state, layout.private, tensors)
    state.ahead = None
    wrong = [name for name in layout.private if name in state.refused]
    moved = {}
    if wrong:
        state.log.warning("expertd: %s: vLLM's post-load result differs from the daemon's derived bytes of it: this "
                          "model is loaded privately (not mapped)", wrong[0])
    else:
        moved = mapped_modules(state, layout, bindings(model, state, layout.private), state.tensors())
    moved = _fetch_moved(state, moved)
    rest = [name for number in layout.of for name in layout.layers[number] if name not in moved]
    done += _private_round(model, state, rest, tensors)
    params, served = dict(model.named_parameters()), state.tensors()
    for name, (what, item) in moved.items():
        if what == "derived":
            params[name].data = state.fetched[item_key(item)]  # its shape is the request's (checked by the client)
            state.derived[name] = item
        else:
            params[name].data = served[item]
    state.fetched = {}
    state.engine.finish(model, done)
    kept = sorted({LAYER.sub("layers.#.", owner) for owner in state.owners(rest)})
    state.log.info("expertd: %d of %d layer(s) mapped on %d checked one(s): %d parameter(s) bound as the checked "
                   "layer's; loaded privately: the checked layers, what lies outside layers%s", len({layer_of(n) for n
                   in moved}), len(layout.layers), len(layout.layers) - len(layout.of), len(moved),
                   f" and in every layer {', '.join(kept)} (vLLM keeps its own copy)" if kept else "")


def _fetch_moved(state: EngineState, moved: dict[str, tuple]) -> dict[str, tuple]:
    """`moved` once the derived tensors it binds are fetched (those the checked layers' requests did not bring
    already); where the daemon refuses to make them (DerivedLimit), without the modules they belong to, which are
    then loaded privately (said in one line)."""
    asked = [(name, item) for name, (what, item) in moved.items()
             if what == "derived" and item_key(item) not in state.fetched]
    try:
        views = fetch(state.client, [item for _, item in asked])
    except DerivedLimit as exc:
        dropped = set(state.owners([name for name, _ in asked]))
        state.log.warning("expertd: the daemon makes no derived layout of %d module(s) for this engine, they are "
                          "loaded privately: %s", len(dropped), exc)
        return {name: how for name, how in moved.items() if name.rpartition(".")[0] not in dropped}
    state.fetched.update((item_key(item), view) for (_, item), view in zip(asked, views))
    return moved


def _ahead(layout: Plan, item) -> list:
    """The derivation request `item` (of a checked layer) for every other layer of its kind."""
    number = layer_of(item.name)
    return [translate(("derived", item), other)[1] for other, rep in layout.of.items() if rep == number]


def bound(model: nn.Module, state: EngineState) -> tuple[list[str], list[str]]:
    """(parameters bound as served, bound derived), for the engine's accounting."""
    how = bindings(model, state, [name for name, _ in model.named_parameters() if name in state.params])
    return [n for n, (w, _) in how.items() if w == "served"], [n for n, (w, _) in how.items() if w == "derived"]


def _private_round(model: nn.Module, state: EngineState, names: list[str], tensors: dict) -> list[nn.Module]:
    """Load `names` privately, run their modules' post-load step and bind what equals the daemon's (checked)."""
    if not names:
        return []
    sources = load_private(model, state, names, tensors)
    done = post_load(model, state, names)
    shapes = {owner: {leaf: state.params[f"{owner}.{leaf}"][1:] for leaf in leaves}
              for owner, leaves in state.owners(sources).items()}
    share(model, state, sources, shapes, set(names))
    return done
