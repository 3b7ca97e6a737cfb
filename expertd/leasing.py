"""A lease, its index and a check of the served bytes, on the standard library, pyzmq, msgpack and xxhash.

`ExpertClient` takes its lease here; `expertd verify` does all three without importing torch (a control
command answers in a fraction of a second, not after the 2–3 s torch takes to import).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from . import index_segment, messages, procfs
from .errors import Busy, DaemonError, DaemonTimeout, GenerationGone, GenerationLimit, LeaseRevoked, NotReady
from .index import TensorIndex
from .protocol import PROTOCOL_VERSION
from .segments import Placed, map_segment


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


@contextmanager
def pinned(client, generation: int):
    """Generation `generation` of `client`'s daemon kept live while inside: a lease on it over a connection of its own,
    released after. A refresh that asks the new generation's derived layouts keeps the old ones live until they are
    made: with `expert_ranges` the daemon derives only the changed experts' blocks and keeps the old layout's others."""
    from .connection import Connection
    from .option_words import CLI

    conn = Connection(client.endpoint, client.timeout, credentials=client.credentials,
                      words=getattr(client, "words", CLI))
    try:
        try:
            lease = lease_request(conn, generation=generation).client
        except GenerationGone:  # retired already (its leases revoked for a push): nothing of it to keep
            lease = None
        try:
            yield
        finally:
            if lease is not None:
                release(conn, [lease])
    finally:
        conn.close()


def with_room(push, wait_s: float, log=None, on_revoked=None):
    """`push()`, tried again while the daemon refuses it with a GenerationLimit that says when there is room
    (`retry_after_s`: the oldest generation's leases are revoked then, `revoke_after_s`), or as Busy (a reload, a
    successor's check or another pusher's update is building: one at a time), for `wait_s` seconds in all; a
    refusal that names no time, or one past them, is raised. Where the pusher's own lease went with its
    generation's (LeaseRevoked), `on_revoked()` leases anew and the push is tried again, once."""
    deadline, pause, said = time.monotonic() + wait_s, 0.02, False
    while True:
        try:
            return push()
        except Busy as exc:
            if time.monotonic() + pause > deadline:
                raise
            if log is not None and not said:
                log.info("push waits for the daemon's build in progress: %s", exc)
                said = True
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        except LeaseRevoked:
            if on_revoked is None:
                raise
            on_revoked()
            on_revoked = None
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
    not a newer generation's change, which `expertd.index.moved` names), in the index's order."""
    sizes = {s.name: s.nbytes for s in index.segments}
    with Placed(lambda name: map_segment(name, sizes[name], shm_dir=index.shm_dir)) as placed:
        return [e.name for e in index.tensors if e.checksum is not None and placed.checksum(e) != e.checksum]
