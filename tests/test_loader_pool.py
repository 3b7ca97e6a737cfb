"""The loader's thread pool: the same bytes, checksums and placement at any thread count, batch and chunk
size; checksums that verify; a failing part stops the build and leaves nothing behind."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from expertd.errors import ConfigError, ShardFormatError
from expertd.procfs import default_threads
from expertd.index import checksum_parts, tensor_checksum
from expertd.server.load import dequant, filling
from expertd.server.shm.arena import Arena
from expertd.server.daemon.config import config_from_dict
from expertd.server.load.building import interleave
from expertd.server.load.loader import build, prepare
from expertd.shm import map_segments, view
from helpers.procfs import open_paths
from helpers.reference import reference_tensors


def served(built) -> dict[str, torch.Tensor]:
    """name -> a copy of each served tensor's bytes, read back through read-only mappings as a worker would."""
    maps = map_segments(built.index.segments, shm_dir=built.index.shm_dir)
    out = {t.name: view(maps, t).clone() for t in built.index.tensors}
    del maps
    return out


def layout(built) -> list[tuple]:
    """Where each tensor lies, by its segment's number in the build (NS.PID.GEN.K.RANDOM: K), not its random name."""
    return [(t.name, t.segment.split(".")[3], t.offset, t.nbytes, t.checksum, tuple(t.sources))
            for t in built.index.tensors]


@pytest.mark.parametrize("writes", [True, False], ids=["pwrite", "through-the-mapping"])
def test_any_thread_count_batch_and_chunk_gives_the_serial_result(tiny_checkpoint, namespace, monkeypatch, writes):
    # pwrite on tmpfs; straight through the daemon's mapping where a folder has no write() (hugetlbfs).
    monkeypatch.setattr(Arena, "writes", property(lambda self: writes))
    serial = build(*prepare(tiny_checkpoint), namespace=namespace, generation=1, threads=1, device="cpu")
    try:
        expected, expected_layout = served(serial), layout(serial)
    finally:
        serial.close()
    # Tiny batches and chunks: many tasks in flight, parts split into 128-row chunks, no part "small".
    for module in (filling, dequant):
        monkeypatch.setattr(module, "BATCH_BYTES", 4096)
        monkeypatch.setattr(module, "CHUNK_BYTES", 4096)
    for threads in (2, 5):
        built = build(*prepare(tiny_checkpoint), namespace=namespace, generation=1, threads=threads, device="cpu")
        try:
            assert layout(built) == expected_layout
            got = served(built)
            for name, t in expected.items():
                assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
        finally:
            built.close()

    # ...and every byte is the reference dequant of its checkpoint tensor, every checksum re-computes.
    ref = reference_tensors(tiny_checkpoint)
    entries = {t.name: t for t in serial.index.tensors}
    fused = 0
    for name, t in expected.items():
        e = entries[name]
        assert tensor_checksum(t, checksum_parts(e.checksum)) == e.checksum
        if len(e.sources) > 1:
            fused += 1
            assert e.checksum.startswith(f"xxh3_64x{len(e.sources)}:")
            parts = t.reshape(len(e.sources), -1)
            for k, src in enumerate(e.sources):
                assert torch.equal(parts[k].view(torch.uint8), ref[src].reshape(-1).view(torch.uint8)), src
        elif e.sources:  # (in the dtype the model loads it as: 5.24's float32 routers, cast from bf16 once)
            want = ref[e.sources[0]].to(t.dtype).reshape(-1)
            assert torch.equal(t.reshape(-1).view(torch.uint8), want.view(torch.uint8)), name
    assert fused > 0


def test_a_failing_part_stops_the_build_and_leaves_nothing(tiny_checkpoint, namespace, tmp_path, monkeypatch):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, folder)
    ckpt, plan = prepare(folder)
    # Truncate the shard holding the last expert weight after planning: its read fails on a pool thread.
    victim = [s for t in plan.tensors for s in t.sources if len(t.sources) > 1][-1]
    os.truncate(victim.info.file, victim.info.offset + victim.info.nbytes // 2)
    monkeypatch.setattr(filling, "BATCH_BYTES", 4096)
    with pytest.raises(ShardFormatError) as err:
        build(ckpt, plan, namespace=namespace, generation=1, threads=3, device="cpu")
    assert os.path.basename(victim.info.file) in str(err.value)
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_stop_request_cancels_queued_parts(tiny_checkpoint, namespace, monkeypatch):
    from expertd.server.load.built import Cancelled

    monkeypatch.setattr(filling, "BATCH_BYTES", 4096)
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) > 5

    with pytest.raises(Cancelled):
        build(*prepare(tiny_checkpoint), namespace=namespace, generation=1, threads=2, device="cpu",
              should_stop=should_stop)
    assert not glob.glob(f"/dev/shm/{namespace}*")


