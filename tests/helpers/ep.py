"""What the expert-parallel tests share: their tiny checkpoints (module fixtures, offered to every test module:
tests/conftest.py registers this module as a pytest plugin), a free TCP port, a checkpoint's routed-expert
count and the workers' reports."""

from __future__ import annotations

import json
import os
import socket

import pytest

from expertd.tools.generate import generate, generate_model_type
from helpers.reference import write_reference_bf16

HELPERS = os.path.dirname(os.path.abspath(__file__))
EXPERT = "model.layers.1.mlp.experts."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory) -> tuple[str, str]:
    """The tiny DeepSeek-V3 FP8 checkpoint (its published config at tiny dims, MTP layer included) and its
    reference-dequantized bf16 twin."""
    root = tmp_path_factory.mktemp("ep-dsv3")
    folder = str(root / "fp8")
    generate(folder, preset="tiny", seed=3, shards=3)
    return folder, write_reference_bf16(folder, str(root / "bf16"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ep-qwen3")
    folder = str(root / "fp8")
    generate_model_type(folder, "qwen3_moe")
    return folder, write_reference_bf16(folder, str(root / "bf16"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[str, str]:
    """A tiny gpt-oss checkpoint as released (MXFP4 blocks and scales, expert stacks pre-fused [E, ...] in the
    checkpoint) and its bf16 reference."""
    from expertd.tools.requantize import write_mxfp4

    root = tmp_path_factory.mktemp("ep-gpt-oss")
    folder = str(root / "mxfp4")
    generate_model_type(folder, "gpt_oss", fp8=False)
    write_mxfp4(folder)
    return folder, write_reference_bf16(folder, str(root / "bf16"))


def experts_of(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("n_routed_experts") or config.get("num_experts") or config["num_local_experts"]



def reports(out, ranks) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in ranks]
