"""The client's lease shared with its heartbeat thread: every change is atomic, none is lost, none leaks a lease.

The heartbeat thread replaces the lease (a revoked one moved on from, a lost one resumed) while refresh() and close()
read and replace it on the caller's thread. These tests run both sides against each other many times and check what
holds only under `LeaseState`'s lock: a snapshot never mixes two leases, a replacement is made by one thread only, and
every lease granted is released exactly once (none leaked by close()). Thread switches are forced every microsecond,
and the lease ids (`Lease`) and index places (`Place`) let the other threads run when compared or dropped: a step
that compares the lease and then writes, or writes the place and then more, is interleaved with the other thread's
whenever no lock keeps that one out (CPython would otherwise run those few bytecodes at one go, hiding a missing
lock).
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

import expertd.client.client as client_module
from expertd import replies
from expertd.client import ExpertClient
from expertd.client.lease_state import LeaseState
from expertd.connection import Connection
from expertd.errors import LeaseExpired

ROUNDS = 3000


class Lease(str):
    """A lease id whose every comparison lets the other threads run (the GIL released)."""

    def __eq__(self, other):
        time.sleep(0)
        return str.__eq__(self, other)

    def __ne__(self, other):
        time.sleep(0)
        return str.__ne__(self, other)

    __hash__ = str.__hash__


class Place(dict):
    """An index place whose dropping (when the state replaces it, its last reference gone) lets the other threads run,
    as finalizers of what a replaced index held may."""

    def __del__(self):
        time.sleep(0)


@pytest.fixture(autouse=True)
def switch_often():
    """Thread switches every microsecond, so that an unguarded step between two reads or writes gets interleaved."""
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(was)


def run_together(*targets) -> None:
    """Run each target on its own thread, all started at once; the first error any raised is raised here."""
    errors, start = [], threading.Barrier(len(targets))

    def run(target):
        start.wait()
        try:
            target()
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def attached(lease: str = "L0") -> LeaseState:
    state = LeaseState()
    state.attach(Lease(lease), {"lease": lease}, 30.0, 1)
    return state


@pytest.mark.quick  # the quick subset: `pytest -m quick` (README)
def test_a_snapshot_never_sees_half_a_move():
    """A heartbeat moving on lease after lease while the caller's thread takes snapshots: each snapshot's index place
    is its lease's, and every lease before it is among the revoked ones (never a step half done)."""
    state, done = attached(), threading.Event()

    def heartbeat():
        for n in range(1, ROUNDS + 1):
            assert state.move_on(Lease(f"L{n - 1}"), Lease(f"L{n}"), Place(lease=f"L{n}"))
        done.set()

    def reader():
        while not done.is_set():
            seen = state.snapshot()
            assert seen.place["lease"] == seen.lease == f"L{len(seen.revoked)}", seen

    run_together(heartbeat, reader, reader)
    assert state.take_revoked() == [f"L{n}" for n in range(ROUNDS)]


@pytest.mark.quick  # the quick subset: `pytest -m quick` (README)
def test_a_lease_is_replaced_by_one_thread_only():
    """The heartbeat and the caller's thread both find lease R{n} revoked and each takes a new one: exactly one
    replaces it (the other releases what it took), round after round."""
    state, wins, step = attached("R0"), {"heartbeat": [], "caller": []}, threading.Barrier(2)

    def mover(who: str):
        def run():
            for n in range(ROUNDS):
                step.wait()
                if state.move_on(Lease(f"R{n}"), Lease(f"R{n + 1}"), {"lease": f"R{n + 1}"}):
                    wins[who].append(n)
        return run

    run_together(mover("heartbeat"), mover("caller"))
    assert sorted(wins["heartbeat"] + wins["caller"]) == list(range(ROUNDS)), "a round with two or no winners"
    assert sorted(state.take_revoked()) == sorted(f"R{n}" for n in range(ROUNDS))


