"""Run a model as if its weights and/or activations were stored in a low-precision format.

    from expertd.tools.simulate import simulate

    with simulate(model, weights="mxfp4_e2m1", activations="hif8", modules=["*mlp.experts*"]):
        logits = model(ids).logits

Any format name of `expertd.tools.number_formats.FORMATS` (or an alias such as `mxfp4`) works. The simulated
modules are the `nn.Linear` layers and the fused MoE expert blocks (modules holding 3-D parameters
such as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], quantized one expert matrix at a time)
whose qualified names match one of the globs (default all); embeddings, norms and the router are
left alone.

Served weights are never written: a model from `ExpertClient.load_model()` holds read-only views
into shared memory. On entering, each simulated parameter's round trip is computed once into a
private tensor (the cache: no forward re-quantizes) and swapped into `module._parameters`; leaving
puts the very same parameter objects back (so leave the simulation before `client.refresh(model)`
rebinds new generations; quantized copies of fp8-per-tensor formats are rounded to the parameter's dtype).
Activations are quantized by a forward pre-hook on each
simulated module (the first tensor input: `x` of a linear, `hidden_states` of the experts; routing
weights and indices pass unchanged), prepended so that a capture hook records what the module
really computes on. Gradients pass through the activation round trip unchanged (straight-through).

With `EXPERTD_SIMULATE_WEIGHTS` and/or `EXPERTD_SIMULATE_ACTIVATIONS` set (and optionally
`EXPERTD_SIMULATE_MODULES`, comma-separated globs), `ExpertClient.load_model()` returns the model
already simulated, for the life of the process. While a simulation is active, a `capture` of the
model records it in its manifest and file names.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import weakref

import torch
from torch import nn

from .number_formats import resolve_format, round_trip

log = logging.getLogger("expertd.simulate")

_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, Simulation]" = weakref.WeakKeyDictionary()


def is_fused_experts(module: nn.Module) -> bool:
    """A block of stacked expert matrices (transformers' fused MoE `*.mlp.experts`)."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def simulated_modules(model: nn.Module, patterns) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer and fused expert block whose name matches one of `patterns`."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns or ["*"])
    return [(name, m) for name, m in model.named_modules()
            if name and (isinstance(m, nn.Linear) or is_fused_experts(m))
            and any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def quantize_weight(p: torch.Tensor, fmt: str) -> torch.Tensor:
    """A private copy of `p` after the round trip through `fmt`: a 3-D stack one matrix at a time."""
    with torch.no_grad():
        if p.dim() == 3:
            return torch.stack([round_trip(p[e], fmt) for e in range(p.shape[0])])
        return round_trip(p, fmt)


class _RoundTrip(torch.autograd.Function):
    """The round trip forward, the identity backward (straight-through), so training still gets gradients."""

    @staticmethod
    def forward(ctx, x, fmt):
        return round_trip(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Simulation:
    """Quantized weights swapped in and activation hooks installed while entered (re-enterable)."""

    def __init__(self, model: nn.Module, weights: str | None = None, activations: str | None = None, modules=None):
        if weights is None and activations is None:
            raise ValueError("simulate: give weights=FORMAT and/or activations=FORMAT")
        self.model = model
        self.weights = resolve_format(weights) if weights else None
        self.activations = resolve_format(activations) if activations else None
        self.patterns = [modules] if isinstance(modules, str) else list(modules or ["*"])
        self.modules = simulated_modules(model, self.patterns)
        self.names = {name for name, _ in self.modules}
        if not self.modules:
            log.warning("simulate: no linear or fused-expert module matches %s", self.patterns)
        self._cache: dict[tuple[int, str], torch.Tensor] = {}  # (id(module), parameter) -> quantized copy
        self._saved: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._handles = []

    @property
    def tag(self) -> str:
        """How file names show the simulation: 'w-mxfp4_e2m1.a-hif8'."""
        return ".".join(f"{k}-{v}" for k, v in (("w", self.weights), ("a", self.activations)) if v)

    def describe(self) -> dict:
        return {"weights": self.weights, "activations": self.activations, "modules": self.patterns,
                "simulated": len(self.modules)}

    def _quantized(self, module: nn.Module, name: str, p: torch.Tensor) -> nn.Parameter:
        key = (id(module), name)
        if key not in self._cache:
            self._cache[key] = quantize_weight(p, self.weights)
        return nn.Parameter(self._cache[key], requires_grad=False)

    def _pre_hook(self, module, args, kwargs):
        fmt = self.activations
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (_RoundTrip.apply(args[0], fmt),) + tuple(args[1:]), kwargs
        for key in ("hidden_states", "input"):
            t = kwargs.get(key)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return args, {**kwargs, key: _RoundTrip.apply(t, fmt)}
        return None

    def __enter__(self) -> "Simulation":
        if self.model in _ACTIVE:
            raise RuntimeError("simulate: this model is already simulated; leave that context first")
        try:
            for _, module in self.modules:
                if self.weights:
                    for name, p in list(module._parameters.items()):
                        if p is not None and p.is_floating_point() and p.dim() >= 2:
                            q = self._quantized(module, name, p)
                            self._saved.append((module, name, p))
                            module._parameters[name] = q
                if self.activations:
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True,
                                                                          prepend=True))
        except BaseException:
            self.__exit__()
            raise
        _ACTIVE[self.model] = self
        return self

    def __exit__(self, *exc) -> None:
        for module, name, p in reversed(self._saved):
            module._parameters[name] = p  # the same object: a shared-memory view again
        self._saved.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _ACTIVE.pop(self.model, None)

    close = __exit__


def simulate(model: nn.Module, weights: str | None = None, activations: str | None = None, modules=None) -> Simulation:
    """Simulate `weights` and/or `activations` formats on `model`'s matching modules; use with `with`."""
    return Simulation(model, weights=weights, activations=activations, modules=modules)


def active_simulation(model: nn.Module) -> Simulation | None:
    """The simulation entered on `model`, if any."""
    return _ACTIVE.get(model)


def simulate_from_env(model: nn.Module) -> Simulation | None:
    """Simulate for good when EXPERTD_SIMULATE_WEIGHTS / _ACTIVATIONS are set (used by `ExpertClient.load_model`)."""
    weights = os.environ.get("EXPERTD_SIMULATE_WEIGHTS") or None
    activations = os.environ.get("EXPERTD_SIMULATE_ACTIVATIONS") or None
    if weights is None and activations is None:
        return None
    modules = [p.strip() for p in os.environ.get("EXPERTD_SIMULATE_MODULES", "*").split(",") if p.strip()]
    sim = simulate(model, weights=weights, activations=activations, modules=modules).__enter__()
    log.info("simulating %s on %d modules", sim.tag, len(sim.modules))
    return sim


def simulation_info(model: nn.Module) -> dict | None:
    """What a capture's manifest records of the simulation active on `model`."""
    sim = _ACTIVE.get(model)
    return sim.describe() if sim is not None else None


def simulation_tag(model: nn.Module, name: str) -> str | None:
    """The simulation's tag when module `name` of `model` runs simulated, else None."""
    sim = _ACTIVE.get(model)
    return sim.tag if sim is not None and name in sim.names else None
