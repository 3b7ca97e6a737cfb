"""The shipped compose set-up, run as two uids on this host: a worker in the daemon's group reads, and cannot write.

docker/docker-compose.yml runs the daemon as expertd (10001:10001) and the worker as expertd-worker (10002) with
the daemon's group added, and `group: expertd` in docker/expertd.yaml. No Docker engine runs here, so the test does
the same with setpriv: the daemon as a uid of its own whose primary group is a test group, with that config's
settings; the worker as nobody (65534) with the test group added. The worker attaches and reads, then tries every
way to change a segment without the daemon (open O_RDWR, truncate, unlink, rename, chmod, a writable shared
mapping, mprotect of its own mapping, a file planted in the run folder): each must be refused by the kernel and
the served bytes stay as they were. A uid outside the group may not even read; the daemon's own uid (every
worker's in a single-user set-up) may open a segment for writing, which is why group mode is the boundary.
Needs root (setpriv, groupadd, unshare); leaves no group, folder, segment or process behind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest
import yaml

from helpers.daemon import DaemonProcess, expertd_cmd, save_config

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0,
                                reason="runs processes as other uids: needs root (setpriv, groupadd)")]

DOCKER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docker")
WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "group_worker.py")
NOBODY = 65534
REFUSED = {"EACCES", "EPERM"}


def blocked_folder() -> tuple[str, str] | None:
    """(folder, entry) when this python lies below a folder other uids cannot search (pyenv in a 0700 /root): the
    folder and the entry under it on the way to python, which `as_uid` shows them in a mount namespace."""
    found = set()
    for path in {os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}:
        parts = os.path.realpath(path).split(os.sep)[1:]
        for depth in range(len(parts)):
            folder = os.sep + os.path.join(*parts[:depth]) if depth else os.sep
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                found.add((folder, parts[depth]))
                break
    if len(found) > 1:
        pytest.fail(f"python is below several folders other uids cannot search: {sorted(found)}")
    return next(iter(found), None)


def as_uid(scratch: str, uid: int, gid: int, groups: list[int]) -> list[str]:
    """The command prefix that runs a program as uid:gid with exactly `groups` added (setpriv execs it, so signals
    reach it); where python sits below a folder others cannot search, in a private mount namespace that lays a tmpfs
    over that folder holding only python's entry (the host's folder is left as it is)."""
    ids = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    setpriv = ["setpriv", "--reuid", str(uid), "--regid", str(gid), *ids, "--"]
    blocked = blocked_folder()
    if blocked is None:
        return setpriv
    folder, entry = blocked
    hold = os.path.join(scratch, f"hold-{uid}-{uuid.uuid4().hex[:6]}")
    os.mkdir(hold)
    script = ('mount --bind "$1" "$2" && mount -t tmpfs -o mode=0755,size=1m expertd-test "$1" && mkdir "$1/$3" '
              '&& mount --bind "$2/$3" "$1/$3" && shift 3 && exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", folder, hold, entry, *setpriv]


@pytest.fixture
def scratch():
    """A folder under /tmp that other uids may search (pytest's tmp_path is below a 0700 folder); removed after."""
    folder = tempfile.mkdtemp(prefix="expertd-group-", dir="/tmp")
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture
def daemon_group():
    """(name, gid) of a group made for this test, standing for the image's `expertd`; deleted after."""
    name = f"edt-{uuid.uuid4().hex[:8]}"
    subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
    try:
        import grp

        yield name, grp.getgrnam(name).gr_gid
    finally:
        subprocess.run(["groupdel", name], check=True, capture_output=True)


def free_uid() -> int:
    """A uid no account and no process uses: the daemon's, as expertd's 10001 is in the image."""
    import pwd

    busy = set()
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                busy.update(int(x) for line in f if line.startswith("Uid:") for x in line.split()[1:])
        except OSError:
            continue
    for uid in range(61000, 62000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if uid not in busy:
                return uid
    pytest.fail("no free uid in 61000-61999")


def run_as(prefix: list[str], env: dict, *args: str) -> dict:
    done = subprocess.run([*prefix, sys.executable, WORKER, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_in_the_daemons_group_reads_and_cannot_write(tiny_checkpoint, namespace, scratch, daemon_group):
    group, gid = daemon_group
    daemon_uid = free_uid()
    compose = yaml.safe_load(open(os.path.join(DOCKER, "expertd.yaml")))
    assert compose["group"] == "expertd"  # what the image's group stands in for here
    ckpt = os.path.join(scratch, "ckpt")
    shutil.copytree(tiny_checkpoint, ckpt)
    os.chmod(ckpt, 0o755)
    for name in os.listdir(ckpt):  # the daemon's uid reads them, as it reads the mounted checkpoint in compose
        os.chmod(os.path.join(ckpt, name), 0o644)
    run = os.path.join(scratch, "run")  # like the image's /run/expertd: the daemon's, its group may search it
    os.mkdir(run)
    os.chown(run, daemon_uid, gid)
    os.chmod(run, 0o750)
    homes = {}
    for who, uid in (("daemon", daemon_uid), ("worker", NOBODY)):
        homes[who] = os.path.join(scratch, f"home-{who}")
        os.mkdir(homes[who], 0o700)
        os.chown(homes[who], uid, -1)
    endpoint = f"ipc://{run}/expertd.sock"
    config = save_config(scratch, {**compose, "checkpoint": ckpt, "endpoint": endpoint, "namespace": namespace,
                                   "group": group, "progress": False})
    env = {"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1", "EXPERTD_NATIVE": "0"}
    daemon = DaemonProcess(config, endpoint, namespace=namespace, prefix=tuple(as_uid(scratch, daemon_uid, gid, [])),
                           env={**env, "HOME": homes["daemon"]})
    try:
        status = daemon.wait_serving(timeout=300)
        segments = [p for p in glob.glob(f"/dev/shm/{namespace}.*")]
        assert segments and status["pid"] == daemon.proc.pid
        for path in segments:  # what group mode makes them: the daemon's, readable by its group only
            st = os.stat(path)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (daemon_uid, gid, 0o640), path
        sock = os.stat(f"{run}/expertd.sock")
        assert (sock.st_uid, sock.st_gid, stat.S_IMODE(sock.st_mode)) == (daemon_uid, gid, 0o660)

        worker = run_as(as_uid(scratch, NOBODY, NOBODY, [gid]), {**env, "HOME": homes["worker"]}, endpoint, "member")
        assert worker["uid"] == NOBODY and gid in worker["groups"] and worker["tensors"] > 0
        assert worker["segment"] in segments
        refused = {attack: how for attack, how in worker["attacks"].items() if how in REFUSED}
        assert refused == worker["attacks"], worker["attacks"]  # every attack refused by the kernel
        assert worker["unchanged"] and worker["verify"] == []

        outsider = run_as(as_uid(scratch, NOBODY, NOBODY, []), {**env, "HOME": homes["worker"]}, endpoint, "outsider",
                          worker["segment"], f"{run}/expertd.sock")
        assert gid not in outsider["groups"]
        assert outsider["read the segment"] == "EACCES" and outsider["reach the socket"] == "EACCES"
        assert outsider["attach"].startswith("DaemonNotTrusted: cannot reach the daemon's socket"), outsider
        assert "permission denied" in outsider["attach"] and "group: NAME" in outsider["attach"], outsider

        # the control: the daemon's own uid (every worker's, in the single-user set-up) may open a segment for writing
        owner = run_as(as_uid(scratch, daemon_uid, gid, []), {**env, "HOME": homes["daemon"]}, endpoint, "owner",
                       worker["segment"])
        assert owner == {"uid": daemon_uid, "open O_RDWR": "allowed"}

        assert sorted(glob.glob(f"/dev/shm/{namespace}.*")) == sorted(segments)
        verify = subprocess.run(expertd_cmd("verify", "--config", config), capture_output=True, text=True, timeout=120)
        assert verify.returncode == 0, verify.stdout + verify.stderr  # every served byte as loaded
        assert os.listdir(run) and not os.path.exists(os.path.join(run, "planted.json"))
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.terminate()
        _, err = daemon.proc.communicate(timeout=60)
    assert daemon.proc.returncode == 0, err  # a clean stop: it unlinks its own segments, socket and manifest


def test_the_daemon_makes_its_socket_folder_reachable_by_its_group(tiny_checkpoint, namespace, scratch, daemon_group):
    """With `group:` and a socket folder the daemon makes itself (as it makes the default endpoint's), the folder is
    the group's and 0750: a member attaches; a uid outside the group is told the permission is missing and the fix."""
    group, gid = daemon_group
    daemon_uid = free_uid()
    ckpt = os.path.join(scratch, "ckpt")
    shutil.copytree(tiny_checkpoint, ckpt)
    os.chmod(ckpt, 0o755)
    for name in os.listdir(ckpt):
        os.chmod(os.path.join(ckpt, name), 0o644)
    base = os.path.join(scratch, "base")  # like /tmp or /run: a folder the daemon may make its own in
    os.mkdir(base)
    os.chown(base, daemon_uid, -1)
    os.chmod(base, 0o755)
    home = os.path.join(scratch, "home")
    os.mkdir(home, 0o755)
    endpoint = f"ipc://{base}/expertd/expertd.sock"  # its folder does not exist: the daemon makes it
    config = save_config(scratch, {"checkpoint": ckpt, "endpoint": endpoint, "namespace": namespace,
                                   "group": group, "progress": False})  # the run folder: the socket's
    env = {"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1", "EXPERTD_NATIVE": "0", "HOME": home}
    daemon = DaemonProcess(config, endpoint, namespace=namespace, prefix=tuple(as_uid(scratch, daemon_uid, gid, [])),
                           env=env)
    try:
        daemon.wait_serving(timeout=300)
        folder = os.stat(f"{base}/expertd")
        assert (folder.st_uid, folder.st_gid, stat.S_IMODE(folder.st_mode)) == (daemon_uid, gid, 0o750)
        worker = run_as(as_uid(scratch, NOBODY, NOBODY, [gid]), env, endpoint, "member")
        assert worker["tensors"] > 0 and worker["verify"] == []
        segment = worker["segment"]
        outsider = run_as(as_uid(scratch, NOBODY, NOBODY, []), env, endpoint, "outsider", segment,
                          f"{base}/expertd/expertd.sock")
        assert outsider["reach the socket"] == "EACCES", outsider
        said = outsider["attach"]
        assert said.startswith("DaemonNotTrusted: cannot reach the daemon's socket") and "permission denied" in said
        assert f"{base}/expertd is " in said and "group: NAME" in said and "usermod -aG" in said, said
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.terminate()
        _, err = daemon.proc.communicate(timeout=60)
    assert daemon.proc.returncode == 0, err
    assert not os.path.exists(f"{base}/expertd/expertd.sock")
