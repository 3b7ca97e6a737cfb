"""Nothing else on the host can pose as the daemon: each test performs one attack the security review found.

Another user is uid 65534 made with `setpriv` (root can also hand a folder or file to it with chown). Folders,
sockets and records the daemon trusts must be its own and writable by nobody else, or `expertd start` exits 2
with one line naming the path, its owner and mode, having created nothing. A ledger or manifest rewritten by
someone without the run folder's key, or one that says it was built under another config, is not adopted:
what it names is reaped, one log line says why, and a fresh build is served. Another user's file with a
segment's name is never unlinked: one log line, and the start goes on.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from expertd.client import ExpertClient
from expertd.server.restart import ledger, sealed
from expertd.server.daemon.config import config_from_dict
from helpers.daemon import daemon_settings, expertd_cmd, save_config
from helpers.reference import reference_tensors

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
# expertd's interpreter may live in root's 0700 home: a daemon run as nobody keeps only the right to read files
# (CAP_DAC_READ_SEARCH), never to write, chown or unlink what is not its own
DAEMON_AS_NOBODY = AS_NOBODY + ["--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search"]
SYSTEM_PYTHON = "/usr/bin/python3"  # stdlib only: what an unprivileged user on the host runs
SWAPPED = ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_a_proj.weight")

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="needs root and setpriv (util-linux) to act as another user"),
]


@pytest.fixture
def shared_tmp():
    """A folder like /tmp (root's, mode 1777) where another user can make entries of its own; removed after."""
    folder = tempfile.mkdtemp(prefix="expertd-attack-", dir="/tmp")
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_nobody(*cmd: str) -> None:
    subprocess.run(AS_NOBODY + list(cmd), check=True, timeout=30)


def shm_files(namespace: str) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/{namespace}*"))


def refused(config: str, *needles: str) -> str:
    """Run `expertd start` that must refuse: exit 2, one stderr line holding every needle; returns the line."""
    proc = subprocess.Popen(expertd_cmd("start", "--config", config), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"expertd start ran where it must refuse: {err[-3000:]}")
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def config_in(tmp_path, checkpoint: str, namespace: str, **extra) -> str:
    return save_config(tmp_path, daemon_settings(tmp_path, checkpoint, namespace, **extra))


def stop_and_read(daemon) -> str:
    """SIGTERM the daemon; everything it wrote to stderr (it must exit 0)."""
    daemon.proc.send_signal(signal.SIGTERM)
    err = daemon.proc.communicate(timeout=60)[1]
    assert daemon.proc.returncode == 0, err
    return err


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def lines_with(log: str, needle: str) -> list[str]:
    return [line for line in log.splitlines() if needle in line]


def handover(daemon) -> str:
    """`expertd stop --keep`: the generations, ledger and manifest stay for a successor; the run folder."""
    done = subprocess.run(expertd_cmd("stop", "--keep", "--timeout", "60", "--config", daemon.config),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert daemon.proc.wait(30) == 0
    return os.path.join(os.path.dirname(daemon.config), "run")


def dead_pid() -> int:
    """The pid of a process that has exited (what a crashed daemon's segment names carry)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def serves_the_checkpoint(daemon, checkpoint: str) -> None:
    """Every served tensor is the checkpoint's own (swapped tensors included) and `expertd verify` agrees."""
    reference = reference_tensors(checkpoint)
    with ExpertClient(daemon.endpoint) as client:
        served = client.tensors()
        for name in SWAPPED:
            assert torch.equal(served[name], reference[name]), name
    done = subprocess.run(expertd_cmd("verify", "--config", daemon.config), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "all bytes match" in done.stdout, done.stdout + done.stderr


# --- folders and files the daemon trusts ---------------------------------------------------------


def test_run_folder_of_another_user_is_refused(tiny_checkpoint, namespace, shared_tmp, tmp_path):
    theirs = os.path.join(shared_tmp, "run")
    as_nobody("mkdir", "-m", "0755", theirs)  # made first by someone else: the daemon's folder is a guessable path
    line = refused(config_in(tmp_path, tiny_checkpoint, namespace, endpoint=f"ipc://{theirs}/expertd.sock"),
                   "run folder", theirs, f"uid {NOBODY}", "0755", "uid 0")
    assert "Traceback" not in line
    assert os.listdir(theirs) == [] and not shm_files(namespace)


@pytest.mark.parametrize("case", ["group-writable", "world-writable", "parent-of-another-user"])
def test_run_folder_others_may_write_is_refused(case, tiny_checkpoint, namespace, shared_tmp, tmp_path):
    if case == "parent-of-another-user":  # whoever owns the folder above can move ours away and put theirs there
        parent = os.path.join(shared_tmp, "theirs")
        as_nobody("mkdir", "-m", "0755", parent)
        run, needles = os.path.join(parent, "run"), (parent, f"uid {NOBODY}", "folder above")
    else:
        run = str(tmp_path / "run")
        mode = 0o770 if case == "group-writable" else 0o707
        needles = (run, f"{mode:04o}", "not writable by group or others")
    os.mkdir(run)
    if case != "parent-of-another-user":
        os.chmod(run, mode)
    refused(config_in(tmp_path, tiny_checkpoint, namespace, endpoint=f"ipc://{run}/expertd.sock"), "run folder",
            *needles)
    assert os.listdir(run) == [] and not shm_files(namespace)


@pytest.mark.parametrize("case", ["key-readable-by-group", "ledger-of-another-user"])
def test_key_or_ledger_not_the_daemons_own_is_refused(case, tiny_checkpoint, start_daemon, namespace):
    run = handover(start_daemon(tiny_checkpoint))
    if case == "key-readable-by-group":
        path, needles = os.path.join(run, f"{namespace}.ledger.key"), ("0640", "mode 0600")
        os.chmod(path, 0o640)
    else:
        path, needles = os.path.join(run, f"{namespace}.gen1.json"), (f"uid {NOBODY}",)
        os.chown(path, NOBODY, NOBODY)
    left = shm_files(namespace)
    refused(os.path.join(os.path.dirname(run), "expertd.yaml"), path, *needles)
    assert shm_files(namespace) == left  # nothing adopted, reaped or created
    for name in left:
        os.unlink(name)


def test_default_run_folder_is_private_to_the_uid(monkeypatch, shared_tmp, tmp_path):
    """root's default is /run/expertd (a folder only root may make), whatever $XDG_RUNTIME_DIR says; another uid's
    ($XDG_RUNTIME_DIR/expertd or /tmp/expertd-UID) is tested as that uid in test_impostor.py."""
    settings = {"checkpoint": str(tmp_path), "endpoint": "tcp://127.0.0.1:5555", "namespace": "edtdefault"}
    for xdg in (None, str(tmp_path), shared_tmp):
        if xdg is None:
            monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        else:
            monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
        cfg = config_from_dict({k: v for k, v in settings.items() if k != "endpoint"})
        assert config_from_dict(settings).resolved_run_dir == "/run/expertd/edtdefault"
        assert (cfg.endpoint, cfg.resolved_run_dir) == ("ipc:///run/expertd/expertd.sock", "/run/expertd")


# --- the control socket --------------------------------------------------------------------------

FAKE_DAEMON = """
import os, socket, sys
path = sys.argv[1]
os.mkdir(os.path.dirname(path), 0o755)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o777)
s.listen(8)
print("ready", flush=True)
s.settimeout(120)
try:
    conn, _ = s.accept()
    print("connected", flush=True)  # a client (or the daemon's probe) reached the impostor
    conn.recv(1 << 16)
except OSError:
    pass
"""


def test_socket_folder_of_another_user_is_refused(tiny_checkpoint, namespace, shared_tmp, tmp_path):
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"needs {SYSTEM_PYTHON} to run the impostor as another user")
    path = os.path.join(shared_tmp, "sock", "expertd.sock")
    impostor = subprocess.Popen(AS_NOBODY + [SYSTEM_PYTHON, "-c", FAKE_DAEMON, path], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert impostor.stdout.readline().strip() == "ready"
        config = config_in(tmp_path, tiny_checkpoint, namespace, endpoint=f"ipc://{path}",
                           run_dir=str(tmp_path / "run"))
        refused(config, "socket folder", os.path.dirname(path), f"uid {NOBODY}", "0755")
        assert os.stat(path).st_uid == NOBODY  # the impostor's socket is left as it was
    finally:
        impostor.kill()
        out = impostor.communicate()[0]
    assert "connected" not in out and not shm_files(namespace)
    assert not os.path.exists(tmp_path / "run")  # the failed start removed the run folder it made


def test_socket_of_another_user_in_the_folder_is_refused(tiny_checkpoint, namespace, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = str(run / "expertd.sock")
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        planted.bind(path)
        planted.listen(8)
        os.chown(path, NOBODY, NOBODY)  # someone else's listener where the daemon's socket goes
        refused(config_in(tmp_path, tiny_checkpoint, namespace), "control socket", path, f"uid {NOBODY}")
        assert os.path.exists(path) and not shm_files(namespace)
        assert os.listdir(run) == ["expertd.sock"]  # the key the failed start made is gone again
    finally:
        planted.close()


# --- what the run folder says ---------------------------------------------------------------------


@pytest.mark.parametrize("rewrite", ["swap-two-entries", "change-a-checksum"])
def test_ledger_rewritten_without_the_key_is_not_adopted(rewrite, tiny_checkpoint, start_daemon, namespace):
    run = handover(start_daemon(tiny_checkpoint))
    path = os.path.join(run, f"{namespace}.gen1.json")
    with open(path) as f:
        record = json.load(f)  # what anyone who may write the file can do: edit it, the stale MAC left in place
    tensors = {t["name"]: t for t in record["index"]["tensors"]}
    a, b = (tensors[name] for name in SWAPPED)
    if rewrite == "swap-two-entries":  # each name now points at the other's bytes, and the checksums agree
        for key in ("segment", "offset", "checksum"):
            a[key], b[key] = b[key], a[key]
    else:
        a["checksum"] = a["checksum"][:-1] + ("1" if a["checksum"][-1] == "0" else "0")
    with open(path, "w") as f:
        json.dump(record, f)
    successor = start_daemon(tiny_checkpoint)
    status = successor.status()
    assert status["generation"] == 2 and status["job"]["kind"] == "load"  # a fresh build, not the rewritten one
    serves_the_checkpoint(successor, tiny_checkpoint)
    log = stop_and_read(successor)
    refusals = lines_with(log, "not adopting")
    assert len(refusals) == 1 and "generation 1" in refusals[0] and "MAC" in refusals[0], log
    assert "adopted generation" not in log and "Traceback" not in log


def test_manifest_rewritten_without_the_key_is_not_followed(tiny_checkpoint, start_daemon, namespace, tmp_path):
    """The manifest names the folder a successor reaps in: pointed elsewhere, it would unlink files there."""
    run = handover(start_daemon(tiny_checkpoint))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bait = elsewhere / f"{namespace}.{dead_pid()}.1.000"  # the daemon's own uid's file: only the MAC protects it
    bait.write_text("not a segment")
    path = os.path.join(run, f"{namespace}.manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["shm_dir"] = str(elsewhere)
    with open(path, "w") as f:
        json.dump(manifest, f)
    successor = start_daemon(tiny_checkpoint)
    assert successor.status()["job"]["kind"] == "load"
    serves_the_checkpoint(successor, tiny_checkpoint)
    log = stop_and_read(successor)
    refusals = lines_with(log, "not adopting")
    assert len(refusals) == 1 and "MAC" in refusals[0] and "manifest" in refusals[0], log
    assert bait.exists() and "adopted generation" not in log


@pytest.mark.parametrize("field", ["shm_dir", "checkpoint"])
def test_ledger_built_under_another_config_is_not_adopted(field, tiny_checkpoint, start_daemon, namespace, tmp_path):
    """Sealed with the right key but naming another shm_dir or checkpoint than the manifest and the config (the
    folder every file operation of adoption would use): compared before anything is adopted."""
    run = handover(start_daemon(tiny_checkpoint))
    path, purpose = os.path.join(run, f"{namespace}.gen1.json"), ledger.purpose(namespace, 1)
    key = sealed.load_key(run, namespace)
    record = sealed.read(path, purpose, key)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if field == "shm_dir":
        record["index"]["shm_dir"] = record["built_under"]["shm_dir"] = str(elsewhere)
    else:
        record["built_under"]["checkpoint"] = str(elsewhere)
    sealed.write(path, record, purpose, key)
    successor = start_daemon(tiny_checkpoint)
    assert successor.status()["generation"] == 2
    serves_the_checkpoint(successor, tiny_checkpoint)
    log = stop_and_read(successor)
    refusals = lines_with(log, "not adopting")
    assert len(refusals) == 1 and f"{field} " in refusals[0] and str(elsewhere) in refusals[0], log
    assert os.listdir(elsewhere) == []  # nothing created, truncated or unlinked where the ledger pointed


# --- files in the shm folder that are not the daemon's ------------------------------------------------


def test_another_users_segment_named_file_is_left_alone(tiny_checkpoint, start_daemon, namespace):
    planted = f"/dev/shm/{namespace}.{dead_pid()}.1.000"
    as_nobody("sh", "-c", f"echo planted > {planted}")
    try:
        daemon = start_daemon(tiny_checkpoint)  # as root: it could unlink anything, and must not
        log = stop_and_read(daemon)
        assert os.stat(planted).st_uid == NOBODY
        left = lines_with(log, "alone")
        assert len(left) == 1 and os.path.basename(planted) in left[0] and "Traceback" not in log, log
        assert shm_files(namespace) == [planted]
    finally:
        os.unlink(planted)


def test_root_segment_named_file_is_left_alone_by_a_daemon_of_another_user(tiny_checkpoint, namespace, shared_tmp):
    ckpt, run, home = (os.path.join(shared_tmp, name) for name in ("ckpt", "run", "home"))
    shutil.copytree(tiny_checkpoint, ckpt)
    for folder in (run, home):
        os.mkdir(folder, 0o700)
        os.chown(folder, NOBODY, NOBODY)
    config = save_config(shared_tmp, {"checkpoint": ckpt, "endpoint": f"ipc://{run}/expertd.sock",
                                      "namespace": namespace, "progress": False})
    os.chmod(config, 0o644)
    planted = f"/dev/shm/{namespace}.{dead_pid()}.1.000"
    with open(planted, "w") as f:
        f.write("root's")
    env = {**os.environ, "HOME": home, "EXPERTD_NATIVE": "0"}
    # its log, read while it runs: root's status request is not its owner's, so the log says when it serves
    logged = os.path.join(shared_tmp, "daemon.log")
    with open(logged, "w") as log_file:
        daemon = subprocess.Popen(DAEMON_AS_NOBODY + expertd_cmd("start", "--config", config, python=sys.executable),
                                  stdout=subprocess.DEVNULL, stderr=log_file, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and daemon.poll() is None and "serving generation" not in read(logged):
            time.sleep(0.2)
        assert daemon.poll() is None and "serving generation" in read(logged), read(logged)
        served = [p for p in shm_files(namespace) if p != planted]
        assert served and all(os.stat(p).st_uid == NOBODY for p in served)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        log = read(logged)
        assert daemon.returncode == 0, log
        left = lines_with(log, "alone")
        assert len(left) == 1 and os.path.basename(planted) in left[0] and "Traceback" not in log, log
        assert shm_files(namespace) == [planted] and os.stat(planted).st_uid == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        os.unlink(planted)
