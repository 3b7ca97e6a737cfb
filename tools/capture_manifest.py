"""A capture folder's manifest: its name, version and how to read it (also from the files alone)."""

from __future__ import annotations

import json
import os

MANIFEST = "manifest.json"
FORMAT = "expertd-capture"
VERSION = 1


def read_manifest(folder: str) -> dict:
    """A capture folder's manifest.json, or one rebuilt from the files' own metadata if it is missing."""
    path = os.path.join(folder, MANIFEST)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    from safetensors import safe_open

    files = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                continue
            entry = {k: json.loads(v) for k, v in meta.items() if k != "format"}
            entry["tensors"] = {}
            for key in f.keys():
                s = f.get_slice(key)
                entry["tensors"][key] = {"dtype": str(s.get_dtype()), "shape": list(s.get_shape())}
        files.append(entry)
    return {"format": FORMAT, "version": VERSION, "files": files}
