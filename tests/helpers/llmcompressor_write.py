"""Write a compressed-tensors checkpoint with llmcompressor, as its examples do; run in llmcompressor's own
virtualenv (see helpers/llmcompressor.py), never in the tests' environment, and it imports nothing of expertd.

    python llmcompressor_write.py BF16_FOLDER OUT_FOLDER SCHEME      (SCHEME: FP8_DYNAMIC, FP8_BLOCK)

Data-free: FP8_DYNAMIC (per-channel weight scales, dynamic per-token activations) and FP8_BLOCK (128x128
weight blocks, dynamic per-group activations) need no calibration data. transformers 5 fuses MoE experts
into 3-D parameters, which `targets="Linear"` would not match; `oneshot` linearizes them first
(`linearize_moe`: one nn.Linear per expert, `mlp.experts.N.{gate,up,down}_proj`), so every expert is
quantized and saved under per-expert names. (llmcompressor's `load_context`, which loads them linear
directly, is not used: under its transformers 5.17 it imports every transformers module, torchvision included.)
"""

from __future__ import annotations

import os
import sys

# this folder is sys.path[0] when run as a script, and its llmcompressor.py would shadow the package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402

# what llmcompressor's MoE examples leave unquantized: the output head and the routers (`mlp.gate`)
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]


def main(src: str, out: str, scheme: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE))
    # config.json: llmcompressor re-saves the source's own (`resave_config`) with `quantization_config` added;
    # generation_config.json is transformers'. No tokenizer: these checkpoints have none.
    model.save_pretrained(out, save_compressed=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
