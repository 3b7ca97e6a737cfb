"""An engine's expertd state, an object of ours kept beside the engine's model, never on it.

What a load recorded (the client holding the lease, which served tensors fed each parameter, every parameter as
loaded, the requests of the derived layouts bound) lives in an `EngineState`, found by the model in a
`weakref.WeakKeyDictionary`: the engine's model object gets no attribute of ours, and the state (with its lease)
goes when the model does. `Engine` is what an engine adapter (`expertd.client.engines.vllm`) tells this engine-
neutral machinery: its logger, how its kernels lay out experts, how a module's post-load step runs again.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from expertd.messages import GatherItem


class Engine:
    """An engine's own steps, as the neutral machinery calls them; the defaults know no kernel: experts keep the
    engine's private layout, a reloaded module gets no post-load step."""

    def __init__(self, log: logging.Logger):
        self.log = log  # the engine's own logger: its handlers print our lines beside the engine's

    def probe(self, module: nn.Module, shapes: dict[str, tuple[int, ...]], loaded: dict[str, tuple]
              ) -> dict[str, torch.Tensor]:
        """Gather indices (leaf name -> index into one expert) of the layout the post-load step of `module` gives
        the parameters `shapes` names (`loaded`: every parameter of the module as loaded, (shape, dtype)). Raises
        ValueError where the layout is not a gather."""
        raise ValueError(f"{type(module).__name__}: no post-load step known to probe")

    def post_load(self, module: nn.Module) -> None:
        """Run the post-load step of `module` again, as at a first load (after a reload of its parameters)."""

    def finish(self, model: nn.Module, done: list[nn.Module]) -> None:
        """The engine's post-load step for every module of `model` but `done`, whose parameters are bound already
        in the engine's runtime layout (mapped, not loaded): only what the engine keeps beside the weights is made."""


@dataclass(eq=False)
class EngineState:
    """What a load recorded for the engine's life: bindings, refreshes, accounting. Holds no reference to the
    model (it is the value of a weak mapping keyed by the model)."""

    client: object  # the ExpertClient whose lease the shared views belong to
    engine: Engine
    feeds: dict[str, set[str]] = field(default_factory=dict)  # parameter name -> checkpoint tensors that fed it
    params: dict[str, tuple[nn.Parameter, tuple, torch.dtype]] = field(default_factory=dict)  # as loaded
    derived: dict[str, GatherItem] = field(default_factory=dict)  # parameter -> the request of its derived layout
    memory: dict[str, int] = field(default_factory=dict)  # the engine's weight bytes by where they lie (binding)
    refused: list[str] = field(default_factory=list)  # parameters whose daemon-derived bytes differ from the engine's
    follow: bool = False  # refresh before a forward pass once the daemon published a newer generation
    # while mapping: a request -> the same request for the other layers of its kind, asked with it (one derivation
    # job on the daemon), and their views, bound only once the checked layer's bytes are found equal
    ahead: object = None
    fetched: dict = field(default_factory=dict)

    _views: dict = field(default_factory=dict, repr=False)  # the views of the generation the client reads

    def tensors(self) -> dict:
        """The client's checkpoint views (`ExpertClient.tensors`), made once per generation it reads."""
        return self._cached("tensors")

    def served(self) -> dict:
        """The client's served views (`ExpertClient.served_tensors`), made once per generation it reads."""
        return self._cached("served_tensors")

    def _cached(self, what: str) -> dict:
        index = self.client.index()
        if self._views.get("index") is not index:
            self._views = {"index": index}
        if what not in self._views:
            self._views[what] = getattr(self.client, what)()
        return self._views[what]

    @property
    def log(self) -> logging.Logger:
        return self.engine.log

    def owners(self, names) -> dict[str, list[str]]:
        """module name -> its loaded parameters' leaf names, for the modules owning `names`."""
        out: dict[str, list[str]] = {}
        for name in self.params:
            owner, _, leaf = name.rpartition(".")
            out.setdefault(owner, []).append(leaf)
        wanted = {name.rpartition(".")[0] for name in names}
        return {owner: leaves for owner, leaves in out.items() if owner in wanted}


_STATES: "weakref.WeakKeyDictionary[nn.Module, EngineState]" = weakref.WeakKeyDictionary()


def keep(model: nn.Module, state: EngineState) -> None:
    """Keep `state` for as long as `model` lives; its lease is released with the model."""
    _STATES[model] = state
    weakref.finalize(model, state.client.close)


def state_of(model: nn.Module) -> EngineState | None:
    """The state a load kept for `model` (None: not loaded from expertd, or without `zero_copy`)."""
    try:
        return _STATES.get(model)
    except TypeError:  # not weakly referenceable: nothing of ours
        return None
