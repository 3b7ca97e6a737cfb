"""Shared-memory segments: naming, permissions, reservation, placement, clean removal."""

import glob
import os
import stat

import pytest
import torch

from expertd.segments import map_segment
from expertd.shm import segment_bytes, view
from expertd.errors import ShmError, ShmSpaceError
from expertd.index import TensorEntry
from expertd.server.shm import arena as arena_mod
from expertd.server.shm.arena import ALIGN, Arena

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)


def test_segments_are_private_reserved_and_removed(namespace):
    arena = Arena(namespace, 1, segment_bytes=3 * ALIGN)
    places = arena.place([10, ALIGN + 1, 5, 7 * ALIGN])
    assert [p.offset for p in places] == [0, ALIGN, 0, 0]
    assert len(arena.segments) == 3  # the big one gets a segment of its own
    assert all(s.name.startswith(f"/{namespace}.{os.getpid()}.1.") for s in arena.segments)
    arena.create()
    try:
        for seg in arena.segments:
            st = os.stat("/dev/shm" + seg.name)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_size == seg.nbytes
            assert st.st_blocks * 512 >= seg.nbytes  # posix_fallocate reserved the pages
        t = arena.tensor(places[1], (3, 4), torch.bfloat16)
        t.copy_(torch.arange(12, dtype=torch.bfloat16).view(3, 4))
        del t
        arena.unmap()
        # a reader maps it read-only and sees the bytes
        seg0 = arena.segments[0]
        segments = {seg0.name: segment_bytes(map_segment(seg0.name, seg0.nbytes))}
        v = view(segments, TensorEntry("t", seg0.name, ALIGN, 24, [3, 4], "torch.bfloat16"))
        assert torch.equal(v, torch.arange(12, dtype=torch.bfloat16).view(3, 4))
    finally:
        arena.unlink()
    assert not glob.glob(f"/dev/shm/{namespace}*")
    # the reader's mapping outlives the unlink
    assert float(v.sum()) == 66.0


def test_not_enough_shm_is_a_clear_error_and_leaves_nothing(namespace, monkeypatch):
    monkeypatch.setattr(arena_mod.shmdir, "free_bytes", lambda shm: 64 << 20)
    arena = Arena(namespace, 1, segment_bytes=1 << 30)
    arena.place([100 << 20])
    with pytest.raises(ShmSpaceError, match=r"64.0 MiB free.*100.0 MiB.*--shm-size"):
        arena.create()
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_group_deployment_makes_segments_group_readable(namespace):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    arena = Arena(namespace, 1, segment_bytes=1 << 20, group=group)
    arena.place([100])
    arena.create()
    try:
        st = os.stat("/dev/shm" + arena.segments[0].name)
        assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()
    finally:
        arena.unlink()


@pytest.mark.parametrize("fails", ["posix_fallocate", "mmap"])
def test_a_segment_that_fails_after_creation_is_removed(namespace, monkeypatch, fails):
    def no_space(*args, **kwargs):
        raise OSError(28 if fails == "posix_fallocate" else 12, "No space left on device")

    monkeypatch.setattr(arena_mod.os if fails == "posix_fallocate" else arena_mod.mmap, fails, no_space)
    arena = Arena(namespace, 1)
    with pytest.raises(ShmSpaceError, match=rf"segment /{namespace}\.\d+\.1\.000\.[0-9a-f]{{16}} in /dev/shm"):
        arena.add(1 << 20)
    assert glob.glob(f"/dev/shm/{namespace}*") == [] and arena.segments == []
    monkeypatch.undo()
    placement = arena.add(1 << 20)  # the same number again: nothing of the failed one is in the way
    assert placement.segment.rsplit(".", 1)[0].endswith(".1.000")
    arena.unmap()
    arena.unlink()


def test_a_segment_name_taken_by_another_file_is_left_alone_and_another_drawn(namespace, monkeypatch):
    arena = Arena(namespace, 1)
    names = iter(["0" * 16, "0" * 16, "1" * 16])  # the first two draws are the planted name
    monkeypatch.setattr(arena_mod.secrets, "token_hex", lambda n: next(names))
    other = f"/dev/shm/{namespace}.{os.getpid()}.1.000.{'0' * 16}"
    with open(other, "wb") as f:
        f.write(b"not ours")
    try:
        placement = arena.add(4096)
        assert placement.segment == f"/{namespace}.{os.getpid()}.1.000.{'1' * 16}"
        assert [s.name for s in arena.segments] == [placement.segment]
        arena.unmap()
        arena.unlink()
        assert open(other, "rb").read() == b"not ours"
        assert not os.path.exists(f"/dev/shm/{placement.segment[1:]}")
    finally:
        os.unlink(other)


def test_planned_placements_follow_their_segment_to_a_fresh_name(namespace, monkeypatch):
    arena = Arena(namespace, "u1", segment_bytes=2 * ALIGN)
    places = arena.place([10, 20])
    planted = f"/dev/shm/{places[0].segment[1:]}"
    open(planted, "wb").close()
    try:
        arena.create(private=True)
        assert places[0].segment == places[1].segment == arena.segments[0].name != "/" + os.path.basename(planted)
        assert stat.S_IMODE(os.stat(f"/dev/shm/{arena.segments[0].name[1:]}").st_mode) == 0o600
        arena.unmap()
        arena.unlink()
        assert os.path.exists(planted)
    finally:
        os.unlink(planted)


def test_a_name_taken_every_time_gives_up_after_a_few_draws(namespace, monkeypatch):
    arena = Arena(namespace, 1)
    monkeypatch.setattr(arena_mod.secrets, "token_hex", lambda n: "0" * 16)
    other = f"/dev/shm/{namespace}.{os.getpid()}.1.000.{'0' * 16}"
    open(other, "wb").close()
    try:
        with pytest.raises(ShmError, match="random names in a row were taken"):
            arena.add(4096)
        assert arena.segments == [] and os.path.exists(other)
    finally:
        os.unlink(other)
