"""compressed-tensors FP8 (what llmcompressor writes, and the "-FP8-dynamic" / "-FP8-block" MoE releases) served
through the real daemon and real workers: per-channel, per-tensor and per-block weight scales dequantized once,
bit for bit bf16(float32(w) * float32(s)); generations, update(), convert, inspect and doctor in that format;
bad checkpoints refused in one line naming file, tensor and expectation, nothing left in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertd.client import ExpertClient
from expertd.server.cli.commands import main
from expertd.tools.generate import generate_model_type, quantize_saved_checkpoint
from helpers.daemon import refused_start
from helpers.inputs import INPUT_IDS
from helpers.reference import reference_tensors, write_reference_bf16
from helpers.workers import worker_logits

EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"
ATTN = "model.layers.0.self_attn.q_proj.weight"


def own_checkpoint(folder: str, strategy: str) -> str:
    """A tiny Qwen3-MoE in compressed-tensors FP8 of `strategy` written by expertd's own writer (llmcompressor has
    no data-free preset for per-tensor weights with dynamic activations)."""
    generate_model_type(folder, "qwen3_moe", fp8=False)
    quantize_saved_checkpoint(folder, torch.bfloat16, scheme=strategy)
    return folder


@pytest.fixture(scope="module", params=["FP8_DYNAMIC", "FP8_BLOCK", "tensor"])
def ct_checkpoint(request, llmcompressor_checkpoints, tmp_path_factory) -> tuple[str, str, torch.Tensor]:
    """(scheme, checkpoint folder, logits of from_pretrained on the bf16 reference made by the format's definition)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    if request.param in llmcompressor_checkpoints:
        folder = llmcompressor_checkpoints[request.param]
    else:
        folder = own_checkpoint(str(root / "ckpt"), request.param)
    reference = AutoModelForCausalLM.from_pretrained(write_reference_bf16(folder, str(root / "reference")),
                                                     dtype=torch.bfloat16)
    with torch.no_grad():
        logits = reference(torch.tensor(INPUT_IDS)).logits
    return request.param, folder, logits


def test_worker_logits_equal_the_formats_definition(ct_checkpoint, start_daemon, workers, namespace, tmp_path):
    scheme, folder, expected = ct_checkpoint
    daemon = start_daemon(folder)
    with ExpertClient(daemon.endpoint) as client:
        index = client.index()
        assert {t.dtype for t in index.tensors} <= {"torch.bfloat16", "torch.float32"}
        served = client.tensors()
        reference = reference_tensors(folder)
        assert torch.equal(served[EXPERT].view(torch.int16), reference[EXPERT].view(torch.int16))
        assert torch.equal(served[ATTN].view(torch.int16), reference[ATTN].view(torch.int16))
        del served
    logits = worker_logits(workers, daemon.endpoint, namespace, str(tmp_path / "worker"))
    assert torch.equal(logits, expected), f"{scheme}: max |diff| {(logits.float() - expected.float()).abs().max()}"


def test_fp8_dynamic_equals_transformers_own_loader(llmcompressor_checkpoints, start_daemon, workers, namespace,
                                                    tmp_path):
    """transformers (with compressed-tensors) decompresses FP8_DYNAMIC on CPU itself: the same logits. (Its MoE
    expert path cannot expand FP8_BLOCK scales in 5.23, so the block checkpoint has the definition alone.)"""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    folder = llmcompressor_checkpoints["FP8_DYNAMIC"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        expected = model(torch.tensor(INPUT_IDS)).logits
    daemon = start_daemon(folder)
    assert torch.equal(worker_logits(workers, daemon.endpoint, namespace, str(tmp_path / "worker")), expected)


def test_update_pushes_fp8_with_its_weight_scale(llmcompressor_checkpoints, start_daemon, tmp_path):
    """A trainer pushes one expert in the checkpoint's own format (FP8 + per-channel `weight_scale`, bf16) and
    plain bf16 for another: the new generation holds them dequantized as a load would."""
    from expertd.kernels import quantize_fp8_blockwise

    folder = llmcompressor_checkpoints["FP8_DYNAMIC"]
    daemon = start_daemon(folder)
    with ExpertClient(daemon.endpoint) as client:
        before = client.tensors()[EXPERT].clone()
        q, s = quantize_fp8_blockwise(before.float() * 0.5, (1, before.shape[1]))
        scale = s.to(torch.bfloat16)
        generation = client.update({EXPERT: q, EXPERT + "_scale": scale})
        client.refresh()
        after = client.tensors()[EXPERT]
        assert generation == client.generation
        assert torch.equal(after, (q.float() * scale.float()).to(torch.bfloat16))
        for bad, message in [({EXPERT: q}, "_scale"),
                             ({EXPERT: q, EXPERT + "_scale": scale[:5]}, "[192, 1] (channel)")]:
            with pytest.raises(Exception) as err:
                client.update(bad)
            assert message in str(err.value)


def test_convert_inspect_and_doctor(llmcompressor_checkpoints, tmp_path, capsys):
    folder = llmcompressor_checkpoints["FP8_BLOCK"]
    out = str(tmp_path / "bf16")
    assert main(["convert", folder, out, "--no-progress"]) == 0
    converted = load_file(os.path.join(out, "model.safetensors")) if os.path.exists(
        os.path.join(out, "model.safetensors")) else {k: v for f in glob.glob(os.path.join(out, "*.safetensors"))
                                                      for k, v in load_file(f).items()}
    reference = reference_tensors(folder)
    assert set(converted) == set(reference)
    assert all(torch.equal(converted[n].view(-1).view(torch.uint8), reference[n].view(-1).view(torch.uint8))
               for n in reference)
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)

    report = str(tmp_path / "inspect")
    assert main(["inspect", folder, "--out", report, "--no-plots", "--formats", "bf16"]) == 0
    with open(os.path.join(report, "stats.json")) as f:
        rows = {t["name"]: t for t in json.load(f)["tensors"]}
    assert rows[EXPERT]["format"] == "fp8 e4m3, 128x128 block scale" and rows[EXPERT]["values_dtype"] == "bfloat16"
    assert rows[EXPERT + "_scale"]["role"] == "scale"
    assert rows["model.norm.weight"]["format"] == "bfloat16"
    capsys.readouterr()
    assert main(["doctor", folder]) == 0
    text = capsys.readouterr().out
    assert "float8_e4m3fn+scale -> bfloat16 (bfloat16)" in text and "0 error(s)" in text


def edited(src: str, dst: str, *, config=None, drop=(), replace=None) -> str:
    """A copy of checkpoint folder `src` with tensors dropped or replaced and config.json's quantization_config
    changed by `config(qc)`."""
    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(path)
        changed = {k: v for k, v in tensors.items() if k not in drop}
        changed.update({k: v for k, v in (replace or {}).items() if k in tensors})
        if changed.keys() != tensors.keys() or replace and set(replace) & set(tensors):
            save_file(changed, path, metadata={"format": "pt"})
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index) and drop:
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in drop}
        with open(index, "w") as f:
            json.dump(data, f)
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            data = json.load(f)
        config(data["quantization_config"])
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(data, f)
    return dst