@pytest.mark.parametrize("value", [0, -1, "4", 2.5, True])
def test_load_threads_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="load_threads"):
        config_from_dict({"checkpoint": "/x", "load_threads": value})


def test_load_threads_defaults_to_the_usable_cores():
    assert config_from_dict({"checkpoint": "/x"}).load_threads is None
    assert default_threads() == len(os.sched_getaffinity(0))
    assert config_from_dict({"checkpoint": "/x", "load_threads": 3}).load_threads == 3


def test_interleave_takes_turns_among_width_streams_in_order():
    streams = [[f"a{k}" for k in range(3)], [], ["b0"], [f"c{k}" for k in range(2)], ["d0", "d1"]]
    assert list(interleave(streams, 1)) == ["a0", "a1", "a2", "b0", "c0", "c1", "d0", "d1"]
    # the empty one is passed over
    assert list(interleave(streams, 2)) == ["a0", "a1", "b0", "a2", "c0", "d0", "c1", "d1"]
    assert list(interleave(iter(streams), 9)) == ["a0", "b0", "c0", "d0", "a1", "c1", "d1", "a2"]


def test_small_parts_part_by_part_where_xxhash_exports_no_xxh3(tiny_checkpoint, namespace, monkeypatch):
    """Small parts are gathered and hashed in one compiled call with XXH3_64bits from the xxhash library;
    without that symbol they go part by part in Python: the same bytes and checksums either way."""
    from expertd.kernels import native

    results = []
    for address in (None, "library"):
        if address is None:
            monkeypatch.setattr(native, "_xxh3", [None])
        else:
            monkeypatch.setattr(native, "_xxh3", [])
        built = build(*prepare(tiny_checkpoint), namespace=namespace, generation=1, threads=2, device="cpu")
        try:
            results.append((layout(built), {k: v.view(torch.uint8) for k, v in served(built).items()}))
        finally:
            built.close()
    assert native._xxh3 and native._xxh3[0] is not None  # this machine's xxhash exports it: both ways ran
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])


@pytest.mark.parametrize("how", ["write fails", "stopped"])
def test_a_failed_build_kept_by_its_job_holds_no_segment_pages(tiny_checkpoint, namespace, monkeypatch, how):
    """The daemon keeps a failed job's exception; its frames must not keep the unlinked segments mapped."""
    from expertd.server.serving.jobs import Jobs

    calls = {"n": 0}

    def count() -> bool:
        calls["n"] += 1
        return calls["n"] > 6

    original = os.pwrite

    def failing_pwrite(fd, data, offset):
        if count():
            raise OSError(28, "No space left on device")
        return original(fd, data, offset)

    if how == "write fails":
        monkeypatch.setattr(os, "pwrite", failing_pwrite)
    ckpt, plan = prepare(tiny_checkpoint)
    jobs = Jobs()
    job = jobs.start("load", 1, lambda: build(ckpt, plan, namespace=namespace, generation=1, threads=2, device="cpu",
                                              should_stop=count if how == "stopped" else None))
    job.thread.join(60)
    assert job.state == "failed" and job.exc is not None and calls["n"] > 6
    if how == "write fails":
        assert job.error == "ShmSpaceError" and "no space to write" in job.message
        assert f"segment /{namespace}." in job.message
    assert glob.glob(f"/dev/shm/{namespace}*") == []
    assert open_paths(f"/{namespace}.") == []  # while the job and its exception are still kept


def test_a_build_refused_for_space_closes_its_checkpoint(tiny_checkpoint, namespace, monkeypatch):
    from expertd.errors import ShmSpaceError
    from expertd.server.shm import shmdir

    before = open_paths(os.path.realpath(tiny_checkpoint))
    ckpt, plan = prepare(tiny_checkpoint)
    monkeypatch.setattr(shmdir, "free_bytes", lambda shm: 1 << 20)
    with pytest.raises(ShmSpaceError, match="1.0 MiB free but the model needs"):
        build(ckpt, plan, namespace=namespace, generation=1, threads=2, device="cpu")
    assert open_paths(os.path.realpath(tiny_checkpoint)) == before and glob.glob(f"/dev/shm/{namespace}*") == []
