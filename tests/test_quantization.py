"""The quantization format comes from config.json's quantization_config, and a format expertd cannot serve is
refused before anything is read or created: one line naming the field, its value and what is served."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest

from expertd.quantization import Mxfp4, ScaledFp8, UnsupportedQuantization, quantization_format
from helpers.daemon import expertd_cmd, write_config

# what llmcompressor writes for QuantizationModifier(scheme="FP8_DYNAMIC") (save_compressed=True)
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                                              "symmetric": True, "dynamic": False},
                                  "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                                        "dynamic": True}}},
    "ignore": ["lm_head"],
}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
DEEPSEEK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_served_formats():
    assert quantization_format({}) == ScaledFp8(None)
    assert quantization_format({"quantization_config": DEEPSEEK}) == \
        ScaledFp8("fp8", "_scale_inv", ("block",), (128, 128))
    assert quantization_format({"quantization_config": {**DEEPSEEK, "weight_block_size": [64, 32]}}).block_size == \
        (64, 32)
    no_method = {k: v for k, v in DEEPSEEK.items() if k != "quant_method"}
    assert quantization_format({"quantization_config": no_method}).method == "fp8"
    channel = quantization_format({"quantization_config": COMPRESSED_TENSORS})
    assert channel == ScaledFp8("compressed-tensors", "_scale", ("channel",), (128, 128), ("lm_head",))
    assert channel.block_for((300, 70), (300, 1)) == (1, 70)
    block = quantization_format({"quantization_config": compressed("block", block_structure=[128, 128])})
    assert block.strategies == ("block",) and block.block_for((300, 70), (3, 1)) == (128, 128)
    tensor = quantization_format({"quantization_config": compressed("tensor")})
    assert tensor.block_for((300, 70), (1,)) == (300, 70)
    with pytest.raises(ValueError):
        block.block_for((300, 70), (300, 1))
    assert quantization_format({"quantization_config": MXFP4}) == Mxfp4(("model.layers.*.self_attn", "lm_head"))


def compressed(strategy: str, **weights) -> dict:
    """COMPRESSED_TENSORS with another weight strategy (and more weight fields)."""
    group = COMPRESSED_TENSORS["config_groups"]["group_0"]
    return {**COMPRESSED_TENSORS, "config_groups": {"group_0": {**group, "weights": {**group["weights"],
                                                                                     "strategy": strategy, **weights}}}}


INT4 = {**compressed("group", type="int", num_bits=4, group_size=128), "format": "pack-quantized"}
NVFP4 = {**compressed("tensor_group", num_bits=4, group_size=16), "format": "nvfp4-pack-quantized"}
STATIC = {**COMPRESSED_TENSORS, "config_groups": {"group_0": {
    **COMPRESSED_TENSORS["config_groups"]["group_0"],
    "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}}


@pytest.mark.parametrize("qc, message", [
    (INT4, "quantization_config.format 'pack-quantized' is not served; expertd serves compressed-tensors format "
           "'float-quantized'"),
    (NVFP4, "quantization_config.format 'nvfp4-pack-quantized' is not served"),
    ({**compressed("channel", type="int"), "format": "float-quantized"},
     "quantization_config.config_groups.group_0.weights.type 'int' is not served"),
    (compressed("group", group_size=128), "quantization_config.config_groups.group_0.weights.strategy 'group' is not "
                                          "served; expertd serves compressed-tensors weight strategies 'channel'"),
    (compressed("channel", symmetric=False), "config_groups.group_0.weights.symmetric False is not served"),
    (STATIC, "quantization_config.config_groups.group_0.input_activations False is not served (static activation "
             "scales would change the numerics)"),
    ({**COMPRESSED_TENSORS, "kv_cache_scheme": {"type": "float", "num_bits": 8}},
     "quantization_config.kv_cache_scheme"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quantization_config.quant_method 'modelopt' is not served"),
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method 'gptq' is not served"),
    ({**DEEPSEEK, "activation_scheme": "static"},
     "quantization_config.activation_scheme 'static' is not served (static activation scales would change the "
     "numerics)"),
    ({**DEEPSEEK, "fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not served"),
])
def test_unserved_formats_are_refused_naming_the_field(qc, message):
    with pytest.raises(UnsupportedQuantization) as err:
        quantization_format({"quantization_config": qc}, "/ckpt/config.json")
    assert message in str(err.value) and "file /ckpt/config.json" in str(err.value)
    assert "it serves quant_method 'fp8'" in str(err.value) or "expertd serves" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("qc, field", [(INT4, "format"), ({"quant_method": "modelopt", "quant_algo": "NVFP4"},
                                                          "quant_method")], ids=["int4-compressed-tensors", "nvfp4"])
def test_the_daemon_refuses_them_in_one_line_and_creates_nothing(tiny_checkpoint, tmp_path, namespace, qc, field):
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
    assert len(lines) == 1 and "UnsupportedQuantization" in lines[0]
    assert f"quantization_config.{field} {qc[field]!r}" in lines[0]
    assert os.path.join(folder, "config.json") in lines[0]
    assert not glob.glob(f"/dev/shm/{namespace}*")
