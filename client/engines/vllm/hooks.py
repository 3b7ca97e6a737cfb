"""vLLM's post-load steps, as the engine-neutral machinery (`expertd.client.engines`) calls them.

vLLM's CPU MoE kernel keeps its experts (`w13_weight`, `w2_weight`) padded and packed for the CPU's ISA
(`cpu_prepack_moe_weight`, run by its fused experts' `process_weights_after_loading`), a layout that does not depend
on the values: `probe` runs that step on a stand-in module holding probes (`expertd.client.engines.probes`) and
reads where each element went. `post_load` runs a reloaded module's own post-load step again after a refresh.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..probes import Positions, digit_count, digits
from ..state import Engine


def fused_experts(module: nn.Module):
    """The fused experts kernel of vLLM's FusedMoE `module` whose post-load step packs its experts, or None."""
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    return experts if experts is not None and hasattr(experts, "process_weights_after_loading") else None


class VllmEngine(Engine):
    """vLLM's kernels: the fused MoE's post-load packing, each quant method's post-load step."""

    def __init__(self, log, model_config=None, device=None):
        super().__init__(log)
        self.model_config, self.device = model_config, device

    def probe(self, module: nn.Module, shapes: dict[str, tuple[int, ...]], loaded: dict[str, tuple]
              ) -> dict[str, torch.Tensor]:
        experts = fused_experts(module)
        if experts is None:
            raise ValueError(f"{type(module).__name__} has no fused experts kernel with a post-load step")
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
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None  # vLLM's MoE post-load step packs for its kernel at a first load only
        method.process_weights_after_loading(module)

    def finish(self, model: nn.Module, done: list[nn.Module]) -> None:
        """vLLM's post-load step for the model under `weights_already_processed()` (its quant methods then only
        build their kernels' state: the MoE kernel is made for the bound, packed experts; dense layers still pack
        for oneDNN from what is bound), with the modules `done` (post-processed as at a first load) left out."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.utils import weights_already_processed

        hidden = [(module, module.__dict__["quant_method"]) for module in done if "quant_method" in module.__dict__]
        for module, _ in hidden:
            module.__dict__["quant_method"] = None
        try:
            with weights_already_processed():
                process_weights_after_loading(model, self.model_config, self.device)
        finally:
            for module, method in hidden:
                module.__dict__["quant_method"] = method
