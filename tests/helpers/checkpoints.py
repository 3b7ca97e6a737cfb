"""Names in the generated tiny checkpoint, and edits of a copy of a checkpoint."""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"  # FP8, 200x320: partial 128-blocks both ways


def edit_checkpoint(src: str, dst: str, drop=(), replace=None) -> str:
    """A copy of `src` with tensors dropped or replaced (new dtype or shape allowed), shards and index rewritten."""
    shutil.copytree(src, dst)
    replace = replace or {}
    with open(os.path.join(dst, INDEX)) as f:
        index = json.load(f)
    touched = {index["weight_map"][n] for n in [*drop, *replace]}
    for shard in touched:
        tensors = load_file(os.path.join(dst, shard))
        for name in drop:
            tensors.pop(name, None)
        tensors.update({n: t.contiguous() for n, t in replace.items() if index["weight_map"][n] == shard})
        save_file(tensors, os.path.join(dst, shard), metadata={"format": "pt"})
    for name in drop:
        del index["weight_map"][name]
    with open(os.path.join(dst, INDEX), "w") as f:
        json.dump(index, f)
    return dst
