"""No other uid can pose as the daemon through a path, a default folder or a name: each test performs one attack the
review found (issue 37 finding 1 and the namespace lock of finding 7), run as the attacker ran it.

The attacker is uid 65534 made with `setpriv`: it links a folder of its own (one root gave it, like a home folder,
which the clients' old rule accepted) in place of the socket's folder or of a folder above it, and runs an impostor
there, a real ZeroMQ ROUTER that records whether a token reached it. The Python and the C++ client and `expertd stop`
refuse with DaemonNotTrusted before sending anything; the daemon refuses such a run or socket folder at start, and
serves on when its run folder is swapped after start. Binding the old abstract lock name, or making folders in /tmp,
no longer keeps a daemon from starting.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from expertd.client import ExpertClient
from expertd.errors import AuthError, DaemonNotTrusted
from helpers.daemon import expertd_cmd, save_config
from test_cpp_client import cpp_build, dump  # noqa: F401  (the session's C++ build)
from test_host_trust import AS_NOBODY, DAEMON_AS_NOBODY, NOBODY, as_nobody, config_in, refused

TOKEN = "the-victims-token-0123456789"
ADMIN = "the-victims-admin-token-0123456789"

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="needs root and setpriv (util-linux) to act as another user"),
]

IMPOSTOR = """
import sys, msgpack, zmq
path, tokens = sys.argv[1], [t.encode() for t in sys.argv[2:]]
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind("ipc://" + path)
print("ready", flush=True)
while True:
    frames = sock.recv_multipart()
    print("token" if any(t in f for t in tokens for f in frames) else "request", flush=True)
    sock.send_multipart([frames[0], b"", msgpack.packb({"ok": False, "error": "AuthError", "message": "impostor"})])
"""


@pytest.fixture
def attacker():
    """A folder root gave uid 65534 (its 'home', in a root-owned 0755 folder, as the old rule trusted), with an
    impostor listening in it as that uid; yields a function that links it (as that uid) at a path of /tmp and
    returns the endpoint through the link, and the impostor's process."""
    home = tempfile.mkdtemp(prefix="expertd-home-", dir="/tmp")
    os.chmod(home, 0o755)
    mine = os.path.join(home, "attacker")
    os.mkdir(mine, 0o755)
    os.chown(mine, NOBODY, NOBODY)
    impostor = subprocess.Popen(DAEMON_AS_NOBODY + [sys.executable, "-c", IMPOSTOR, f"{mine}/expertd.sock", TOKEN,
                                                    ADMIN], stdout=subprocess.PIPE, text=True)
    links = []

    def link(middle: bool) -> str:
        """`ln -s` by the attacker in /tmp: to its folder (the socket's folder), or to `home` (a folder above)."""
        path = f"/tmp/expertd-link-{os.urandom(6).hex()}"
        as_nobody("ln", "-s", home if middle else mine, path)
        links.append(path)
        return f"ipc://{path}/attacker/expertd.sock" if middle else f"ipc://{path}/expertd.sock"

    try:
        assert impostor.stdout.readline().strip() == "ready"
        yield link, impostor
    finally:
        if impostor.returncode is None:  # not read by `reached`
            impostor.kill()
            impostor.communicate()
        for path in links:
            os.unlink(path)
        shutil.rmtree(home)


def reached(impostor) -> list[str]:
    """What reached the impostor ('token', 'request'), once it is stopped."""
    impostor.kill()
    return impostor.communicate()[0].split()  # "ready" was read by the fixture


@pytest.mark.parametrize("middle", [False, True], ids=["socket-folder-linked", "folder-above-linked"])
def test_the_python_client_refuses_a_socket_reached_through_another_users_link(attacker, middle):
    link, impostor = attacker
    endpoint = link(middle)
    with pytest.raises(DaemonNotTrusted, match=f"symbolic link /tmp/expertd-link-.*uid {NOBODY}.*mode 0777"):
        ExpertClient(endpoint, token=TOKEN, timeout=2)
    assert reached(impostor) == []  # not a byte, let alone the token


def test_the_impostor_would_get_the_token_from_a_client_told_to_trust_it(attacker, monkeypatch):
    """The control: the same impostor, trusted on purpose ($EXPERTD_DAEMON_UID), receives the token, so the test
    above observes an absence that would show."""
    link, impostor = attacker
    monkeypatch.setenv("EXPERTD_DAEMON_UID", str(NOBODY))
    with pytest.raises(AuthError, match="impostor"):
        ExpertClient(link(False), token=TOKEN, timeout=10)
    assert reached(impostor) == ["token"]


@pytest.mark.parametrize("middle", [False, True], ids=["socket-folder-linked", "folder-above-linked"])
def test_the_cpp_client_refuses_a_socket_reached_through_another_users_link(attacker, middle, cpp_build):  # noqa: F811
    link, impostor = attacker
    run = dump(cpp_build, link(middle), "--token", TOKEN, "--timeout-ms", "2000")
    assert run.returncode == 10 and "DaemonNotTrusted" in run.stderr and "symbolic link" in run.stderr, run.stderr
    assert f"uid {NOBODY}" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert reached(impostor) == []


