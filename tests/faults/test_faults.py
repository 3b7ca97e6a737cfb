"""Fault injection with real processes: killed workers and daemons, full /dev/shm, hostile callers."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys

import posix_ipc
import pytest

from expertd.server.serving.leases import lease_tag
from helpers.daemon import expertd_cmd, write_config
from helpers.polling import wait_until


# --- leases and crashed workers ------------------------------------------------------------

def test_sigkilled_worker_loses_its_lease(tiny_checkpoint, start_daemon, workers):
    daemon = start_daemon(tiny_checkpoint, lease_timeout_s=2.0)
    doomed, survivor = workers(daemon.endpoint), workers(daemon.endpoint)
    leases = {lease["client"]: lease for lease in daemon.status()["leases"]}
    assert set(leases) == {lease_tag(doomed.hello["lease"]), lease_tag(survivor.hello["lease"])}  # tags, not ids
    assert all(lease["age_s"] >= 0 and lease["pid"] > 0 for lease in leases.values())
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait()
    survivor_tag = lease_tag(survivor.hello["lease"])
    wait_until(lambda: [lease["client"] for lease in daemon.status()["leases"]] == [survivor_tag],
               "the killed worker's lease to expire", 10)
    assert survivor.ask("digest")["digest"] == survivor.hello["digest"]


# --- crashed daemon ------------------------------------------------------------------------

def test_worker_outlives_a_killed_daemon_and_reconnects_to_its_successor(tiny_checkpoint, start_daemon, workers,
                                                                          namespace):
    daemon = start_daemon(tiny_checkpoint)
    worker = workers(daemon.endpoint, timeout=2)
    dead_pid = daemon.proc.pid
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    assert glob.glob(f"/dev/shm/{namespace}.{dead_pid}.*")  # a crash leaves its segments behind ...
    assert worker.ask("digest")["digest"] == worker.hello["digest"]  # ... and the worker's mappings stay valid
    assert worker.ask("call")["error"] == "DaemonTimeout"  # a typed error, not a hang

    successor = start_daemon(tiny_checkpoint)  # same namespace and endpoint: it adopts what the crash left ...
    assert glob.glob(f"/dev/shm/{namespace}.{dead_pid}.1.*")  # ... and serves it again, without reloading
    assert successor.status()["generation"] == 1
    again = worker.ask("reconnect")
    assert again == {"generation": 1, "digest": worker.hello["digest"]}
    assert worker.ask("call") == {"status": "serving"}
    assert lease_tag(worker.ask("lease")["lease"]) in [lease["client"] for lease in successor.status()["leases"]]


def test_second_daemon_on_a_namespace_refuses(tiny_checkpoint, start_daemon, namespace, tmp_path, workers):
    first = start_daemon(tiny_checkpoint)
    other_dir = tmp_path / "second"
    other_dir.mkdir()
    cfg = write_config(other_dir, tiny_checkpoint, namespace)
    out = subprocess.run(expertd_cmd("start", "--config", cfg), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "NamespaceBusy" in out.stderr and namespace in out.stderr
    worker = workers(first.endpoint)  # the first one is untouched
    assert worker.ask("call") == {"status": "serving"}


def test_reaping_spares_live_owners_and_other_namespaces(namespace):
    from expertd.server.restart.runstate import RunState

    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"/{namespace}.{dead.pid}.1.000", f"/{namespace}x.{dead.pid}.1.000", f"/{namespace}.{os.getpid()}.1.000"]
    for name in names:
        posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    try:
        reaped = RunState(namespace, "/tmp").reap()
        assert reaped == [names[0]]
        assert sorted(glob.glob(f"/dev/shm/{namespace}*")) == sorted("/dev/shm" + n for n in names[1:])
    finally:
        for name in names:
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass


def test_segments_of_a_live_foreign_daemon_are_never_touched(namespace, tmp_path):
    """A live expertd process owning segments of the namespace (another container's, say) blocks reaping."""
    from expertd.errors import ExpertdError
    from expertd.server.restart.runstate import RunState

    holder = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", "expertd"])
    wait_until(lambda: b"expertd" in open(f"/proc/{holder.pid}/cmdline", "rb").read(), "the holder to start", 10)
    name = f"/{namespace}.{holder.pid}.1.000"
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    try:
        with pytest.raises(ExpertdError, match="live process"):
            RunState(namespace, str(tmp_path)).reap()
        assert os.path.exists("/dev/shm" + name)
    finally:
        holder.kill()
        holder.wait()
        posix_ipc.unlink_shared_memory(name)


# --- not enough memory ---------------------------------------------------------------------

def test_small_dev_shm_is_a_clear_error_before_loading(tiny_checkpoint, tmp_path, namespace):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("the /dev/shm-size test needs root and unshare (CI runs as root)")
    cfg = write_config(tmp_path, tiny_checkpoint, namespace)
    script = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm || exit 99; "
        f"{' '.join(expertd_cmd('start', '--config', cfg))}; echo \"rc=$?\"; ls -A /dev/shm | wc -l"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode != 99, out.stderr
    rc_line, left = out.stdout.split()[-2:]
    assert rc_line == "rc=2", out.stderr
    assert left == "0"  # nothing left in that /dev/shm
    assert "ShmSpaceError" in out.stderr and "1.0 MiB free" in out.stderr and "needs 9.6 MiB" in out.stderr
    assert "--shm-size" in out.stderr and "Traceback" not in out.stderr and "SIGBUS" not in out.stderr
