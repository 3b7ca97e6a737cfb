"""`expertd convert`: FP8 -> bf16 HuggingFace checkpoint, bitwise the reference, resumable, strict about scales."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from expertd.tools import convert as convert_mod
from expertd.server.cli.commands import main
from expertd.tools.convert import STATE_FILE, convert
from expertd.server.load.checkpoint import Checkpoint
from helpers.checkpoints import EXPERT, INDEX, edit_checkpoint
from helpers.reference import reference_tensors, write_reference_bf16


def converted_tensors(folder: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(folder, INDEX)) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for shard in shards:
        out.update(load_file(os.path.join(folder, shard)))
    return out


def assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype, name
        assert torch.equal(got[name].view(torch.uint8), ref.contiguous().view(torch.uint8)), name


@pytest.fixture(scope="module")
def source(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny checkpoint plus the side files a real one has, and mixed dtypes: an fp32 norm, an fp16 embedding."""
    ckpt = Checkpoint.open(tiny_checkpoint)
    mixed = {"model.norm.weight": ckpt.read("model.norm.weight").float(),
             "model.embed_tokens.weight": ckpt.read("model.embed_tokens.weight").half()}
    folder = edit_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp("src") / "fp8"), replace=mixed)
    for name, text in (("tokenizer.json", '{"version": "1.0"}'), ("generation_config.json", '{"do_sample": false}')):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return folder


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("dst") / "bf16")
    result = convert(source, dst, max_shard_size="1MB")
    assert len(result.written) > 3 and not result.skipped and not result.noop
    return dst


def test_tensors_are_bitwise_the_reference_dequant(source, converted):
    want = reference_tensors(source)
    got = converted_tensors(converted)
    assert_bitwise(got, want)
    assert got["model.norm.weight"].dtype == torch.float32 and got["model.embed_tokens.weight"].dtype == torch.float16
    assert got[EXPERT].dtype == torch.bfloat16 and got[EXPERT].shape == (200, 320)  # partial 128-blocks