def test_expertd_stop_sends_no_admin_token_to_the_impostor(attacker, tiny_checkpoint, tmp_path):
    link, impostor = attacker
    config = save_config(tmp_path, {"checkpoint": tiny_checkpoint, "endpoint": link(False), "auth_token": TOKEN,
                                    "admin_token": ADMIN})
    done = subprocess.run(expertd_cmd("stop", "--config", config, "--timeout", "5"), capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "DaemonNotTrusted" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and reached(impostor) == []


# --- the daemon's own folders -----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["to-their-folder", "to-our-folder", "folder-above"])
def test_the_daemon_refuses_a_run_folder_reached_through_another_users_link(case, tiny_checkpoint, namespace,
                                                                            tmp_path):
    """Even a link to a folder of the daemon's own: its owner could point it elsewhere once the checks are done."""
    target = tempfile.mkdtemp(prefix="expertd-target-", dir="/tmp")
    path = f"/tmp/expertd-link-{os.urandom(6).hex()}"
    try:
        if case == "to-their-folder":
            os.chown(target, NOBODY, NOBODY)
        os.chmod(target, 0o755)
        os.mkdir(os.path.join(target, "run"), 0o700)
        as_nobody("ln", "-s", target, path)
        folder = path + "/run" if case == "folder-above" else path
        refused(config_in(tmp_path, tiny_checkpoint, namespace, endpoint=f"ipc://{folder}/expertd.sock"),
                "run folder", folder, "symbolic link", path, f"uid {NOBODY}")
        assert sorted(os.listdir(target)) == ["run"] and os.listdir(os.path.join(target, "run")) == []
    finally:
        os.unlink(path)
        shutil.rmtree(target)


def test_the_daemon_serves_on_when_its_run_folder_is_swapped(tiny_checkpoint, start_daemon, namespace, tmp_path):
    """The run folder replaced after start by a link to another user's folder: the manifest write is refused and
    logged once (nothing is written there), the daemon serves on, and writes it again once its folder is back."""
    state, away, theirs = tmp_path / "state", tmp_path / "state.away", tmp_path / "theirs"
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, stderr=log, run_dir=str(state))
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    os.rename(state, away)
    os.symlink(theirs, state)
    os.lchown(state, NOBODY, NOBODY)
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:  # a new lease: the manifest is rewritten
        deadline = time.monotonic() + 120
        while "cannot write the manifest" not in log_path.read_text() and time.monotonic() < deadline:
            assert daemon.proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        assert daemon.status()["state"] == "serving" and client.verify() == []
        assert os.listdir(theirs) == []
        os.unlink(state)
        os.rename(away, state)
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0
    log = log_path.read_text()
    failures = [line for line in log.splitlines() if "cannot write the manifest" in line]
    assert len(failures) == 1 and "symbolic link" in failures[0] and f"uid {NOBODY}" in failures[0], log
    assert "Traceback" not in log and os.listdir(theirs) == [] and not state.exists()


# --- the namespace lock and the default folder --------------------------------------------------------

