"""The loader's whole-task compiled calls (`server/load/native_parts.py`, `kernels/fill_batch.c`): the same served
bytes, checksums and placement as the Python path part by part, on every format the table covers and through both ways
of writing; a shard that ends early is named, and nothing is left behind."""

from __future__ import annotations

import glob
import os
import shutil
from array import array

import pytest
import torch

from expertd.errors import ShardFormatError
from expertd.kernels import native
from expertd.server.load import native_parts
from expertd.server.shm.arena import Arena
from expertd.server.load.loader import build, prepare
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
    monkeypatch.setattr("expertd.server.load.layout.check_scale_values", lambda *a: None)  # planning lets it through
    with pytest.raises(ScaleError) as err:
        build(*prepare(folder), namespace=namespace, generation=1, threads=2, device="cpu")
    assert victim.scale.name in str(err.value)
    assert not glob.glob(f"/dev/shm/{namespace}*")


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_table_is_the_references_for_every_code_and_scale(scale_dtype, tmp_path):
    """Every fp8 byte under scales that make subnormal, overflowing and NaN results (fp16 scales subnormal too),
    read from files and dequantized by one compiled call: the reference's bits, and XXH3 of source, result and
    scales."""
    import xxhash

    from expertd.kernels import weight_dequant_reference

    values = {torch.float32: [2.0**-140, 2.0**-7, 0.3, 1.0, 3.0e5, 2.0**120],
              torch.bfloat16: [2.0**-130, 2.0**-7, 0.3, 1.0, 3.0e5, 2.0**120],
              torch.float16: [2.0**-24, 2.0**-17, 0.3, 1.0, 1000.0, 65504.0]}[scale_dtype]
    block = (4, 64)
    m, n = 4 * len(values), 256  # one row of every code, 4 rows a scale; 4 blocks of 64 columns
    codes = torch.arange(256, dtype=torch.uint8).repeat(m, 1)
    codes[1::2] = codes[1::2].flip(1)
    scales = torch.tensor(values, dtype=scale_dtype).reshape(-1, 1).repeat(1, 4).contiguous()  # [rows / 4, 4]
    (tmp_path / "x").write_bytes(b"pad" + codes.numpy().tobytes())
    (tmp_path / "s").write_bytes(b"padpad" + scales.view(torch.uint8).numpy().tobytes())
    out = torch.empty(m, n, dtype=torch.bfloat16)
    fds = [os.open(tmp_path / name, os.O_RDONLY) for name in ("x", "s")]
    try:
        desc = array("q", [native.FILL_LUT16, fds[0], 3, m, n, -1, out.data_ptr(), fds[1], 6, *block,
                           native.FILL_SCALE_DTYPES[scale_dtype], 0, 0])
        hashes = array("Q", [0, 0, 0])
        sizes = (1024, 1024, 8 * scales.numel(), 512 * scales.numel())  # pieces of 1 KiB: 2 rows
        buffers = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        done = native.fill_batch(desc, *(b.data_ptr() for b in buffers), 1024, hashes)
    finally:
        for fd in fds:
            os.close(fd)
    assert done == 1, list(desc)
    want = weight_dequant_reference(codes.view(torch.float8_e4m3fn), scales.float(), block, out_dtype=torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert bool(torch.isinf(want.float()).any()) == (scale_dtype != torch.float16)  # overflowing products seen
    got = list(hashes)
    want_hashes = [xxhash.xxh3_64_intdigest(t.view(torch.uint8).numpy().tobytes()) for t in (codes, out, scales)]
    assert got == want_hashes


def test_a_scale_that_is_not_finite_and_positive_stops_the_call_at_its_part(tmp_path):
    (tmp_path / "x").write_bytes(bytes(range(256)) * 2)
    (tmp_path / "s").write_bytes(torch.tensor([1.0, 0.0, 2.0, float("nan")]).numpy().tobytes())
    out = torch.empty(2, 256, dtype=torch.bfloat16)
    fds = [os.open(tmp_path / name, os.O_RDONLY) for name in ("x", "s")]
    try:
        desc = array("q", [field for k in range(2) for field in
                           (native.FILL_LUT16, fds[0], 0, 1, 256, -1, out.data_ptr(), fds[1], 8 * k, 1, 128, 0, 0, 0)])
        buffers = [torch.empty(4096, dtype=torch.uint8) for _ in range(4)]
        done = native.fill_batch(desc, *(b.data_ptr() for b in buffers), 4096, array("Q", bytes(48)))
    finally:
        for fd in fds:
            os.close(fd)
    assert done == 0 and desc[12] == native.FILL_ERR_SCALE and desc[13] == 1  # its second scale, 0.0
