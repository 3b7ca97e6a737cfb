"""`expertd doctor`: dtypes across checkpoint, daemon index, shared memory and model; silent casts flagged."""

from __future__ import annotations

import json
import re

import pytest
import torch

from expertd.client import ExpertClient
from expertd.server.cli.commands import main
from expertd.tools.doctor import diagnose
from expertd.server.load.checkpoint import Checkpoint
from helpers.checkpoints import EXPERT, edit_checkpoint

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def fp32_norm_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    """Mixed dtypes: the final norm stored in fp32, which from_pretrained(dtype=bf16) rounds to bf16."""
    norm = Checkpoint.open(tiny_checkpoint).read("model.norm.weight").float() + torch.linspace(0, 1e-3, 320)
    return edit_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp("mixed") / "ckpt"),
                           replace={"model.norm.weight": norm})


def kinds(report) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in report.findings:
        out.setdefault(f.kind, set()).add(f.name)
    return out


def test_healthy_checkpoint(tiny_checkpoint, capsys):
    assert main(["doctor", tiny_checkpoint]) == 0
    text = capsys.readouterr().out
    assert "float8_e4m3fn+scale -> bfloat16 (bfloat16)" in text and "float32 -> float32 (float32)" in text
    assert "0 error(s), 0 warning(s)" in text


def test_unscaled_fp8_is_an_error(tiny_checkpoint, tmp_path, capsys):
    broken = edit_checkpoint(tiny_checkpoint, str(tmp_path / "ckpt"), drop=[EXPERT + "_scale_inv"])
    assert main(["doctor", broken]) == 1
    text = capsys.readouterr().out
    assert "ERROR fp8-unscaled" in text and EXPERT in text and "ScaleError" in text


def test_checkpoint_dtype_the_model_casts_is_a_warning(fp32_norm_checkpoint, capsys):
    assert main(["doctor", fp32_norm_checkpoint, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(f["severity"], f["kind"], f["name"]) for f in report["findings"]] == [
        ("warning", "cast-at-build", "model.norm.weight")]
    row = next(r for r in report["rows"] if r["name"] == "model.norm.weight")
    # served in the dtype from_pretrained gives it: rounded once at build, not by every worker
    assert (row["checkpoint"], row["served"], row["expected"]) == ("float32", "bfloat16", "bfloat16")
    bias = next(r for r in report["rows"] if r["name"] == BIAS)
    assert (bias["checkpoint"], bias["expected"]) == ("float32", "float32")  # transformers keeps it in fp32
    assert report["shared_memory"] is None  # no daemon, no model: nothing to count
    assert main(["doctor", fp32_norm_checkpoint, "--strict"]) == 1


def test_daemon_shared_memory_and_restored_model(fp32_norm_checkpoint, tiny_checkpoint, start_daemon, capsys):
    daemon = start_daemon(fp32_norm_checkpoint)
    # checkpoint (from the config) -> index -> shared memory -> model from load_model()
    assert main(["doctor", "--config", daemon.config, "--load-model"]) == 0
    text = capsys.readouterr().out
    assert "checkpoint -> served -> index -> shm -> model" in text
    assert "model.norm.weight: stored as float32, served as bfloat16" in text and "private copy" not in text
    counted = re.search(r"model tensors in the daemon's shared memory: (\d+) of (\d+) \(0 not\)", text)
    assert counted and counted[1] == counted[2] and int(counted[1]) > 0
    assert main(["doctor", "--config", daemon.config, "--load-model", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shared_memory"] == {"shared": int(counted[1]), "private": 0}
    assert main(["doctor", "--endpoint", daemon.endpoint, "--strict"]) == 1  # the daemon's checkpoint is found too
    assert f"checkpoint {fp32_norm_checkpoint}" in capsys.readouterr().out

    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        model = client.load_model()
        report = diagnose(fp32_norm_checkpoint, client, model)
        assert not report.errors and kinds(report) == {"cast-at-build": {"model.norm.weight"}}
        rows = {r.name: r for r in report.rows}
        expert = rows["model.layers.1.mlp.experts.gate_up_proj"]
        assert (expert.checkpoint, expert.index, expert.shm, expert.model, expert.shared) == (
            "float8_e4m3fn+scale", "bfloat16", "bfloat16", "bfloat16", True)
        assert rows[BIAS].model == "float32" and rows[BIAS].shared
        assert report.shared_memory == {"shared": sum(r.shared is True for r in report.rows), "private": 0}

        # the classic: the model in float32 while the shared tensors are bf16
        model.float()
        report = diagnose(None, client, model)
        assert report.exit_code() == 1
        found = kinds(report)
        assert EXPERT.replace("3.gate_proj.weight", "gate_up_proj") in found["model-vs-expected"]
        assert "lm_head.weight" in found["model-vs-expected"]
        assert not [f for f in report.findings if f.name == BIAS]  # already fp32: .float() kept the shared view
        rows = {r.name: r for r in report.rows}
        assert rows["lm_head.weight"].shared is False and rows[BIAS].shared is True
        private = sum(r.shared is False for r in report.rows)
        assert private > 0 and report.to_dict()["shared_memory"] == {
            "shared": sum(r.shared is True for r in report.rows), "private": private}
        assert f"({private} not)" in report.text()

        # another checkpoint whose tensors are served in the same dtypes (the model's): nothing to tell apart
        assert not diagnose(tiny_checkpoint, client).errors


def test_load_model_with_a_private_copy_fails(tiny_checkpoint, start_daemon, monkeypatch, capsys):
    """A worker that could not map a dtype cast (a daemon that makes none, simulated by the client getting no
    derived tensors) holds private copies: `doctor --load-model` exits 1 naming each and why."""
    import expertd.client.binder as binder_module

    daemon = start_daemon(tiny_checkpoint)
    assert main(["doctor", "--config", daemon.config, "--load-model", "--dtype", "float16"]) == 0  # all derived tensors
    capsys.readouterr()
    monkeypatch.setattr(binder_module, "fetch", lambda *args: [])
    assert main(["doctor", "--config", daemon.config, "--load-model", "--dtype", "float16"]) == 1
    text = capsys.readouterr().out
    assert "ERROR private-copy: " in text and "model.embed_tokens.weight: a private copy" in text
    assert "served as bfloat16, the model holds float16: no dtype cast was mapped" in text
    counted = re.search(r"model tensors in the daemon's shared memory: (\d+) of (\d+) \((\d+) not\)", text)
    assert counted and int(counted[3]) > 0 and int(counted[1]) + int(counted[3]) == int(counted[2])


def test_model_left_on_the_meta_device(tiny_checkpoint):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from expertd.hf import model_config

    config = model_config(Checkpoint.open(tiny_checkpoint).config)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    report = diagnose(model=model)  # an empty-weights model in float32, never bound to any weights
    found = kinds(report)
    assert "lm_head.weight" in found["model-meta"] and "lm_head.weight" in found["model-vs-expected"]
    assert BIAS not in found["model-vs-expected"]

    with init_empty_weights():  # built in bf16 as config.json says: the fp32-kept bias is what the release builds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    held = {n: t.dtype for n, t in model.state_dict().items()}
    found = kinds(diagnose(model=model)).get("model-vs-expected", set())
    # 5.23 builds the bias in bf16 (from_pretrained would keep fp32: flagged), 5.24 builds it in fp32 itself
    assert found == {b for b in (BIAS, BIAS.replace("layers.1", "layers.2")) if held[b] != torch.float32}


def test_needs_something_to_check(capsys):
    assert main(["doctor"]) == 2
    assert "give a CHECKPOINT" in capsys.readouterr().err
