"""The quantization format comes from config.json's quantization_config, and a format expertd cannot serve is
refused before anything is read or created: one line naming the field, its value and what is served."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest

from expertd.server.quantization import QuantFormat, UnsupportedQuantization, quantization_format
from helpers.daemon import expertd_cmd, write_config

# what llmcompressor writes for QuantizationModifier(scheme="FP8_DYNAMIC") (save_compressed=True)
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                                                                     "symmetric": True, "dynamic": False},
                                  "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                                        "dynamic": True}}},
    "ignore": ["lm_head"],
}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
DEEPSEEK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_served_formats():
    assert quantization_format({}) == QuantFormat(None, (128, 128))
    assert quantization_format({"quantization_config": DEEPSEEK}) == QuantFormat("fp8", (128, 128))
    assert quantization_format({"quantization_config": {**DEEPSEEK, "weight_block_size": [64, 64]}}).block_size == (64, 64)
    no_method = {k: v for k, v in DEEPSEEK.items() if k != "quant_method"}
    assert quantization_format({"quantization_config": no_method}).method == "fp8"


@pytest.mark.parametrize("qc, message", [
    (COMPRESSED_TENSORS, "quantization_config.quant_method 'compressed-tensors' (format 'float-quantized', weights "
                         "float 8-bit channel) is not served"),
    (MXFP4, "quantization_config.quant_method 'mxfp4' (gpt-oss MXFP4"),
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method 'gptq' is not served"),
    ({**DEEPSEEK, "activation_scheme": "static"}, "quantization_config.activation_scheme 'static' is not served (static "
                                                  "activation scales would change the numerics)"),
    ({**DEEPSEEK, "fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not served"),
])
def test_unserved_formats_are_refused_naming_the_field(qc, message):
    with pytest.raises(UnsupportedQuantization) as err:
        quantization_format({"quantization_config": qc}, "/ckpt/config.json")
    assert message in str(err.value) and "file /ckpt/config.json" in str(err.value)
    assert "it serves quant_method 'fp8'" in str(err.value) or "expertd serves" in str(err.value)


@pytest.mark.parametrize("qc", [COMPRESSED_TENSORS, MXFP4], ids=["compressed-tensors", "mxfp4"])
def test_the_daemon_refuses_them_in_one_line_and_creates_nothing(tiny_checkpoint, tmp_path, namespace, qc):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": qc}, f)
    done = subprocess.run(expertd_cmd("start", "--config", write_config(tmp_path, folder, namespace)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "UnsupportedQuantization" in lines[0] and f"quant_method {qc['quant_method']!r}" in lines[0]
    assert os.path.join(folder, "config.json") in lines[0]
    assert not glob.glob(f"/dev/shm/{namespace}*")
