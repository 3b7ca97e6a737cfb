"""gpt-oss in its released MXFP4 layout served through the real daemon and real workers: `*_blocks` + `*_scales`
decoded once to the bf16 experts transformers would make (its own decoder's bits), in any loader chunking;
generations, update() with blocks and scales, convert, inspect and doctor; bad checkpoints refused in one line
naming file, tensor and expectation, nothing left in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertd.client import ExpertClient
from expertd.errors import UpdateRejected
from expertd.server.load import dequant
from expertd.server.cli.commands import main
from expertd.server.load.loader import build, prepare
from expertd.tools.generate import generate_model_type
from expertd.tools.requantize import write_mxfp4
from expertd.shm import map_segments, view
from helpers.daemon import refused_start
from helpers.inputs import INPUT_IDS
from helpers.reference import reference_tensors, write_reference_bf16
from helpers.workers import worker_logits

GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[str, torch.Tensor]:
    """(a tiny gpt-oss checkpoint in MXFP4, logits of from_pretrained on its bf16 reference)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss")
    folder = str(root / "mxfp4")
    generate_model_type(folder, "gpt_oss", fp8=False)
    write_mxfp4(folder)
    reference = AutoModelForCausalLM.from_pretrained(write_reference_bf16(folder, str(root / "reference")),
                                                     dtype=torch.bfloat16)
    with torch.no_grad():
        logits = reference(torch.tensor(INPUT_IDS)).logits
    return folder, logits


def test_worker_logits_equal_transformers(gpt_oss, start_daemon, workers, namespace, tmp_path):
    """Equal to from_pretrained of the reference and to transformers' own MXFP4 load (it dequantizes on CPU)."""
    from transformers import AutoModelForCausalLM

    folder, expected = gpt_oss
    own = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(own(torch.tensor(INPUT_IDS)).logits, expected)
    daemon = start_daemon(folder)
    with ExpertClient(daemon.endpoint) as client:
        assert {t.dtype for t in client.index().tensors} <= {"torch.bfloat16", "torch.float32"}
        served, reference = client.tensors(), reference_tensors(folder)
        for name in (GATE_UP, DOWN):
            assert torch.equal(served[name].view(torch.int16), reference[name].view(torch.int16)), name
        del served
    logits = worker_logits(workers, daemon.endpoint, namespace, str(tmp_path / "worker"))
    assert torch.equal(logits, expected), f"max |diff| {(logits.float() - expected.float()).abs().max()}"


def test_any_chunking_and_thread_count_gives_the_definition(gpt_oss, namespace, monkeypatch):
    """The loader decodes an expert a few groups at a time (CHUNK_BYTES of results): tiny chunks, 1 and 3 threads."""
    folder, _ = gpt_oss
    reference = reference_tensors(folder)
    monkeypatch.setattr(dequant, "CHUNK_BYTES", 4096)
    for threads in (1, 3):
        built = build(*prepare(folder), namespace=namespace, generation=1, threads=threads, device="cpu")
        try:
            maps = map_segments(built.index.segments, shm_dir=built.index.shm_dir)
            for entry in built.index.tensors:
                if entry.name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    got = view(maps, entry)
                    assert torch.equal(got.view(torch.int16), reference[entry.name].view(torch.int16)), entry.name
            del maps, got
        finally:
            built.close()


def test_update_pushes_blocks_and_scales(gpt_oss, start_daemon):
    from expertd.kernels import dequant_mxfp4_reference, quantize_mxfp4

    folder, _ = gpt_oss
    daemon = start_daemon(folder)
    with ExpertClient(daemon.endpoint) as client:
        before = client.tensors()[DOWN].clone()
        blocks, scales = quantize_mxfp4(before.float() * 0.5)
        generation = client.update({DOWN + "_blocks": blocks, DOWN + "_scales": scales})
        client.refresh()
        assert generation == client.generation
        assert torch.equal(client.tensors()[DOWN], dequant_mxfp4_reference(blocks, scales))
        for bad, message in [({DOWN + "_blocks": blocks}, f"need their '{DOWN}_scales'"),
                             ({DOWN + "_blocks": blocks, DOWN + "_scales": scales[:, :, :2]},
                              "cannot make the served")]:
            with pytest.raises(UpdateRejected) as err:
                client.update(bad)
            assert message in str(err.value)