def _static(qc: dict) -> None:
    qc["config_groups"]["group_0"]["input_activations"]["dynamic"] = False


def _int4(qc: dict) -> None:
    qc["format"] = "pack-quantized"
    qc["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4, strategy="group", group_size=128)


BAD = {
    "block-scale-misshapen": (dict(replace={EXPERT + "_scale": torch.ones(2, 1, dtype=torch.bfloat16)}),
                              "ScaleError", EXPERT + "_scale", "expected [2, 2] (block)"),
    "scale-missing": (dict(drop=[EXPERT + "_scale"]), "ScaleError", EXPERT, f"no '{EXPERT}_scale'"),
    "scale-not-finite": (dict(replace={EXPERT + "_scale": torch.full((2, 2), float("nan"), dtype=torch.bfloat16)}),
                         "ScaleError", EXPERT + "_scale", "non-finite or non-positive"),
    "static-activations": (dict(config=_static), "UnsupportedQuantization", "config.json",
                           "input_activations False is not served (static activation scales"),
    "int4": (dict(config=_int4), "UnsupportedQuantization", "config.json", "format 'pack-quantized' is not served"),
    "stray-input-scale": (dict(replace={}), "UnsupportedQuantization", ATTN.replace("weight", "input_scale"),
                          "input_scale tensors are not served"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_are_refused_in_one_line(case, llmcompressor_checkpoints, tmp_path, namespace):
    edit, error, where, message = BAD[case]
    folder = edited(llmcompressor_checkpoints["FP8_BLOCK"], str(tmp_path / "ckpt"), **edit)
    if case == "stray-input-scale":  # a static scheme's tensor in a checkpoint whose config says dynamic
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        tensors[ATTN.replace("weight", "input_scale")] = torch.ones(1, dtype=torch.bfloat16)
        save_file(tensors, path, metadata={"format": "pt"})
    refused_start(tmp_path, folder, namespace, error, where, message)
