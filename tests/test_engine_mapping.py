"""The engine-neutral map's dry run (`expertd.client.engines.mapping.dry_feeds`) on a model with a vLLM-style
`load_weights` (parameters with a `weight_loader`): it feeds the model's own loader the first layer of each served
kind and the tensors outside layers, renames the first layer's feeds for the others, and runs over every tensor where
a layer's parameters are not its first's renamed, or where the loader wants every layer's tensors. vLLM's own models
go through it in tests/test_vllm.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from expertd.client.engines.mapping import dry_feeds, served_kinds
from expertd.client.engines.state import Engine, EngineState


class Layer(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(6, 4))  # q and k fused, as vLLM fuses projections
        self.qkv.weight_loader = self.load_qkv
        if bias:
            self.extra = nn.Parameter(torch.zeros(4))
            self.extra.weight_loader = lambda param, t: param.data.copy_(t)

    @staticmethod
    def load_qkv(param, t, shard):
        (param.data[:3] if shard == "q" else param.data[3:]).copy_(t)


class Toy(nn.Module):
    """vLLM's shape of a model: `load_weights` routes checkpoint names to parameters and returns what it loaded."""

    def __init__(self, layers: int = 3, odd: int | None = None, wants_all: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(bias=k == odd) for k in range(layers))
        self.norm = nn.Parameter(torch.zeros(4))
        self.wants_all, self.seen = wants_all, []

    def load_weights(self, weights) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for name, t in weights:
            self.seen.append(name)
            if name.endswith(("q.weight", "k.weight")):
                target = name.rsplit(".", 2)[0] + ".qkv"
                params[target].weight_loader(params[target], t, name.rsplit(".", 2)[1])
            elif name.endswith(".extra.weight"):
                target = name[: -len(".weight")]
                params[target].weight_loader(params[target], t)
            else:
                target = name
                params[target].data.copy_(t)
            loaded.add(target)
        assert not self.wants_all or {n.split(".")[1] for n in self.seen if n.startswith("layers.")} == {
            str(k) for k in range(len(self.layers))}, "every layer's tensors"
        return loaded


def served(layers: int = 3, odd: int | None = None) -> dict[str, torch.Tensor]:
    out = {"norm": torch.ones(4)}
    for k in range(layers):
        out[f"layers.{k}.q.weight"] = torch.ones(3, 4)
        out[f"layers.{k}.k.weight"] = torch.ones(3, 4)
        if k == odd:
            out[f"layers.{k}.extra.weight"] = torch.ones(4)
    return out


def state() -> EngineState:
    return EngineState(None, Engine(logging.getLogger("test")))


def test_only_the_first_layer_of_a_kind_is_fed_the_others_feeds_are_its_own_renamed():
    model, s, tensors = Toy(), state(), served()
    assert served_kinds(tensors) == {0: None, 1: 0, 2: 0}
    loaded = dry_feeds(model, s, tensors, "ipc:///x", "folder")
    assert sorted(model.seen) == ["layers.0.k.weight", "layers.0.q.weight", "norm"]  # layers 1 and 2 not fed
    assert loaded == {name for name, _ in model.named_parameters()}
    assert s.feeds["layers.2.qkv"] == {"layers.2.q.weight", "layers.2.k.weight"} and s.feeds["norm"] == {"norm"}
    assert all(p.device.type == "cpu" for p, _, _ in s.params.values())  # the real parameters, not the meta twins


@pytest.mark.parametrize("case", ["a layer's parameters differ", "the loader wants every layer"])
def test_where_layers_differ_or_the_loader_wants_them_all_every_tensor_is_fed(case):
    """Served kinds alike but layer 2's module has a parameter layer 0's lacks (fed by nothing): the renaming is
    refused and every tensor fed; a loader that refuses to run without every layer: every tensor fed."""
    model = Toy(odd=2) if case.startswith("a layer") else Toy(wants_all=True)
    s, tensors = state(), served()
    if case.startswith("a layer"):
        tensors.pop("layers.2.extra.weight", None)  # the same served kind as layer 0: the model is what differs
    loaded = dry_feeds(model, s, tensors, "ipc:///x", "folder")
    assert set(tensors) <= set(model.seen) and s.feeds["layers.2.qkv"] == {"layers.2.q.weight", "layers.2.k.weight"}
    unfed = {"layers.2.extra"} if case.startswith("a layer") else set()
    assert loaded == {name for name, _ in model.named_parameters()} - unfed


def test_layers_served_differently_are_each_their_own_first():
    tensors = served(odd=1)
    assert served_kinds(tensors) == {0: None, 1: None, 2: 0}
    model, s = Toy(odd=1), state()
    loaded = dry_feeds(model, s, tensors, "ipc:///x", "folder")
    assert "layers.2.q.weight" not in model.seen and "layers.1.extra.weight" in model.seen
    assert loaded == {name for name, _ in model.named_parameters()} and s.feeds["layers.1.extra"] == {
        "layers.1.extra.weight"}
