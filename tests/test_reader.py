"""Checkpoint reading and whole-checkpoint validation, each failure naming file and tensor."""

import json
import os
import shutil
import struct

import pytest
import torch

from expertd.errors import (
    CheckpointError,
    MissingShardError,
    MissingTensorError,
    NotACheckpointError,
    ScaleError,
    ShapeError,
    ShardFormatError,
    UnsupportedDtypeError,
)
from expertd.server.load.layout import plan_checkpoint
from expertd.server.load.checkpoint import Checkpoint, read_shard_header
from helpers.checkpoints import EXPERT

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint to break."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, dst)
    return dst


def weight_map(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def rewrite_header(path, edit):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def validate(folder):
    return plan_checkpoint(Checkpoint.open(folder))


def test_tiny_checkpoint_plans_fused_experts(tiny_checkpoint):
    plan = validate(tiny_checkpoint)
    assert plan.layout == "transformers-fused" and plan.codec.block_size == (128, 128)
    by_name = {t.name: t for t in plan.tensors}
    gate_up = by_name["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 400, 320) and gate_up.dtype == torch.bfloat16
    assert [s.name for s in gate_up.sources[:3]] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
    ]
    assert by_name["model.layers.1.mlp.experts.down_proj"].shape == (8, 320, 200)
    assert by_name["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # the scale of at least one weight sits in another shard than the weight
    wm = weight_map(tiny_checkpoint)
    assert any(wm[n] != wm[n + "_scale_inv"] for n in wm if n + "_scale_inv" in wm)


def test_single_file_checkpoint(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    single = str(tmp_path / "single")
    os.makedirs(single)
    tensors = {}
    for shard in set(weight_map(ckpt).values()):
        tensors.update(load_file(os.path.join(ckpt, shard)))
    save_file(tensors, os.path.join(single, "model.safetensors"))
    shutil.copy(os.path.join(ckpt, "config.json"), single)
    assert len(validate(single).tensors) == len(validate(ckpt).tensors)


def test_read_one_tensor(tiny_checkpoint):
    c = Checkpoint.open(tiny_checkpoint)
    t = c.read(EXPERT)
    assert t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (200, 320)
    with pytest.raises(MissingTensorError, match="nope"):
        c.read("nope")


def test_header_parsing_checks_offsets(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "a.safetensors")
    save_file({"x": torch.zeros(4, 4), "y": torch.ones(3)}, path)
    infos = read_shard_header(path)
    assert infos["x"].shape == (4, 4) and infos["y"].nbytes == 12


def _shard_of(folder, name):
    return os.path.join(folder, weight_map(folder)[name])


def _drop_tensor(folder, name):
    """Remove a tensor from its shard's header and from the index (the bytes stay, unreferenced)."""
    rewrite_header(_shard_of(folder, name), lambda h: h.pop(name))
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    del index["weight_map"][name]
    with open(path, "w") as f:
        json.dump(index, f)


def _set_entry(folder, name, **fields):
    rewrite_header(_shard_of(folder, name), lambda h: h[name].update(fields))


def _repeat_key(folder, name, field=None):
    """Write a key twice in `name`'s shard header: the tensor's whole entry, or one of its fields."""
    path = _shard_of(folder, name)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    text = json.dumps(header)
    opening = json.dumps(name) + ": {"
    if field is None:
        copy = json.dumps({name: header[name]})[1:-1]
        text = "{" + copy + ", " + text[1:]
    else:
        at = text.index(opening) + len(opening)
        text = text[:at] + json.dumps(field) + ": " + json.dumps(header[name][field]) + ", " + text[at:]
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _write_scale(folder, name, value):
    from safetensors.torch import load_file, save_file

    path = _shard_of(folder, name)
    tensors = load_file(path)
    tensors[name] = value
    save_file(tensors, path)


def _truncate(folder, name):
    path = _shard_of(folder, name)
    os.truncate(path, os.path.getsize(path) - 1000)


def _index_json(folder, text):
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(text)


def _config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def _duplicate(folder, name):
    """Put a copy of `name` into a second shard's header too."""
    from safetensors.torch import load_file, save_file

    shards = sorted(set(weight_map(folder).values()))
    other = next(s for s in shards if s != weight_map(folder)[name])
    tensors = load_file(os.path.join(folder, other))
    tensors[name] = load_file(_shard_of(folder, name))[name]
    save_file(tensors, os.path.join(folder, other))


def _bf16_with_scale(folder):
    """A bf16 weight that still has a `*_scale_inv` beside it."""
    from safetensors.torch import load_file, save_file

    name = "model.layers.0.self_attn.q_a_proj.weight"
    path = _shard_of(folder, name)
    tensors = load_file(path)
    tensors[name] = tensors[name].float().bfloat16()
    save_file(tensors, path)


SCALE = EXPERT + "_scale_inv"
BAD_CHECKPOINTS = [
    # (id, how to break it, error type, what the message must name)
    ("missing-shard", lambda f: os.unlink(_shard_of(f, EXPERT)), MissingShardError, "model-0000"),
    ("truncated-shard", lambda f: _truncate(f, EXPERT), ShardFormatError, "past the end"),
    ("header-offsets-past-end", lambda f: _set_entry(f, EXPERT, data_offsets=[0, 10**12]), ShardFormatError, EXPERT),
    ("header-overlap", lambda f: _set_entry(f, EXPERT, data_offsets=[0, 200 * 320]), ShardFormatError, "overlaps"),
    ("header-bad-json",
     lambda f: rewrite_header(_shard_of(f, EXPERT), lambda h: None) or _corrupt_json(_shard_of(f, EXPERT)),
     ShardFormatError, "not valid JSON"),
    ("index-not-json", lambda f: _index_json(f, "{not json"), CheckpointError, "model.safetensors.index.json"),
    ("index-names-absent",
     lambda f: _index_json(f, json.dumps({"weight_map": {**weight_map(f), "ghost.weight": weight_map(f)[EXPERT]}})),
     MissingTensorError, "ghost.weight"),
    ("fp8-without-scale", lambda f: _drop_tensor(f, SCALE), ScaleError, EXPERT),
    ("scale-wrong-shape", lambda f: _write_scale(f, SCALE, torch.ones(1, 3)), ScaleError, "expected [2, 3]"),
    ("scale-wrong-dtype", lambda f: _write_scale(f, SCALE, torch.ones(2, 3, dtype=torch.float64)), ScaleError,
     "float32"),
    ("scale-nan", lambda f: _write_scale(f, SCALE, torch.tensor([[1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]])),
     ScaleError, SCALE),
    ("scale-inf", lambda f: _write_scale(f, SCALE, torch.full((2, 3), float("inf"))), ScaleError, "non-finite"),
    ("scale-zero", lambda f: _write_scale(f, SCALE, torch.zeros(2, 3)), ScaleError, "non-positive"),
    ("unsupported-dtype", lambda f: _set_entry(f, EXPERT, dtype="C64"), UnsupportedDtypeError, "C64"),
    ("fp8-e5m2-weight", lambda f: _set_entry(f, EXPERT, dtype="F8_E5M2"), UnsupportedDtypeError, EXPERT),
    ("scale-beside-bf16", _bf16_with_scale, ScaleError, "not an FP8 one"),
    ("duplicate-across-shards", lambda f: _duplicate(f, EXPERT), CheckpointError, "duplicate"),
    ("duplicate-name-in-header", lambda f: _repeat_key(f, EXPERT), ShardFormatError, f"duplicate key '{EXPERT}'"),
    ("duplicate-field-in-header", lambda f: _repeat_key(f, EXPERT, "dtype"), ShardFormatError, "duplicate key 'dtype'"),
    ("config-missing", lambda f: os.unlink(os.path.join(f, "config.json")), NotACheckpointError, "has no config.json"),
    ("config-not-matching", lambda f: _config(f, hidden_size=384), ShapeError, "does not match"),
    ("expert-missing", lambda f: _drop_tensor(f, EXPERT), MissingTensorError, EXPERT),
    ("expert-count", lambda f: _config(f, n_routed_experts=10, n_group=2), MissingTensorError, "experts.8."),
    ("expert-shape", lambda f: _set_entry(f, EXPERT, shape=[100, 640]), ShapeError, EXPERT),
]


def _corrupt_json(path):
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"#")


@pytest.mark.parametrize("break_it, error, names", [row[1:] for row in BAD_CHECKPOINTS],
                         ids=[row[0] for row in BAD_CHECKPOINTS])
def test_bad_checkpoint_is_a_typed_error_naming_the_problem(ckpt, break_it, error, names):
    break_it(ckpt)
    with pytest.raises(error) as info:
        validate(ckpt)
    assert names in str(info.value)


def test_checkpoint_path_that_is_not_a_folder(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(MissingShardError, match="not a folder"):
        validate(str(path))
