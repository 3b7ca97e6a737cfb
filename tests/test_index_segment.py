"""The index segment: each generation's index, pre-packed by the daemon in a read-only segment named in
lease replies. Real daemon and worker processes, real shared memory; corrupted segments are typed errors."""

from __future__ import annotations

import glob
import mmap
import os
import re
import signal
import stat
import subprocess
import time

import posix_ipc
import pytest

from expertd import index_segment
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import CorruptIndex, ProtocolError, ShmError
from expertd.index import TensorIndex
from expertd.protocol import PROTOCOL_VERSION
from expertd.server.shm.arena import segment_pattern
from expertd.server.serving.generations import place_index
from helpers.daemon import DaemonProcess, expertd_cmd
from test_index import sample


def index_files(namespace: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/{namespace}.*.i*.*"))


def is_index(name: str, namespace: str, pid: int, generation: int) -> bool:
    """Whether `name` is the index segment of `generation` made by `pid` (its last part random: nobody can plant it)."""
    return re.fullmatch(rf"/{namespace}\.{pid}\.i{generation}\.000\.[0-9a-f]{{16}}", name) is not None


def test_workers_attach_through_the_segment_and_it_lives_as_long_as_its_generation(tiny_checkpoint, tmp_path,
                                                                                 namespace, workers):
    daemon = DaemonProcess.launch(tmp_path, tiny_checkpoint, namespace)
    try:
        status = daemon.wait_serving()
        name = status["index_segment"]
        assert is_index(name, namespace, daemon.proc.pid, 1) and index_files(namespace) == [name[1:]]
        m = segment_pattern(namespace).match(name[1:])  # what the start-up reaper matches
        assert m and int(m.group(1)) == daemon.proc.pid
        assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600  # as the tensors' segments
        conn = Connection(daemon.endpoint, timeout=10)
        lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)
        assert lease["index_segment"]["segment"] == name and lease["index_segment"]["generation"] == 1
        inline = TensorIndex.from_dict(conn.request("index", client=lease["client"])["index"])  # tools' path
        assert index_segment.read(lease["index_segment"]) == inline  # the same index either way
        conn.request("release", client=lease["client"])
        conn.close()

        worker = workers(daemon.endpoint, model=True, namespace=namespace)  # a real worker, through the segment
        assert worker.hello["ready"] and worker.hello["outside"] == []
        assert worker.ask("measure")  # mapped what it serves from; the index segment is read and let go
        worker.ask("exit")
        assert worker.proc.wait(60) == 0

        dead = daemon.proc.pid
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        assert index_files(namespace) == [name[1:]]  # a crash leaves the index segment behind ...
    finally:
        daemon.stop()
    successor = DaemonProcess.launch(tmp_path, tiny_checkpoint, namespace, lease_timeout_s=2)
    try:
        status = successor.wait_serving()  # ... the next start adopts generation 1 and places its index anew,
        held_until = time.monotonic() + 2.0  # and holds it one lease timeout (2 s, from before it served) for workers
        assert status["generation"] == 1  # reaping the dead daemon's index segment
        assert [is_index("/" + n, namespace, successor.proc.pid, 1) for n in index_files(namespace)] == [True]
        assert not glob.glob(f"/dev/shm/{namespace}.{dead}.i*")
        conn = Connection(successor.endpoint, timeout=10)  # the adopted generation is held a lease timeout for
        while conn.request("status")["leases"]:  # workers coming back (no request may name it); none comes
            time.sleep(0.1)
        while conn.request("status")["job"]["state"] == "building":  # the check of the checkpoint, after adopting
            time.sleep(0.1)
        conn.close()
        time.sleep(max(0.0, held_until - time.monotonic()))  # re-taking leases: the hold has ended
        reload = subprocess.run(expertd_cmd("reload", "--config", successor.config), capture_output=True,
                                text=True, timeout=120)
        assert reload.returncode == 0, reload.stderr
        # no lease holds generation 1: it retires at once, its index segment with it
        name = successor.status()["index_segment"]
        assert is_index(name, namespace, successor.proc.pid, 2) and index_files(namespace) == [name[1:]]
    finally:
        assert successor.stop() == 0
    assert not glob.glob(f"/dev/shm/{namespace}*")  # stop leaves nothing