def test_index_config_and_side_files(source, converted):
    with open(os.path.join(converted, INDEX)) as f:
        index = json.load(f)
    assert not [n for n in index["weight_map"] if n.endswith("_scale_inv")]
    tensors = converted_tensors(converted)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in set(index["weight_map"].values()):
        assert os.path.getsize(os.path.join(converted, shard)) <= 1_000_000 + 64_000  # --max-shard-size + header
    with open(os.path.join(converted, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config
    assert config["torch_dtype"] == "bfloat16" and config["dtype"] == "bfloat16"
    for name in ("tokenizer.json", "generation_config.json"):
        with open(os.path.join(source, name)) as a, open(os.path.join(converted, name)) as b:
            assert a.read() == b.read()
    assert not [f for f in os.listdir(converted) if f.endswith(".partial")]


def test_transformers_loads_the_result_like_the_reference(source, converted, tmp_path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(write_reference_bf16(source, str(tmp_path / "ref")))
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_rerun_over_a_finished_destination_is_a_noop(source, converted):
    before = {f: os.stat(os.path.join(converted, f)).st_mtime_ns for f in os.listdir(converted)}
    result = convert(source, converted, max_shard_size="1MB")
    assert result.noop and not result.written
    assert {f: os.stat(os.path.join(converted, f)).st_mtime_ns for f in os.listdir(converted)} == before


def test_interrupted_run_resumes_from_completed_shards(source, tmp_path, monkeypatch):
    dst = str(tmp_path / "out")
    real = convert_mod._write_shard
    calls = []

    def dies_on_third_shard(plan, shard, path, device, bar):
        calls.append(shard.file)
        if len(calls) == 3:
            with open(path + ".partial", "wb") as f:  # what a killed run leaves behind
                f.write(b"half a shard")
            raise KeyboardInterrupt
        real(plan, shard, path, device, bar)

    monkeypatch.setattr(convert_mod, "_write_shard", dies_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        convert(source, dst, max_shard_size="1MB")
    assert not os.path.exists(os.path.join(dst, INDEX))  # the index comes last
    done = {f: os.stat(os.path.join(dst, f)).st_ino for f in calls[:2]}
    assert not os.path.exists(os.path.join(dst, calls[2]))

    monkeypatch.setattr(convert_mod, "_write_shard", real)
    result = convert(source, dst, max_shard_size="1MB")
    assert result.skipped == calls[:2] and calls[2] in result.written
    assert {f: os.stat(os.path.join(dst, f)).st_ino for f in calls[:2]} == done  # kept, not rewritten
    assert_bitwise(converted_tensors(dst), reference_tensors(source))
    assert not [f for f in os.listdir(dst) if f.endswith(".partial")]


def test_destination_with_other_content_is_refused(source, tmp_path):
    dst = tmp_path / "busy"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    assert main(["convert", source, str(dst), "--no-progress"]) == 2
    assert os.listdir(dst) == ["notes.txt"]


def test_other_options_over_an_earlier_conversion_are_refused(source, converted, capsys):
    assert main(["convert", source, converted, "--max-shard-size", "2MB", "--no-progress"]) == 2
    assert "another checkpoint or with other options" in capsys.readouterr().err


def _missing_scale(src, dst):
    return edit_checkpoint(src, dst, drop=[EXPERT + "_scale_inv"])


def _wrong_scale_shape(src, dst):
    return edit_checkpoint(src, dst, replace={EXPERT + "_scale_inv": torch.ones(2, 2)})


def _nan_scale(src, dst):
    scale = Checkpoint.open(src).read(EXPERT + "_scale_inv").clone()
    scale[1, 2] = float("nan")
    return edit_checkpoint(src, dst, replace={EXPERT + "_scale_inv": scale})


def _orphan_scale(src, dst):
    return edit_checkpoint(src, dst, replace={EXPERT: torch.zeros(200, 320, dtype=torch.bfloat16)})


def _truncated_shard(src, dst):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model-00002-of-00003.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    return dst


@pytest.mark.parametrize("breaker, named, error", [
    (_missing_scale, EXPERT, "ScaleError"),
    (_wrong_scale_shape, EXPERT + "_scale_inv", "ScaleError"),
    (_nan_scale, EXPERT + "_scale_inv", "ScaleError"),
    (_orphan_scale, EXPERT + "_scale_inv", "ScaleError"),
    (_truncated_shard, "model-00002-of-00003.safetensors", "ShardFormatError"),
])
def test_bad_source_fails_before_anything_is_written(tiny_checkpoint, tmp_path, capsys, breaker, named, error):
    src = breaker(tiny_checkpoint, str(tmp_path / "broken"))
    dst = str(tmp_path / "out")
    assert main(["convert", src, dst, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert error in err and named in err
    assert not os.path.exists(dst)


def test_keep_fp8_where_unscaled_only_when_asked(tiny_checkpoint, tmp_path):
    src = _missing_scale(tiny_checkpoint, str(tmp_path / "unscaled"))
    dst = str(tmp_path / "out")
    assert main(["convert", src, dst, "--no-progress", "--keep-fp8-where-unscaled"]) == 0
    got = converted_tensors(dst)
    assert got[EXPERT].dtype == torch.float8_e4m3fn
    assert torch.equal(got[EXPERT].view(torch.uint8), Checkpoint.open(src).read(EXPERT).view(torch.uint8))
    other = "model.layers.1.mlp.experts.2.gate_proj.weight"
    assert got[other].dtype == torch.bfloat16


def test_cli_exit_code_and_progress_with_bytes(tiny_checkpoint, tmp_path):
    dst = str(tmp_path / "out")
    run = subprocess.run([sys.executable, "-m", "expertd.server.cli", "convert", tiny_checkpoint, dst,
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "expertd convert" in run.stderr and "100%" in run.stderr and "B/s" in run.stderr
    assert os.path.exists(os.path.join(dst, STATE_FILE)) and os.path.exists(os.path.join(dst, INDEX))
    again = subprocess.run([sys.executable, "-m", "expertd.server.cli", "convert", tiny_checkpoint, dst],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_conversion_is_bitwise_the_cpu_one(source, converted, tmp_path):
    dst = str(tmp_path / "gpu")
    convert(source, dst, device="cuda", max_shard_size="1MB")
    assert_bitwise(converted_tensors(dst), converted_tensors(converted))