HOLD_NAME = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\\0expertd." + sys.argv[1])
print("bound", flush=True)
sys.stdin.read()
"""


def test_another_uid_on_the_old_lock_name_blocks_neither_a_start_nor_a_successor(tiny_checkpoint, start_daemon,
                                                                                  namespace):
    holder = subprocess.Popen(AS_NOBODY + [sys.executable, "-c", HOLD_NAME, namespace], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "bound"
        first = start_daemon(tiny_checkpoint)
        first.proc.send_signal(signal.SIGKILL)  # a crash: the successor adopts what it left
        first.proc.wait()
        first.proc.communicate()
        successor = start_daemon(tiny_checkpoint)
        assert successor.status()["generation"] == 1
        with ExpertClient(successor.endpoint, heartbeat=False) as client:
            assert client.verify() == []
    finally:
        holder.kill()
        holder.communicate()


def test_folders_another_uid_makes_in_tmp_do_not_block_the_default(tiny_checkpoint, namespace, tmp_path,
                                                                    monkeypatch):
    """The old default folder /tmp/expertd, made first by another uid (with a listener in it), and root's own
    fallback name: a root daemon with no endpoint in its config serves on /run/expertd, and a client and the CLI
    that name none find it there."""
    if any(os.path.lexists(p) for p in ("/run/expertd", "/tmp/expertd", "/tmp/expertd-0")):
        pytest.skip("/run/expertd, /tmp/expertd or /tmp/expertd-0 exists on this host already")
    planted = "/tmp/expertd"
    as_nobody("mkdir", "-m", "0755", planted)
    as_nobody("mkdir", "-m", "0755", "/tmp/expertd-0")
    monkeypatch.delenv("EXPERTD_ENDPOINT", raising=False)
    config = save_config(tmp_path, {"checkpoint": tiny_checkpoint, "namespace": namespace, "progress": False})
    daemon = subprocess.Popen(expertd_cmd("start", "--config", config), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        status = None
        while daemon.poll() is None and time.monotonic() < deadline:
            status = subprocess.run(expertd_cmd("status", "--json"), capture_output=True, text=True, timeout=60)
            if status.returncode == 0 and '"serving"' in status.stdout:
                break
            time.sleep(0.2)
        assert daemon.poll() is None and status is not None and status.returncode == 0, status
        assert os.path.exists("/run/expertd/expertd.sock")
        with ExpertClient(heartbeat=False) as client:
            assert client.endpoint == "ipc:///run/expertd/expertd.sock" and client.verify() == []
    finally:
        daemon.send_signal(signal.SIGTERM)
        err = daemon.communicate(timeout=60)[1]
        shutil.rmtree(planted)
        shutil.rmtree("/tmp/expertd-0")
    assert daemon.returncode == 0, err
    assert not os.path.lexists("/run/expertd")  # the folder it made went with it


DEFAULTS = """
import json
from expertd.protocol import default_endpoint
from expertd.server.daemon.config import config_from_dict
cfg = config_from_dict({"checkpoint": "/nonexistent"})
tcp = config_from_dict({"checkpoint": "/nonexistent", "endpoint": "tcp://127.0.0.1:5555", "namespace": "ns"})
print(json.dumps([default_endpoint(), cfg.endpoint, cfg.resolved_run_dir, tcp.resolved_run_dir]))
"""


def test_defaults_of_another_uid_are_its_own(tmp_path):
    """A uid's client, CLI and daemon resolve one default: $XDG_RUNTIME_DIR's when that is the uid's own folder,
    else /tmp/expertd-UID; a daemon finds that one made first by another uid (or linked) and refuses it."""
    ours = tempfile.mkdtemp(prefix="expertd-xdg-", dir="/tmp")
    os.chown(ours, NOBODY, NOBODY)

    def defaults(xdg: str | None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPERTD_", "XDG_"))}
        env.update({"XDG_RUNTIME_DIR": xdg} if xdg else {})
        done = subprocess.run(DAEMON_AS_NOBODY + [sys.executable, "-c", DEFAULTS], capture_output=True, text=True,
                              env=env, timeout=120, cwd="/")
        assert done.returncode == 0, done.stderr
        return __import__("json").loads(done.stdout)

    try:
        base = f"/tmp/expertd-{NOBODY}"
        assert defaults(None) == [f"ipc://{base}/expertd.sock"] * 2 + [base, f"{base}/ns"]
        xdg = f"{ours}/expertd"
        assert defaults(ours) == [f"ipc://{xdg}/expertd.sock"] * 2 + [xdg, f"{xdg}/ns"]
        assert defaults(str(tmp_path)) == defaults(None)  # root's folder: not this uid's to trust
    finally:
        shutil.rmtree(ours)


def test_a_daemon_of_another_uid_refuses_its_default_folder_made_by_someone_else(tiny_checkpoint, tmp_path):
    base = f"/tmp/expertd-{NOBODY}"
    if os.path.lexists(base):
        pytest.skip(f"{base} exists on this host already")
    other = ["setpriv", "--reuid", str(NOBODY - 1), "--regid", str(NOBODY - 1), "--clear-groups"]
    subprocess.run(other + ["mkdir", "-m", "0755", base], check=True, timeout=30)
    config = os.path.join(tempfile.mkdtemp(prefix="expertd-cfg-", dir="/tmp"), "expertd.yaml")
    try:
        save_config(os.path.dirname(config), {"checkpoint": tiny_checkpoint, "progress": False})
        os.chmod(os.path.dirname(config), 0o755)
        os.chmod(config, 0o644)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPERTD_", "XDG_"))}
        done = subprocess.run(DAEMON_AS_NOBODY + expertd_cmd("start", "--config", config), capture_output=True,
                              text=True, env={**env, "HOME": "/nonexistent"}, timeout=120, cwd="/")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert base in lines[0] and f"uid {NOBODY - 1}" in lines[0] and "0755" in lines[0], lines[0]
        assert os.listdir(base) == []
    finally:
        shutil.rmtree(base)
        shutil.rmtree(os.path.dirname(config))


def test_a_socket_in_a_sticky_folder_is_refused(tmp_path):
    """/tmp itself (sticky) may lie on the way, never be the socket's own folder: anyone may make names there."""
    folder = tempfile.mkdtemp(prefix="expertd-sticky-", dir="/tmp")
    os.chmod(folder, 0o1777)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"{folder}/expertd.sock")
        listener.listen(1)
        with pytest.raises(DaemonNotTrusted, match=f"{folder} .*mode 1777.*replace the socket"):
            ExpertClient(f"ipc://{folder}/expertd.sock", token=TOKEN, timeout=2)
    finally:
        listener.close()
        shutil.rmtree(folder)
