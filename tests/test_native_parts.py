"""The loader's whole-task compiled calls (`server/native_parts.py`, `kernels/fill_batch.c`): the same served bytes,
checksums and placement as the Python path part by part, on every format the table covers and through both ways
of writing; a shard that ends early is named, and nothing is left behind."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from expertd.errors import ShardFormatError
from expertd.kernels import native
from expertd.server import native_parts
from expertd.server.arena import Arena
from expertd.server.loader import build, prepare
from expertd.tools.generate import generate_model_type, quantize_saved_checkpoint
from helpers.reference import reference_tensors
from test_loader_pool import layout, served

pytestmark = pytest.mark.skipif(not native.can_fill_batch(), reason="no C compiler or XXH3 streaming functions")


def built_both_ways(folder: str, namespace: str, monkeypatch, threads: int = 2):
    """(layout, served bytes, how many parts went through the compiled calls) of a build with them, then without."""
    out, taken = [], []
    original = native_parts.fill_native

    def counting(parts, *args, **kwargs):
        taken.append(len(parts))
        return original(parts, *args, **kwargs)

    monkeypatch.setattr(native_parts, "fill_native", counting)
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(native_parts, "usable", lambda device: False)
        built = build(*prepare(folder), namespace=namespace, generation=1, threads=threads, device="cpu")
        try:
            out.append((layout(built), served(built)))
        finally:
            built.close()
    return out[0], out[1], sum(taken)


def assert_same(first, second) -> None:
    assert first[0] == second[0]  # names, segments, offsets, checksums, sources
    for name, t in second[1].items():
        assert torch.equal(first[1][name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("writes", [True, False], ids=["pwrite", "through-the-mapping"])
def test_every_part_in_compiled_calls_gives_the_python_paths_bytes(tiny_checkpoint, namespace, monkeypatch, writes):
    # Every FP8 part taken (none left to small_parts), pieces of 4 KiB: 6 rows of 320 columns, so pieces end
    # inside 128-row scale blocks and tensors of 200 or 576 rows end in partial blocks.
    monkeypatch.setattr(Arena, "writes", property(lambda self: writes))
    monkeypatch.setattr(native_parts, "SMALL_RESULT", 0)
    monkeypatch.setattr(native_parts, "CHUNK_BYTES", 4096)
    compiled, python, taken = built_both_ways(tiny_checkpoint, namespace, monkeypatch, threads=3)
    assert taken > 80  # the experts, the dense and attention weights, the plain tensors
    assert_same(compiled, python)
    ref = reference_tensors(tiny_checkpoint)
    for entry in compiled[0]:
        name, sources = entry[0], entry[5]
        if len(sources) > 1:
            parts = compiled[1][name].reshape(len(sources), -1)
            for k, src in enumerate(sources):
                assert torch.equal(parts[k].view(torch.uint8), ref[src].reshape(-1).view(torch.uint8)), src


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
def test_compressed_tensors_scales_in_compiled_calls(scheme, tmp_path, namespace, monkeypatch):
    # bf16 scales beside their weights, one per output channel, one per tensor, or per 128x128 block.
    folder = str(tmp_path / scheme)
    generate_model_type(folder, "qwen3_moe", fp8=False)
    quantize_saved_checkpoint(folder, torch.bfloat16, scheme=scheme)
    monkeypatch.setattr(native_parts, "SMALL_RESULT", 0)
    compiled, python, taken = built_both_ways(folder, namespace, monkeypatch)
    assert taken > 0
    assert_same(compiled, python)


def test_a_shard_that_ends_early_names_its_file_and_tensor(tiny_checkpoint, namespace, tmp_path, monkeypatch):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, folder)
    ckpt, plan = prepare(folder)
    monkeypatch.setattr(native_parts, "SMALL_RESULT", 0)
    # The shard's end cut off in the middle of the last expert weight, after planning: the compiled read stops.
    victim = max((s for t in plan.tensors for s in t.sources if len(t.sources) > 1),
                 key=lambda s: (s.info.file, s.info.offset))
    os.truncate(victim.info.file, victim.info.offset + victim.info.nbytes // 2)
    with pytest.raises(ShardFormatError) as err:
        build(ckpt, plan, namespace=namespace, generation=1, threads=2, device="cpu")
    assert os.path.basename(victim.info.file) in str(err.value)
    assert "truncated" in str(err.value)
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_a_bad_scale_is_named_before_any_byte_of_its_task_is_written(tiny_checkpoint, namespace, tmp_path,
                                                                      monkeypatch):
    from safetensors.torch import load_file, save_file

    from expertd.errors import ScaleError

    folder = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, folder)
    ckpt, plan = prepare(folder)
    victim = [s for t in plan.tensors for s in t.sources if s.scale is not None][-1]
    ckpt.close()
    tensors = load_file(victim.scale.file)
    tensors[victim.scale.name] = tensors[victim.scale.name].clone()
    tensors[victim.scale.name].view(-1)[0] = 0.0
    save_file(tensors, victim.scale.file, metadata={"format": "pt"})
    monkeypatch.setattr(native_parts, "SMALL_RESULT", 0)
    monkeypatch.setattr("expertd.server.layout.check_scale_values", lambda *a: None)  # planning lets it through
    with pytest.raises(ScaleError) as err:
        build(*prepare(folder), namespace=namespace, generation=1, threads=2, device="cpu")
    assert victim.scale.name in str(err.value)
    assert not glob.glob(f"/dev/shm/{namespace}*")
