"""Crashed workers, sooner: a worker in the daemon's pid namespace is watched (pid and process start time) and
its lease goes as soon as its process does; one in another pid namespace keeps the heartbeat timeout rule."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys

import pytest

from expertd import procfs
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.protocol import PROTOCOL_VERSION

from expertd.server.serving.leases import WATCH_EVERY_S, LeaseTable, lease_tag, watchable

from helpers.clock import STEP, FakeClock
from helpers.polling import wait_until

NORM = "model.layers.2.post_attention_layernorm.weight"
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def leases(daemon) -> dict[str, dict]:
    """The daemon's leases by the tag status shows of each (`lease_tag`: never the id itself)."""
    return {row["client"]: row for row in daemon.status()["leases"]}


def test_a_killed_worker_loses_its_lease_at_once_and_its_generation_retires(
        tiny_checkpoint, start_daemon, workers, namespace, tmp_path):
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, lease_timeout_s=60, stderr=log)  # the timeout cannot be what removes it
    worker = workers(daemon.endpoint)
    lease = lease_tag(worker.hello["lease"])
    assert leases(daemon)[lease]["watched"] is True
    first = daemon.status()["generation"]
    with ExpertClient(daemon.endpoint) as updater:  # a newer generation: the worker's one is now old, pinned by it
        updater.update({NORM: updater.tensors()[NORM] * 2})
    status = daemon.status()
    assert [g["generation"] for g in status["generations"]] == [first + 1, first]
    assert [held["client"] for held in status["generations"][1]["leases"]] == [lease]

    os.kill(worker.proc.pid, signal.SIGKILL)  # not waited for: a zombie until the test's end, which counts as gone
    # long before the 60 s timeout (the log below says why it went; the pace of the lookups: the table's tests)
    wait_until(lambda: lease not in leases(daemon), "the killed worker's lease ends", timeout=30, every=0.02)
    status = daemon.status()
    assert [g["generation"] for g in status["generations"]] == [first + 1]  # its generation retired
    on_disk = {os.path.basename(p) for p in glob.glob(f"/dev/shm/{namespace}.*")}
    assert on_disk == {s.lstrip("/") for s in [*status["segments"], status["index_segment"]]}
    with open(log_path) as f:  # (the daemon's log handler flushes each line)
        text = f.read()
    assert "1 lease(s) ended: 0 without heartbeat" in text
    assert f"1 whose process is gone: {lease} (pid {worker.proc.pid})" in text


def test_old_clients_keep_the_timeout_rule_and_bad_fields_are_refused(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, lease_timeout_s=60)
    conn = Connection(daemon.endpoint, timeout=10)
    try:
        old = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]  # no pid_ns, start_time
        other_ns = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION, pid_ns=procfs.pid_namespace() + 1,
                                start_time=procfs.process_start_time(os.getpid()))["client"]
        lying = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION, pid_ns=procfs.pid_namespace(),
                             start_time=procfs.process_start_time(os.getpid()) + 1)["client"]  # /proc disagrees
        old, other_ns, lying = map(lease_tag, (old, other_ns, lying))
        rows = leases(daemon)
        assert not rows[old]["watched"] and not rows[other_ns]["watched"] and not rows[lying]["watched"]
        for field, value in (("pid_ns", "x"), ("start_time", -1), ("start_time", 1.5), ("pid_ns", [1])):
            with pytest.raises(DaemonError, match=f"'{field}' must be a non-negative integer"):
                conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION, **{field: value})

        def silent_past_two_lookups() -> bool:  # by the daemon's clock; a lookup would have dropped `lying`
            rows = leases(daemon)
            assert {old, other_ns, lying} <= set(rows), "a lease the daemon does not watch was dropped early"
            return all(rows[tag]["idle_s"] > 2 * WATCH_EVERY_S for tag in (old, other_ns, lying))

        wait_until(silent_past_two_lookups, "the leases stay silent past two process lookups", timeout=30)
    finally:
        conn.close()


def test_a_worker_in_another_pid_namespace_keeps_the_timeout_rule(tiny_checkpoint, start_daemon, workers, tmp_path):
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here (`unshare --pid` needs root or user namespaces): "
                    f"{probe.stderr.strip()}")
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, lease_timeout_s=2, stderr=log)
    worker = workers(daemon.endpoint, prefix=UNSHARE)
    lease = lease_tag(worker.hello["lease"])
    assert worker.hello["pid"] == 1  # the first process of its own pid namespace
    assert leases(daemon)[lease]["watched"] is False
    with open(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children") as f:
        (inner,) = map(int, f.read().split())  # the worker, as our pid namespace numbers it
    os.kill(inner, signal.SIGKILL)
    worker.proc.wait(10)  # unshare reports its child's death
    wait_until(lambda: lease not in leases(daemon), "its lease times out", timeout=30)
    with open(log_path) as f:  # gone by the timeout rule, not by a lookup of its process
        text = f.read()
    ended = f"1 lease(s) ended: 1 without heartbeat for over 2.0s, 0 whose process is gone: {lease} (pid {inner})"
    assert ended in text, text[-2000:]


# --- The lease table alone ---------------------------------------------------------------------------


def test_a_lease_whose_pid_names_another_process_now_is_reaped():
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    me, started = os.getpid(), procfs.process_start_time(os.getpid())
    mine = table.take(me, None, start_time=started)
    reused = table.take(me, None, start_time=started - 1)  # recorded for an earlier process that had this pid
    unwatched = table.take(me, None)
    table.expire(60)
    assert set(table.leases) == {mine.client, reused.client, unwatched.client}  # not looked up yet: checks are paced
    clock.advance(WATCH_EVERY_S - STEP)
    table.expire(60)
    assert set(table.leases) == {mine.client, reused.client, unwatched.client}  # still not
    clock.advance(STEP)  # WATCH_EVERY_S since the lease was taken: looked up
    table.expire(60)
    assert set(table.leases) == {mine.client, unwatched.client}


def test_a_lease_of_a_zombie_or_vanished_process_is_reaped():
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # lives until killed
    try:
        lease = table.take(proc.pid, None, start_time=watchable(proc.pid, procfs.pid_namespace(),
                                                          procfs.process_start_time(proc.pid)))
        assert lease.watched
        clock.advance(WATCH_EVERY_S)
        table.expire(60)
        assert lease.client in table.leases  # alive
        proc.kill()
        wait_until(lambda: procfs._stat(proc.pid)[0] == "Z", "the killed process is a zombie", timeout=30, every=0.01)
        clock.advance(WATCH_EVERY_S)
        table.expire(60)
        assert lease.client not in table.leases
    finally:
        proc.kill()
        proc.wait()
    gone = table.take(proc.pid, None, start_time=1)  # reaped now: no such process at all
    clock.advance(WATCH_EVERY_S)
    table.expire(60)
    assert gone.client not in table.leases


def test_watchable_needs_the_same_pid_namespace_and_a_start_time_proc_agrees_with():
    me, started, ns = os.getpid(), procfs.process_start_time(os.getpid()), procfs.pid_namespace()
    assert watchable(me, ns, started) == started
    assert watchable(me, ns + 1, started) is None
    assert watchable(me, ns, started + 1) is None
    assert watchable(me, None, None) is None and watchable(me, ns, None) is None
    assert watchable(0, ns, started) is None
