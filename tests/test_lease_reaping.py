"""Crashed workers, sooner: a worker in the daemon's pid namespace is watched (pid and process start time) and
its lease goes as soon as its process does; one in another pid namespace keeps the heartbeat timeout rule."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from expertd import procfs
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.protocol import PROTOCOL_VERSION

from expertd.server.serving.leases import WATCH_EVERY_S, LeaseTable, lease_tag, watchable

NORM = "model.layers.2.post_attention_layernorm.weight"
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def leases(daemon) -> dict[str, dict]:
    """The daemon's leases by the tag status shows of each (`lease_tag`: never the id itself)."""
    return {row["client"]: row for row in daemon.status()["leases"]}


def wait_until(condition, timeout: float, every: float = 0.02) -> float:
    """Poll `condition` until it holds; the seconds that took (the timeout's, when it never did)."""
    start = time.monotonic()
    while not condition() and time.monotonic() - start < timeout:
        time.sleep(every)
    return time.monotonic() - start


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
    took = wait_until(lambda: lease not in leases(daemon), timeout=5)
    assert took < 2, f"the killed worker's lease was still listed after {took:.1f}s"
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
        time.sleep(0.6)  # several checks later: nothing unwatched was dropped early
        assert {old, other_ns, lying} <= set(leases(daemon))
    finally:
        conn.close()


def test_a_worker_in_another_pid_namespace_keeps_the_timeout_rule(tiny_checkpoint, start_daemon, workers):
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here (`unshare --pid` needs root or user namespaces): "
                    f"{probe.stderr.strip()}")
    daemon = start_daemon(tiny_checkpoint, lease_timeout_s=3)
    worker = workers(daemon.endpoint, prefix=UNSHARE)
    lease = lease_tag(worker.hello["lease"])
    assert worker.hello["pid"] == 1  # the first process of its own pid namespace
    assert leases(daemon)[lease]["watched"] is False
    with open(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children") as f:
        (inner,) = map(int, f.read().split())  # the worker, as our pid namespace numbers it
    os.kill(inner, signal.SIGKILL)
    killed = time.monotonic()
    worker.proc.wait(10)  # unshare reports its child's death
    time.sleep(1.5 - (time.monotonic() - killed))
    assert lease in leases(daemon), "a worker of another pid namespace was reaped before its lease timed out"
    wait_until(lambda: lease not in leases(daemon), timeout=10)
    gone_after = time.monotonic() - killed
    assert lease not in leases(daemon), "its lease never timed out"
    # gone by the timeout: 3 s after its last heartbeat, which came at most a second (a third of it) before the kill
    assert 3 - 1 - 0.1 <= gone_after < 3 + 1.5, gone_after


# --- The lease table alone ---------------------------------------------------------------------------


def test_a_lease_whose_pid_names_another_process_now_is_reaped():
    table = LeaseTable()
    me, started = os.getpid(), procfs.process_start_time(os.getpid())
    mine = table.take(me, None, start_time=started)
    reused = table.take(me, None, start_time=started - 1)  # recorded for an earlier process that had this pid
    unwatched = table.take(me, None)
    table.expire(60)
    assert set(table.leases) == {mine.client, reused.client, unwatched.client}  # not looked up yet: checks are paced
    time.sleep(WATCH_EVERY_S + 0.05)
    table.expire(60)
    assert set(table.leases) == {mine.client, unwatched.client}


def test_a_lease_of_a_zombie_or_vanished_process_is_reaped():
    table = LeaseTable()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = table.take(proc.pid, None, start_time=watchable(proc.pid, procfs.pid_namespace(),
                                                          procfs.process_start_time(proc.pid)))
        assert lease.watched
        time.sleep(WATCH_EVERY_S + 0.05)
        table.expire(60)
        assert lease.client in table.leases  # alive
        proc.kill()
        assert wait_until(lambda: procfs._stat(proc.pid)[0] == "Z", timeout=5) < 5  # exited, not yet waited for
        time.sleep(WATCH_EVERY_S + 0.05)
        table.expire(60)
        assert lease.client not in table.leases
    finally:
        proc.kill()
        proc.wait()
    gone = table.take(proc.pid, None, start_time=1)  # reaped now: no such process at all
    time.sleep(WATCH_EVERY_S + 0.05)
    table.expire(60)
    assert gone.client not in table.leases


def test_watchable_needs_the_same_pid_namespace_and_a_start_time_proc_agrees_with():
    me, started, ns = os.getpid(), procfs.process_start_time(os.getpid()), procfs.pid_namespace()
    assert watchable(me, ns, started) == started
    assert watchable(me, ns + 1, started) is None
    assert watchable(me, ns, started + 1) is None
    assert watchable(me, None, None) is None and watchable(me, ns, None) is None
    assert watchable(0, ns, started) is None
