"""A lease, its index and a check of the served bytes, on the standard library, pyzmq, msgpack and xxhash.

`ExpertClient` takes its lease here; `expertd verify` does all three without importing torch (a control
command answers in a fraction of a second, not after the 2–3 s torch takes to import).
"""

from __future__ import annotations

import os
import time

from . import index_segment, messages, procfs
from .errors import DaemonError, DaemonTimeout, GenerationLimit, NotReady
from .index import TensorIndex, bytes_checksum, checksum_parts, pieces_checksum
from .protocol import PROTOCOL_VERSION
from .segments import map_segment


def lease_request(conn, **extra) -> messages.LeaseReply:
    """Ask for a lease; the pid namespace and start time let a daemon in the same pid namespace drop it as soon
    as this process is gone (not a lease timeout later)."""
    pid = os.getpid()
    return conn.send(messages.Lease(pid=pid, protocol=PROTOCOL_VERSION, pid_ns=procfs.pid_namespace(),
                                    start_time=procfs.process_start_time(pid), **extra), messages.LeaseReply)


def release(conn, leases: list[str]) -> None:
    """Release leases this client no longer reads (revoked, or lost and taken anew): until then the daemon counts
    what their generations may still map against this client's holder. A daemon that forgot one says nothing."""
    for lease in leases:
        try:
            conn.send(messages.Release(client=lease))
        except (DaemonError, DaemonTimeout):
            pass


def with_room(push, wait_s: float, log=None):
    """`push()`, tried again while the daemon refuses it with a GenerationLimit that says when there is room
    (`retry_after_s`: the oldest generation's leases are revoked then, `revoke_after_s`), for `wait_s` seconds in
    all; a refusal that names no time, or one past them, is raised."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return push()
        except GenerationLimit as exc:
            wait = exc.retry_after_s
            if wait is None or time.monotonic() + wait > deadline:
                raise
            if log is not None:
                log.info("push waits %.1fs for room: %s", wait, exc)
            time.sleep(wait + 0.05)


def leased_index(conn, reply: messages.LeaseReply, timeout: float) -> TensorIndex:
    """The index of the generation lease `reply` reads, waiting up to `timeout` seconds while the daemon loads."""
    return index_segment.read(reply.index_segment or index_place(conn, reply.client, timeout))


def index_place(conn, client: str, timeout: float) -> dict:
    """Where the index segment of lease `client`'s generation lies, asked of the daemon until it has one (a lease
    taken while it loads): a DaemonTimeout after `timeout` seconds of NotReady."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return conn.send(messages.Index(client=client, segment=True), messages.IndexSegmentReply).index_segment
        except NotReady as exc:
            if time.monotonic() > deadline:
                raise DaemonTimeout(f"daemon at {conn.endpoint} still loading after {timeout:.0f}s") from exc
            time.sleep(0.05)


def corrupted_tensors(index: TensorIndex) -> list[str]:
    """Names of the served tensors whose bytes in shared memory no longer hash to the index's checksum (corrupted:
    not a newer generation's change, which `expertd.index.moved` names)."""
    sizes = {s.name: s.nbytes for s in index.segments}
    by_segment: dict[str, list] = {}
    ranged = []
    for entry in index.tensors:
        if entry.checksum is not None and entry.extents:
            ranged.append(entry)
        elif entry.checksum is not None:
            by_segment.setdefault(entry.segment, []).append(entry)
    bad = []
    for name, entries in by_segment.items():
        mapping = map_segment(name, sizes[name], shm_dir=index.shm_dir)
        try:
            for entry in entries:
                data = memoryview(mapping)[entry.offset: entry.offset + entry.nbytes]
                try:
                    if bytes_checksum(data, checksum_parts(entry.checksum)) != entry.checksum:
                        bad.append(entry.name)
                finally:
                    data.release()
        finally:
            mapping.close()
    bad += _corrupted_ranges(ranged, sizes, index.shm_dir)
    order = {entry.name: k for k, entry in enumerate(index.tensors)}
    return sorted(bad, key=order.__getitem__)


def _corrupted_ranges(entries: list, sizes: dict[str, int], shm_dir: str) -> list[str]:
    """`corrupted_tensors` of entries made of several segments' ranges (extents), hashed range by range."""
    maps: dict[str, object] = {}
    try:
        def read(extent):
            if extent.segment not in maps:
                maps[extent.segment] = map_segment(extent.segment, sizes[extent.segment], shm_dir=shm_dir)
            return memoryview(maps[extent.segment])[extent.offset: extent.offset + extent.nbytes]

        return [e.name for e in entries if pieces_checksum(read, e.extents, checksum_parts(e.checksum)) != e.checksum]
    finally:
        for mapping in maps.values():
            mapping.close()
