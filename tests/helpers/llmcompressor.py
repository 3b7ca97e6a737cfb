"""Real compressed-tensors checkpoints, written by llmcompressor's `oneshot` in a virtualenv of its own.

llmcompressor pins its own transformers (and compressed-tensors), so it cannot share this environment: the
virtualenv is made once and cached in ~/.cache/expertd (like conftest's `tf4_python`); the checkpoint is then
written by `llmcompressor_write.py`, run in that virtualenv (it imports nothing of expertd).
"""

from __future__ import annotations

import os

from helpers.install import TORCH, cached_venv, run

LLMCOMPRESSOR = "llmcompressor==0.14.0.1"  # pins transformers<=5.17 and compressed-tensors==0.19.0 itself
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llmcompressor_write.py")


def llmcompressor_venv() -> str:
    """The python of a virtualenv with `LLMCOMPRESSOR` (made once, cached in ~/.cache/expertd)."""
    # torch first, the one installed here, so llmcompressor's `torch<=2.14` is already met (no CUDA wheels)
    return cached_venv(f"venv-{LLMCOMPRESSOR.replace('==', '-')}", ["install", TORCH],
                       ["install", TORCH, LLMCOMPRESSOR])


def write_compressed(python: str, bf16_folder: str, out_folder: str, scheme: str, timeout: float = 600) -> None:
    """Quantize the bf16 checkpoint in `bf16_folder` with `oneshot(QuantizationModifier(scheme=scheme))`
    (data-free: FP8_DYNAMIC, FP8_BLOCK) and save it compressed to `out_folder`."""
    run([python, SCRIPT, bf16_folder, out_folder, scheme], cwd="/", timeout=timeout)