def test_a_client_given_a_corrupted_index_segment_gets_a_typed_error(tiny_checkpoint, start_daemon, namespace):
    daemon = start_daemon(tiny_checkpoint)
    name = daemon.status()["index_segment"]
    shm = posix_ipc.SharedMemory(name, 0)  # the test is the segment's owner: it may write where workers cannot
    with mmap.mmap(shm.fd, shm.size) as raw:
        shm.close_fd()
        raw[200] ^= 0xFF
        with ExpertClient(daemon.endpoint, heartbeat=False) as client:
            with pytest.raises(CorruptIndex, match="fails its checksum"):
                client.index()
        raw[200] ^= 0xFF
        with ExpertClient(daemon.endpoint, heartbeat=False) as client:
            assert client.index().generation == 1  # restored: read as before


@pytest.fixture
def placed(namespace):
    """The sample index placed in a segment of `namespace` the way the daemon places one."""
    index = sample()
    index.namespace = namespace
    desc = place_index(index)
    yield index, desc
    posix_ipc.unlink_shared_memory(desc["segment"])


def _rewrite(desc: dict, change) -> None:
    shm = posix_ipc.SharedMemory(desc["segment"], 0)
    try:
        with mmap.mmap(shm.fd, shm.size) as raw:
            change(raw)
    finally:
        shm.close_fd()


def test_segment_round_trip_and_read_only_mode(placed, namespace):
    index, desc = placed
    assert index_segment.read(desc) == index
    assert stat.S_IMODE(os.stat("/dev/shm" + desc["segment"]).st_mode) == 0o600
    assert is_index(desc["segment"], namespace, os.getpid(), 3) and desc["generation"] == 3


@pytest.mark.parametrize("damage, error, match", [
    (lambda raw: raw.__setitem__(slice(40, 41), bytes([raw[40] ^ 1])), CorruptIndex, "fails its checksum"),
    (lambda raw: raw.__setitem__(slice(0, 8), b"NOTINDEX"), CorruptIndex, "header"),
    (lambda raw: raw.__setitem__(slice(8, 16), (7).to_bytes(8, "little")), CorruptIndex, "holds generation 7"),
    (lambda raw: raw.__setitem__(slice(16, 24), (5).to_bytes(8, "little")), CorruptIndex, "payload bytes"),
    (lambda raw: raw.__setitem__(slice(24, 32), bytes(8)), CorruptIndex, "header checksum"),
])
def test_damaged_segment_is_a_corrupt_index(placed, damage, error, match):
    _, desc = placed
    _rewrite(desc, damage)
    with pytest.raises(error, match=match):
        index_segment.read(desc)


def test_truncated_stale_or_missing_segment_is_a_typed_error(placed):
    _, desc = placed
    with pytest.raises(CorruptIndex, match="announced generation 4|holds generation 3"):
        index_segment.read({**desc, "generation": 4})  # a descriptor of another generation: stale
    with pytest.raises(CorruptIndex, match="header checksum"):
        index_segment.read({**desc, "checksum": "xxh3_64:0000000000000000"})
    with pytest.raises(ProtocolError, match="malformed index segment descriptor"):
        index_segment.read({**desc, "nbytes": "many"})
    with pytest.raises(ShmError, match="does not exist"):
        index_segment.read({**desc, "segment": desc["segment"] + "x"})
    for outside in ("/../etc/passwd", "/a/b", "/..", "///"):  # a name that would leave shm_dir
        with pytest.raises(ShmError, match="is not a file name in /dev/shm"):
            index_segment.read({**desc, "segment": outside})
    shm = posix_ipc.SharedMemory(desc["segment"], 0)
    os.ftruncate(shm.fd, 4096 if desc["nbytes"] > 4096 else desc["nbytes"] // 2)
    shm.close_fd()
    with pytest.raises(CorruptIndex, match="truncated"):
        index_segment.read(desc)
    assert isinstance(CorruptIndex("x"), ProtocolError)  # callers that catch ProtocolError keep working
