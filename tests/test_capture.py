"""Activation capture: forward and backward tensors of linear and attention modules, on real models."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from expertd.client import ExpertClient
from expertd.hf import model_config
from expertd.tools.capture import MANIFEST, capture, close_env_captures
from expertd.tools.capture_manifest import read_manifest
from expertd.tools.generate import make_config
from helpers.inputs import INPUT_IDS


@pytest.fixture(scope="module")
def model():
    """A tiny DeepSeek-V3 in float32 with trainable random weights (transformers' own modules)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(make_config("tiny")), dtype=torch.float32)


def step(model, ids=INPUT_IDS):
    model.zero_grad(set_to_none=True)
    ids = torch.tensor(ids)
    model(ids, labels=ids).loss.backward()


def load(folder, name):
    return load_file(os.path.join(folder, name))


def test_forward_and_backward_of_linear_and_attention_modules(model, tmp_path):
    out = str(tmp_path / "cap")
    with capture(model, out) as cap:
        step(model)
    files = set(os.listdir(out))
    for layer in range(3):
        for module in ("self_attn", "self_attn.q_a_proj", "self_attn.o_proj"):
            for kind in ("forward_input", "forward_output", "backward_grad_input", "backward_grad_output"):
                assert f"000001_L{layer:02d}_{module}_{kind}.safetensors" in files
    assert "000001_lm_head_backward_grad_output.safetensors" in files
    assert "000001_L00_mlp.gate_proj_forward_output.safetensors" in files  # dense MLP
    assert "000001_L01_mlp.shared_experts.down_proj_backward_grad_input.safetensors" in files

    manifest = read_manifest(out)
    assert manifest["format"] == "expertd-capture" and manifest["steps"] == 1
    assert {f["file"] for f in manifest["files"]} | {MANIFEST} == files
    entry = next(f for f in manifest["files"] if f["file"] == "000001_L01_self_attn_forward_input.safetensors")
    assert entry["module"] == "model.layers.1.self_attn" and entry["kind"] == "attention"
    assert entry["module_type"] == "DeepseekV3Attention" and entry["tensors"]["hidden_states"]["shape"] == [1, 12, 320]
    with safe_open(os.path.join(out, entry["file"]), framework="pt") as f:
        assert f.metadata()["module"] == '"model.layers.1.self_attn"'  # files describe themselves
    assert cap.nbytes == sum(f["nbytes"] for f in manifest["files"])

    # the tensors are the module's own: y = x W^T forward, dx = dy W backward
    q_a = model.model.layers[1].self_attn.q_a_proj
    x = load(out, "000001_L01_self_attn.q_a_proj_forward_input.safetensors")["args.0"]
    y = load(out, "000001_L01_self_attn.q_a_proj_forward_output.safetensors")["output"]
    assert torch.allclose(y, torch.nn.functional.linear(x, q_a.weight), atol=1e-6)
    dy = load(out, "000001_L01_self_attn.q_a_proj_backward_grad_output.safetensors")["output"]
    dx = load(out, "000001_L01_self_attn.q_a_proj_backward_grad_input.safetensors")["args.0"]
    assert torch.allclose(dx, dy @ q_a.weight, atol=1e-7)
    # the attention's grad-input is its own (what reaches q_a_proj and kv_a_proj_with_mqa inside it), not the
    # residual stream's total gradient, although transformers passes hidden_states as a keyword argument
    attn_dx = load(out, "000001_L01_self_attn_backward_grad_input.safetensors")["hidden_states"]
    kv_dx = load(out, "000001_L01_self_attn.kv_a_proj_with_mqa_backward_grad_input.safetensors")["args.0"]
    assert torch.allclose(attn_dx, dx + kv_dx, atol=1e-7)
    attn_y = load(out, "000001_L01_self_attn_forward_output.safetensors")["output.0"]
    o_y = load(out, "000001_L01_self_attn.o_proj_forward_output.safetensors")["output"]
    assert torch.equal(attn_y, o_y)
    # hooks are gone afterwards
    step(model)
    assert set(os.listdir(out)) == files


def test_module_step_direction_and_byte_budget_filters(model, tmp_path):
    out = str(tmp_path / "cap")
    with capture(model, out, modules=["*.layers.2.self_attn"], steps="2", directions=["forward"]) as cap:
        step(model)
        step(model)
        step(model)
    assert cap.hooked == ["model.layers.2.self_attn"]
    assert sorted(os.listdir(out)) == ["000002_L02_self_attn_forward_input.safetensors",
                                       "000002_L02_self_attn_forward_output.safetensors", MANIFEST]

    budget = str(tmp_path / "budget")
    with capture(model, budget, modules="*.o_proj", directions="backward", max_bytes=40_000) as cap:
        step(model)
    with open(os.path.join(budget, MANIFEST)) as f:
        manifest = json.load(f)
    assert 0 < manifest["nbytes"] <= 40_000 and manifest["skipped"] > 0
    assert {f["direction"] for f in manifest["files"]} == {"backward"}
    assert len([n for n in os.listdir(budget) if n.endswith(".safetensors")]) == len(manifest["files"])

    with pytest.raises(ValueError, match="sideways"):
        capture(model, str(tmp_path / "bad"), directions=["sideways"])


def test_environment_turns_capture_on_for_load_model(tiny_checkpoint, start_daemon, tmp_path, monkeypatch):
    daemon = start_daemon(tiny_checkpoint)
    root = tmp_path / "env"
    monkeypatch.setenv("EXPERTD_CAPTURE_DIR", str(root))
    monkeypatch.setenv("EXPERTD_CAPTURE_MODULES", "*.layers.1.self_attn,*.layers.1.self_attn.o_proj")
    monkeypatch.setenv("EXPERTD_CAPTURE_STEPS", "1-2")
    try:
        with ExpertClient(daemon.endpoint) as client:
            model = client.load_model()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.tensor(INPUT_IDS))
    finally:
        close_env_captures()
    folder = root / f"pid{os.getpid()}"
    names = sorted(os.listdir(folder))
    assert "000002_L01_self_attn_forward_output.safetensors" in names
    assert "000001_L01_self_attn.o_proj_forward_input.safetensors" in names
    assert not [n for n in names if n.startswith("000003") or "backward" in n]  # step 3 and no_grad: nothing
    manifest = read_manifest(str(folder))
    assert len(manifest["files"]) == 8 and manifest["model"] == "DeepseekV3ForCausalLM"
    out = load(str(folder), "000001_L01_self_attn_forward_output.safetensors")["output.0"]
    assert out.dtype == torch.bfloat16 and out.shape == (1, len(INPUT_IDS[0]), 320)
