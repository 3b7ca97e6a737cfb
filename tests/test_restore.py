"""restore(): binding views into user-built models, per-expert (transformers 4.x style) or fused (5.x)."""

import pytest
import torch
from torch import nn

from expertd.client import RestoreError, restore


class PerExpertMoE(nn.Module):
    """A transformers-4.x-style MoE block: one module per expert, names as in the checkpoint."""

    def __init__(self, experts=3, hidden=8, inter=4):
        super().__init__()
        self.experts = nn.ModuleList(
            nn.ModuleDict({"gate_proj": nn.Linear(hidden, inter, bias=False),
                           "up_proj": nn.Linear(hidden, inter, bias=False),
                           "down_proj": nn.Linear(inter, hidden, bias=False)})
            for _ in range(experts)
        )
        self.register_buffer("bias", torch.zeros(experts))


def fused_storage_views(experts=3, hidden=8, inter=4):
    """Per-expert views laid out back to back in one buffer, as the daemon serves them."""
    block = torch.arange(experts * 2 * inter * hidden, dtype=torch.float32).view(experts, 2 * inter, hidden)
    views = {}
    for e in range(experts):
        views[f"experts.{e}.gate_proj.weight"] = block[e, :inter]
        views[f"experts.{e}.up_proj.weight"] = block[e, inter:]
    down = torch.randn(experts, hidden, inter)
    for e in range(experts):
        views[f"experts.{e}.down_proj.weight"] = down[e]
    views["bias"] = torch.ones(experts)
    return views, block, down


def test_per_expert_model_binds_without_copy():
    model = PerExpertMoE()
    views, block, _ = fused_storage_views()
    result = restore(model, views)
    assert result.missing == [] and result.unexpected == []
    assert model.experts[1].up_proj.weight.data_ptr() == views["experts.1.up_proj.weight"].data_ptr()
    assert model.bias.data_ptr() == views["bias"].data_ptr()
    assert not model.experts[0].gate_proj.weight.requires_grad


def test_missing_and_unexpected_names():
    model = PerExpertMoE()
    views, _, _ = fused_storage_views()
    del views["experts.2.down_proj.weight"]
    views["extra.weight"] = torch.zeros(1)
    with pytest.raises(RestoreError, match="experts.2.down_proj.weight"):
        restore(model, dict(views))
    result = restore(PerExpertMoE(), views, strict=False)
    assert result.missing == ["experts.2.down_proj.weight"] and result.unexpected == ["extra.weight"]


def test_shape_and_dtype_mismatch_name_the_parameter():
    views, _, _ = fused_storage_views()
    bad = dict(views, **{"experts.1.gate_proj.weight": torch.zeros(5, 8)})
    with pytest.raises(RestoreError, match=r"shape \[5, 8\].*'experts.1.gate_proj.weight'.*\[4, 8\]"):
        restore(PerExpertMoE(), bad)
    bad = dict(views, **{"experts.1.gate_proj.weight": torch.zeros(4, 8, dtype=torch.float16)})
    with pytest.raises(RestoreError, match="dtype torch.float16.*'experts.1.gate_proj.weight'"):
        restore(PerExpertMoE(), bad)


def _tiny_v3_model():
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from expertd.hf import model_config
    from expertd.tools.generate import make_config

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(model_config(make_config("tiny")), dtype=torch.bfloat16)


def test_fused_model_rebuilds_expert_blocks_from_per_expert_views(tiny_checkpoint):
    from helpers.reference import reference_tensors

    views = reference_tensors(tiny_checkpoint)
    # lay each layer's experts back to back, as the daemon does
    for layer in (1, 2):
        for kind, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for e in range(8) for p in parts]
            block = torch.cat([views[n].reshape(-1) for n in names])
            step = views[names[0]].numel()
            for k, n in enumerate(names):
                views[n] = block[k * step:(k + 1) * step].view(views[n].shape)
    model = _tiny_v3_model()
    for name, held in model.state_dict().items():  # routers and biases in the dtype this release builds them in
        if name in views and views[name].dtype != held.dtype:
            views[name] = views[name].to(held.dtype)
    result = restore(model, views)
    assert result.missing == [] and result.unexpected == []
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    assert fused.shape == (8, 400, 320)
    assert fused.data_ptr() == views["model.layers.1.mlp.experts.0.gate_proj.weight"].data_ptr()
    assert torch.equal(fused[3, 200:], views["model.layers.1.mlp.experts.3.up_proj.weight"])


def test_fused_model_refuses_scattered_experts(tiny_checkpoint):
    from helpers.reference import reference_tensors

    views = reference_tensors(tiny_checkpoint)  # each expert its own allocation
    with pytest.raises(RestoreError, match="back to back"):
        restore(_tiny_v3_model(), views)


def test_fused_model_refuses_parts_of_the_wrong_shape(tiny_checkpoint):
    from helpers.reference import reference_tensors

    views = reference_tensors(tiny_checkpoint)
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight"
    views[gate] = views[gate][:100]
    with pytest.raises(RestoreError, match=r"experts.0.gate_proj.weight' of shape \[100, 320\] cannot be part of"):
        restore(_tiny_v3_model(), views)