@pytest.mark.quick  # the quick subset: `pytest -m quick` (README)
def test_close_lets_no_lease_escape():
    """close() on the caller's thread while the heartbeat moves on: every lease the heartbeat took is either one
    close() releases or one it was refused (and releases itself)."""
    for _ in range(ROUNDS // 10):
        state, installed, refused, released = attached(), ["L0"], [], []

        def heartbeat():
            for n in range(1, 50):
                new = Lease(f"L{n}")
                (installed if state.move_on(state.snapshot().lease, new, {"lease": new}) else refused).append(new)

        run_together(heartbeat, lambda: released.extend(state.close()))
        assert sorted(installed) == sorted(released), "a lease taken after close() was kept, not released"
        assert not set(refused) & set(released)


class FakeDaemon:
    """A daemon in this process: answers lease, refresh and release at once, keeping the set of live leases."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.unknown: list[tuple[str, str]] = []  # (op, lease) for a lease not live: released twice, or used after

    def answer(self, op: str, fields: dict) -> dict:
        with self.lock:
            if op == "lease":
                lease = Lease(uuid.uuid4().hex)
                self.live.add(lease)
                return replies.LeaseReply(client=lease, lease_timeout_s=30.0, generation=1,
                                          index_segment={"generation": 1}, latest=1).wire()
            lease = fields["client"]
            if lease not in self.live:
                self.unknown.append((op, lease))
                raise LeaseExpired(f"lease {lease} expired or released")
            if op == "release":
                self.live.remove(lease)
                return replies.Done().wire()
            if op == "refresh":
                return replies.IndexSegmentReply(generation=1, index_segment={"generation": 1}, latest=1).wire()
        raise AssertionError(f"the fake daemon does not answer {op}")


class FakeConnection(Connection):
    """A Connection whose requests the fake daemon answers (no socket)."""

    def __init__(self, daemon: FakeDaemon, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.daemon = daemon

    def request(self, op: str, _frames=(), **fields) -> dict:
        reply = self.daemon.answer(op, fields)
        if self.on_reply is not None:
            self.on_reply(reply)
        return reply


def hammer(client: ExpertClient, conn, refreshes: int) -> None:
    """What a heartbeat that finds lease after lease revoked does (`_move_on`), against refresh() then close() on
    the caller's thread; returns once both are done."""
    stop = threading.Event()

    def heartbeat():
        while not stop.is_set():
            if len(client._lease_state.snapshot().revoked) >= 4:  # pacing, so the holder's lease count stays small
                stop.wait(0.001)
                continue
            client._move_on(conn, client.lease)

    def caller():
        try:
            for _ in range(refreshes):
                assert client.refresh() == [] and client.generation == 1
            client.close()
        finally:
            stop.set()

    run_together(heartbeat, caller)


@pytest.mark.quick  # the quick subset: `pytest -m quick` (README)
def test_refresh_and_close_against_a_heartbeat_moving_on(tmp_path, monkeypatch):
    """The real client's refresh() and close() against a heartbeat thread replacing its lease, on a daemon that
    answers at once: refresh never uses a released lease, and once closed no lease is left live."""
    daemon = FakeDaemon()
    endpoint = f"ipc://{tmp_path}/fake.sock"
    monkeypatch.setattr(client_module, "Connection", lambda *a, **k: FakeConnection(daemon, *a, **k))
    index = SimpleNamespace(read=lambda place: SimpleNamespace(generation=place["generation"], tensors=[],
                                                               segments=[]))
    monkeypatch.setattr(client_module, "index_segment", index)
    for _ in range(20):
        client = ExpertClient(endpoint, heartbeat=False)
        hammer(client, FakeConnection(daemon, endpoint), 100)
        assert daemon.unknown == [] and daemon.live == set()


def test_refresh_and_close_against_a_heartbeat_on_a_real_daemon(tiny_checkpoint, start_daemon):
    """The same against a real daemon, its own heartbeat thread running too: after close() it holds no lease."""
    daemon = start_daemon(tiny_checkpoint)
    conn = Connection(daemon.endpoint, timeout=30)
    try:
        for _ in range(3):
            client = ExpertClient(daemon.endpoint)
            client.index()
            hammer(client, conn, 40)
            assert daemon.status()["leases"] == []
    finally:
        conn.close()
