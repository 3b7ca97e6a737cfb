"""Model hooks: functions `ExpertClient.load_model()` calls once with each model it returns, before returning it.

    from expertd.client.hooks import on_model_loaded

    @on_model_loaded
    def log_model(model):
        print(type(model).__name__)

A hook gets the model (eval mode, every weight a shared view) and returns nothing; what it raises, load_model
raises. Hooks come from three places, run in this order:

1. the tools' environment hook, `expertd.tools.env_hooks:from_env`, when `EXPERTD_CAPTURE_DIR`,
   `EXPERTD_SIMULATE_WEIGHTS` or `EXPERTD_SIMULATE_ACTIVATIONS` is set (activation capture, then simulated
   number formats, with no code changes; README "Tools around the weights");
2. `EXPERTD_MODEL_HOOKS`: comma-separated `module:function` names, imported at each load_model (for workers
   whose code you do not change, e.g. an engine's processes);
3. the functions registered in this process with `on_model_loaded(fn)` (removed with `remove_model_hook(fn)`).

The client imports `expertd.tools` (and anything a hook names) only when one of those variables asks for it.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

HOOKS_ENV = "EXPERTD_MODEL_HOOKS"
TOOLS_HOOK = "expertd.tools.env_hooks:from_env"
TOOLS_ENV = ("EXPERTD_CAPTURE_DIR", "EXPERTD_SIMULATE_WEIGHTS", "EXPERTD_SIMULATE_ACTIVATIONS")

ModelHook = Callable[[object], None]
_HOOKS: list[ModelHook] = []


def on_model_loaded(fn: ModelHook) -> ModelHook:
    """Call `fn(model)` on each model `load_model()` returns from now on (once, however often registered)."""
    if fn not in _HOOKS:
        _HOOKS.append(fn)
    return fn


def remove_model_hook(fn: ModelHook) -> None:
    """Stop calling `fn` (registered with `on_model_loaded`); no error if it is not registered."""
    if fn in _HOOKS:
        _HOOKS.remove(fn)


def env_hooks() -> list[str]:
    """The `module:function` names the environment asks for: the tools' hook, then `EXPERTD_MODEL_HOOKS`."""
    names = [TOOLS_HOOK] if any(os.environ.get(v) for v in TOOLS_ENV) else []
    return names + [n.strip() for n in os.environ.get(HOOKS_ENV, "").split(",") if n.strip()]


def resolve(name: str) -> ModelHook:
    """The function a `module:function` name names."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{HOOKS_ENV}: {name!r} is not module:function")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def run_model_hooks(model) -> None:
    """What load_model() does last: every hook, in the order above."""
    for fn in [*map(resolve, env_hooks()), *_HOOKS]:
        fn(model)
