"""The generator is deterministic (it reproduces the bundled tiny checkpoint byte for byte) and writes every stored
format expertd serves, in the shards asked for, each served by a real daemon as the format's reference dequant."""

import filecmp
import json
import os
import subprocess

import pytest
import torch

from expertd.client import ExpertClient
from expertd.server.load.layout import plan_checkpoint
from expertd.server.load.checkpoint import Checkpoint
from expertd.tools.generate import generate
from helpers.daemon import expertd_cmd
from helpers.reference import reference_tensors

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny")


def test_generator_reproduces_the_bundled_checkpoint(tmp_path):
    out = str(tmp_path / "tiny")
    generate(out, preset="tiny")
    files = sorted(os.listdir(BUNDLED))
    assert files == sorted(os.listdir(out))
    match, mismatch, errors = filecmp.cmpfiles(BUNDLED, out, files, shallow=False)
    assert mismatch == [] and errors == []


def test_bundled_checkpoint_has_partial_blocks_and_foreign_scales():
    plan = plan_checkpoint(Checkpoint.open(BUNDLED))
    fp8 = [s for t in plan.tensors for s in t.sources if s.scale is not None]
    assert any(s.info.shape[0] % 128 or s.info.shape[1] % 128 for s in fp8)
    assert any(s.info.file != s.scale.file for s in fp8)


# (arguments, the format written, shards): every stored format, each served by a real daemon
FORMAT_CASES = [
    (["--shards", "3"], "fp8-blocks", 3),  # a preset's default: DeepSeek-V3's release format
    (["--format", "bf16"], "bf16", 2),
    (["--format", "compressed-fp8", "--shards", "1"], "compressed-fp8", 1),
    (["--model-type", "qwen3_moe", "--format", "compressed-fp8-block", "--shards", "2"], "compressed-fp8-block", 2),
    (["--model-type", "qwen3_moe", "--shards", "4"], "fp8-blocks", 4),  # Qwen3's FP8 release format, honouring --shards
    (["--model-type", "gpt_oss", "--shards", "3"], "mxfp4", 3),  # gpt-oss's release format
]
QUANT_METHODS = {"bf16": None, "fp8-blocks": "fp8", "compressed-fp8": "compressed-tensors",
                 "compressed-fp8-block": "compressed-tensors", "mxfp4": "mxfp4"}
STRATEGIES = {"compressed-fp8": "channel", "compressed-fp8-block": "block"}


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(expertd_cmd("generate", *args), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args,fmt,shards", FORMAT_CASES, ids=[" ".join(a) for a, _, _ in FORMAT_CASES])
def test_each_format_is_written_in_its_shards_and_served_as_its_reference_dequant(args, fmt, shards, tmp_path,
                                                                                 start_daemon):
    folder = str(tmp_path / "ckpt")
    done = _generate(folder, *args)
    assert done.returncode == 0, done.stderr
    with open(os.path.join(folder, "config.json")) as f:
        quantization = json.load(f).get("quantization_config")
    assert (quantization or {}).get("quant_method") == QUANT_METHODS[fmt], quantization
    if fmt in STRATEGIES:
        assert quantization["config_groups"]["group_0"]["weights"]["strategy"] == STRATEGIES[fmt]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        assert sorted(set(json.load(f)["weight_map"].values())) == files
    assert len(files) == shards, files
    reference = reference_tensors(folder)
    daemon = start_daemon(folder)
    with ExpertClient(daemon.endpoint) as client:
        served = client.tensors()
        assert set(reference) <= set(served)
        for name, expected in reference.items():
            got = served[name]  # in the dtype transformers loads it in (a router's gate.weight: float32)
            assert got.dtype in (expected.dtype, torch.float32) and torch.equal(got, expected.to(got.dtype)), name
        del served


WRONG = [
    (["--format", "mxfp4"], "--format mxfp4 writes gpt-oss's expert weights"),
    (["--model-type", "qwen3_moe", "--format", "mxfp4"], "which --model-type qwen3_moe does not have"),
    (["--fp8", "--format", "bf16"], "--fp8 and --format together"),
    (["--no-fp8"], "--no-fp8 needs --model-type"),
    (["--preset", "tiny", "--model-type", "gpt_oss"], "--preset and --model-type together"),
    (["--model-type", "no_such_model"], "unknown --model-type 'no_such_model'"),
    (["--format", "fp4"], "invalid choice: 'fp4'"),
    (["--shards", "0"], "'0' is not a positive integer"),
]


@pytest.mark.parametrize("args,words", WRONG, ids=[" ".join(a) for a, _ in WRONG])
def test_a_wrong_combination_is_one_line_and_exit_2(args, words, tmp_path):
    done = _generate(str(tmp_path / "out"), *args)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "out")  # refused before anything is written


def test_fp8_flags_still_work_and_say_they_are_deprecated(tmp_path):
    done = _generate(str(tmp_path / "q"), "--model-type", "qwen3_moe", "--no-fp8")
    assert done.returncode == 0, done.stderr
    assert "--no-fp8 is deprecated; use --format bf16" in done.stderr
    with open(tmp_path / "q" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