def test_convert_inspect_and_doctor(gpt_oss, tmp_path, capsys):
    folder, _ = gpt_oss
    out = str(tmp_path / "bf16")
    assert main(["convert", folder, out, "--no-progress"]) == 0
    converted = {k: v for f in glob.glob(os.path.join(out, "*.safetensors")) for k, v in load_file(f).items()}
    reference = reference_tensors(folder)
    assert set(converted) == set(reference)
    assert all(torch.equal(converted[n].view(-1).view(torch.uint8), reference[n].view(-1).view(torch.uint8))
               for n in reference)
    report = str(tmp_path / "inspect")
    assert main(["inspect", folder, "--out", report, "--no-plots", "--formats", "bf16"]) == 0
    with open(os.path.join(report, "stats.json")) as f:
        rows = {t["name"]: t for t in json.load(f)["tensors"]}
    assert rows[DOWN + "_blocks"]["format"].startswith("mxfp4") and rows[DOWN + "_blocks"]["values_dtype"] == "bfloat16"
    assert rows[DOWN + "_scales"]["role"] == "scale"
    capsys.readouterr()
    assert main(["doctor", folder]) == 0
    text = capsys.readouterr().out
    assert "uint8+scale -> bfloat16 (bfloat16)" in text and "0 error(s)" in text


def edited(src: str, dst: str, drop=(), replace=None) -> str:
    """A copy of checkpoint folder `src` with tensors dropped or replaced (the index kept consistent)."""
    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(path)
        if set(drop) & set(tensors) or set(replace or {}) & set(tensors):
            kept = {k: (replace or {}).get(k, v) for k, v in tensors.items() if k not in drop}
            save_file(kept, path, metadata={"format": "pt"})
    index = os.path.join(dst, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in drop}
    with open(index, "w") as f:
        json.dump(data, f)
    return dst


def _blocks(folder: str) -> torch.Tensor:
    return next(v for f in glob.glob(os.path.join(folder, "*.safetensors"))
                for k, v in load_file(f).items() if k == DOWN + "_blocks")


BAD = {
    "blocks-without-scales": (dict(drop=[DOWN + "_scales"]), "ScaleError", DOWN + "_blocks",
                              f"MXFP4 blocks have no '{DOWN}_scales'"),
    "scales-without-blocks": (dict(drop=[DOWN + "_blocks"]), "ScaleError", DOWN + "_scales",
                              f"MXFP4 scales have no '{DOWN}_blocks'"),
    "odd-group-size": ("halve", "ShapeError", DOWN + "_blocks", "must be uint8 [..., rows, groups, 16]"),
    "scales-misshapen": ("scales", "ScaleError", DOWN + "_scales", "MXFP4 scales must be uint8 [8, 192, 10]"),
    "scale-nan": ("nan", "ScaleError", DOWN + "_scales", "e8m0 scale byte 0xff (NaN)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_are_refused_in_one_line(case, gpt_oss, tmp_path, namespace):
    folder, _ = gpt_oss
    edit, error, where, message = BAD[case]
    if isinstance(edit, dict):
        folder = edited(folder, str(tmp_path / "ckpt"), **edit)
    else:
        blocks = _blocks(folder)
        scales = next(v for f in glob.glob(os.path.join(folder, "*.safetensors"))
                      for k, v in load_file(f).items() if k == DOWN + "_scales")
        replace = {"halve": {DOWN + "_blocks": blocks[..., :8].contiguous()},
                   "scales": {DOWN + "_scales": scales[:, :, :5].contiguous()},
                   "nan": {DOWN + "_scales": scales.clone().index_fill_(2, torch.tensor([3]), 0xFF)}}[edit]
        folder = edited(folder, str(tmp_path / "ckpt"), replace=replace)
    refused_start(tmp_path, folder, namespace, error, where, message)
