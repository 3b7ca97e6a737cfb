"""`simulate`: formats inside the forward pass, on a model whose weights are read-only shared memory."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from expertd.client import ExpertClient
from expertd.tools import number_formats as F
from expertd.tools.capture import capture, close_env_captures
from expertd.tools.simulate import active_simulation, simulate
from helpers.inputs import INPUT_IDS

EXPERTS = "*mlp.experts*"


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits.float()


def by_hand(model, fmt: str, pattern: str) -> dict:
    """Round-tripped copies of the matching linear / expert weights, made with expertd.tools.number_formats directly."""
    import fnmatch

    out = {}
    for name, module in model.named_modules():
        if not fnmatch.fnmatchcase(name, pattern) \
                or not (isinstance(module, nn.Linear) or "experts" in name.rsplit(".", 1)[-1]):
            continue
        for pname, p in module.named_parameters(recurse=False):
            mats = [p[e] for e in range(p.shape[0])] if p.dim() == 3 else [p]
            q = torch.stack([F.FORMATS[fmt](m).reshape(m.shape).to(p.dtype) for m in mats])
            out[(module, pname)] = q if p.dim() == 3 else q[0]
    return out


@pytest.fixture
def served(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint)
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        yield client, client.load_model()


def test_weights_simulated_without_touching_shared_memory(served):
    client, model = served
    params = {n: p for n, p in model.named_parameters()}
    base = logits(model)
    with simulate(model, weights="mxfp4", modules=[EXPERTS]) as sim:
        assert active_simulation(model) is sim
        assert sim.names == {f"model.layers.{i}.mlp.experts" for i in (1, 2)}
        simulated = logits(model)
        assert torch.equal(logits(model), simulated)  # cached: the second forward sees the same weights
    assert all(p is params[n] for n, p in model.named_parameters())  # the very same shared views again
    assert client.verify() == []  # every checksum of shared memory still matches
    assert torch.equal(logits(model), base) and not torch.equal(simulated, base)

    # the same model with the round-tripped weights put in by hand gives the same logits
    manual = by_hand(model, "mxfp4_e2m1", EXPERTS)
    assert len(manual) == 4
    originals = {key: key[0]._parameters[key[1]] for key in manual}
    for (module, pname), q in manual.items():
        module._parameters[pname] = nn.Parameter(q, requires_grad=False)
    try:
        assert torch.equal(logits(model), simulated)
    finally:
        for (module, pname), p in originals.items():
            module._parameters[pname] = p


def test_activations_simulated_by_a_pre_hook():
    torch.manual_seed(0)
    layer = nn.Linear(40, 8)
    x = torch.randn(3, 40) * 10
    with simulate(layer, activations="hif8", modules=["*"]):
        pass  # the root module has no name: globs match submodules only
    model = nn.Sequential(layer)
    with simulate(model, activations="hif8"):
        y = model(x)
    assert torch.equal(y, layer(F.FORMATS["hif8"](x)))
    assert torch.equal(model(x), layer(x))
    with pytest.raises(ValueError, match="unknown format"):
        simulate(model, weights="fp3")


def test_environment_simulates_load_model_and_capture_records_it(served, tiny_checkpoint, start_daemon, monkeypatch,
                                                                 tmp_path):
    client, plain = served
    with simulate(plain, weights="mxfp4_e2m1", activations="hif8", modules=[EXPERTS]):
        want = logits(plain)
    monkeypatch.setenv("EXPERTD_SIMULATE_WEIGHTS", "mxfp4_e2m1")
    monkeypatch.setenv("EXPERTD_SIMULATE_ACTIVATIONS", "hif8")
    monkeypatch.setenv("EXPERTD_SIMULATE_MODULES", EXPERTS)
    monkeypatch.setenv("EXPERTD_CAPTURE_DIR", str(tmp_path / "cap"))
    monkeypatch.setenv("EXPERTD_CAPTURE_MODULES", "*.layers.1.mlp*")
    try:
        model = client.load_model()
        assert active_simulation(model).tag == "w-mxfp4_e2m1.a-hif8"
        assert torch.equal(logits(model), want)
    finally:
        close_env_captures()
        active_simulation(model).close()
    assert client.verify() == []
    folder = tmp_path / "cap" / f"pid{os.getpid()}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["simulation"] == {"weights": "mxfp4_e2m1", "activations": "hif8", "modules": [EXPERTS],
                                      "simulated": 2}
    names = os.listdir(folder)
    # experts: not hooked
    assert "000001_L01_mlp.experts_forward_input_sim-w-mxfp4_e2m1.a-hif8.safetensors" not in names
    assert "000001_L01_mlp.shared_experts.down_proj_forward_input.safetensors" in names  # not simulated: no tag


def test_capture_tags_simulated_linear_inputs(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 8))
    x = torch.randn(2, 40) * 3
    with simulate(model, activations="hif8"), capture(model, str(tmp_path), directions="forward"):
        model(x)
    saved = load_file(str(tmp_path / "000001_0_forward_input_sim-a-hif8.safetensors"))["args.0"]
    assert torch.equal(saved, F.FORMATS["hif8"](x))  # capture records what the module computed on
