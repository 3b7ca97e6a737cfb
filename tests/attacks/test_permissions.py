"""Least privilege: each test performs one attack the security review found, against real daemons.

Three permissions (expertd.messages.PERMISSIONS): read, push, admin. Over ipc the daemon has an auth_token (read),
a push_token and an admin_token; over tcp with CURVE a push key folder and an admin key folder (its own key is admin).
A reader may not reload (from a folder of its choosing or the configured one), stop or push; a pusher may not reload
or stop; whatever is refused changes nothing. A reload reads only the configured checkpoint or a folder under
`checkpoint_roots`, and the ledger records the folder it built from. A build that never ends cannot keep `stop` or
SIGTERM from ending the daemon within stop_timeout_s, and what it made is unlinked.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time

import pytest
import torch

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import DaemonTimeout, PermissionDenied, PushDenied
from expertd.security import Credentials, create_keys
from helpers import freeze
from helpers.daemon import expertd_cmd

READ_TOKEN = "read-token-0123456789abcdef"
PUSH_TOKEN = "push-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
NORM = "model.norm.weight"

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def altered_copy(checkpoint: str, folder: str, value: float = 7.0) -> str:
    """A copy of `checkpoint` whose model.norm.weight is `value` everywhere (its bytes rewritten in place)."""
    shutil.copytree(checkpoint, folder)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shard = os.path.join(folder, json.load(f)["weight_map"][NORM])
    with open(shard, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(size))[NORM]
        begin, end = entry["data_offsets"]
        f.seek(8 + size + begin)
        f.write(torch.full(((end - begin) // 2,), value, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    return folder


class Deployment:
    """A daemon and the credentials of its reader, pusher and admin."""

    def __init__(self, daemon, roles: dict[str, Credentials]):
        self.daemon, self.roles = daemon, roles

    def conn(self, role: str, timeout: float = 30.0) -> Connection:
        return Connection(self.daemon.endpoint, timeout=timeout, credentials=self.roles[role])

    def request(self, role: str, op: str, **fields) -> dict:
        conn = self.conn(role)
        try:
            return conn.request(op, **fields)
        finally:
            conn.close()

    def norm(self) -> torch.Tensor:
        """What a worker reads as model.norm.weight now."""
        with ExpertClient(self.daemon.endpoint, credentials=self.roles["reader"], heartbeat=False) as worker:
            return worker.tensors()[NORM].clone()

    def generation(self) -> int:
        return self.request("reader", "status")["generation"]

    def wait_job(self, role: str, job: dict) -> dict:
        while job["state"] in ("building", "built"):
            time.sleep(0.05)
            job = self.request(role, "job", job=job["job"])
        return job


@pytest.fixture(params=["ipc", "curve"])
def deployment(request, tiny_checkpoint, start_daemon, tmp_path):
    """A daemon with the three permissions apart: tokens over ipc, CURVE keys over tcp (tokens too: the auth_token)."""
    def start(**extra) -> Deployment:
        if request.param == "ipc":
            d = start_daemon(tiny_checkpoint, auth_token=READ_TOKEN, push_token=PUSH_TOKEN, admin_token=ADMIN_TOKEN,
                             **extra)
            return Deployment(d, {"reader": Credentials(token=READ_TOKEN),
                                  "pusher": Credentials(token=READ_TOKEN, push_token=PUSH_TOKEN),
                                  "admin": Credentials(token=READ_TOKEN, admin_token=ADMIN_TOKEN)})
        root = tmp_path / "keys"
        daemon = create_keys(str(root), "daemon")
        pairs = {role: create_keys(str(root / folder), role)[1]
                 for role, folder in (("pusher", "push"), ("admin", "admins"), ("reader", "readers"))}
        d = start_daemon(tiny_checkpoint, wait=False, endpoint=f"tcp://127.0.0.1:{free_port()}",
                         curve_secret_key=daemon[1], curve_push_keys=str(root / "push"),
                         curve_admin_keys=str(root / "admins"), **extra)
        done = subprocess.run(expertd_cmd("status", "--config", d.config, "--wait", "120"), capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        return Deployment(d, {role: Credentials.resolve(server_key=daemon[0], client_key=pair)
                              for role, pair in pairs.items()})
    start.transport = request.param
    return start


def still_serving(dep: Deployment, generation: int = 1, norm: torch.Tensor | None = None) -> None:
    assert dep.daemon.proc.poll() is None, "the daemon stopped"
    assert dep.generation() == generation
    if norm is not None:
        assert torch.equal(dep.norm(), norm)


@pytest.mark.parametrize("extra, message", [
    ({"admin_token": "short"}, "admin_token must be a string of at least 16 characters"),
    ({"admin_token": READ_TOKEN, "auth_token": READ_TOKEN}, "neither the auth_token nor the push_token"),
    ({"admin_token": PUSH_TOKEN, "push_token": PUSH_TOKEN}, "neither the auth_token nor the push_token"),
    ({"curve_admin_keys": "/tmp"}, "apply to tcp:// endpoints"),
    ({"checkpoint_roots": "/srv/checkpoints"}, "checkpoint_roots must be a list"),
    ({"stop_timeout_s": "soon"}, "stop_timeout_s"),
])
def test_permission_settings_are_checked(tmp_path, extra, message):
    from expertd.errors import ConfigError
    from expertd.server.daemon.config import config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"checkpoint": str(tmp_path), **extra})
    cfg = config_from_dict({"checkpoint": str(tmp_path), "stop_timeout_s": "500ms", "checkpoint_roots": ["a/../b"]},
                           base_dir=str(tmp_path))
    assert cfg.stop_timeout_s == 0.5 and cfg.checkpoint_roots == [os.path.realpath(tmp_path / "b")]


# --- a reader -------------------------------------------------------------------------------------------

def test_reader_cannot_reload_from_a_folder_of_its_own(deployment, tiny_checkpoint, tmp_path):
    dep = deployment()
    norm = dep.norm()
    foreign = altered_copy(tiny_checkpoint, str(tmp_path / "foreign"))
    with pytest.raises(PermissionDenied, match="op 'reload' needs the 'admin' permission"):
        dep.request("reader", "reload", checkpoint=foreign)
    assert dep.request("reader", "status")["job"]["kind"] == "load"  # no build started: the last job is the first
    still_serving(dep, 1, norm)
    assert not torch.equal(norm, torch.full_like(norm, 7.0))


def test_reader_cannot_reload_the_configured_checkpoint(deployment, tiny_checkpoint):
    dep = deployment()
    with pytest.raises(PermissionDenied, match="'admin' permission"):
        dep.request("reader", "reload")
    with pytest.raises(PermissionDenied, match="'admin' permission"):
        dep.request("reader", "reload", checkpoint=tiny_checkpoint)
    still_serving(dep, 1)


@pytest.mark.parametrize("keep", [False, True])
def test_reader_cannot_stop_the_daemon(deployment, keep):
    dep = deployment()
    with pytest.raises(PermissionDenied, match="op 'stop' needs the 'admin' permission"):
        dep.request("reader", "stop", **({"keep": True} if keep else {}))
    time.sleep(0.5)
    still_serving(dep, 1)


def test_reader_cannot_push(deployment):
    dep = deployment()
    norm = dep.norm()
    with ExpertClient(dep.daemon.endpoint, credentials=dep.roles["reader"]) as reader:
        with pytest.raises(PermissionDenied, match="'push' permission"):  # PushDenied, a PermissionDenied
            reader.update({NORM: torch.zeros_like(norm)})
    still_serving(dep, 1, norm)


# --- a pusher -------------------------------------------------------------------------------------------

def test_pusher_pushes_but_cannot_reload_or_stop(deployment, tiny_checkpoint):
    dep = deployment()
    norm = dep.norm()
    with ExpertClient(dep.daemon.endpoint, credentials=dep.roles["pusher"]) as trainer:
        assert trainer.update({NORM: norm * 2}) == 2
    for op, fields in (("reload", {}), ("reload", {"checkpoint": tiny_checkpoint}), ("stop", {}),
                       ("stop", {"keep": True})):
        with pytest.raises(PermissionDenied, match=f"op '{op}' needs the 'admin' permission") as refused:
            dep.request("pusher", op, **fields)
        assert not isinstance(refused.value, PushDenied)
    still_serving(dep, 2, norm * 2)


# --- an admin -------------------------------------------------------------------------------------------

def test_admin_reload_outside_checkpoint_roots_is_refused_before_anything_is_opened(deployment, tiny_checkpoint,
                                                                                     tmp_path):
    roots = tmp_path / "roots"
    roots.mkdir()
    dep = deployment(checkpoint_roots=[str(roots)])
    norm = dep.norm()
    outside = altered_copy(tiny_checkpoint, str(tmp_path / "outside"))
    os.symlink(outside, roots / "link")  # a link under a root to a folder outside it
    os.chmod(outside, 0o000)  # opening anything in it would fail with another error (root reads anyway: see below)
    try:
        for named in (outside, str(roots / "link"), f"{roots}/../outside", str(tmp_path / "missing")):
            with pytest.raises(PermissionDenied, match="checkpoint_roots") as refused:
                dep.request("admin", "reload", checkpoint=named)
            assert os.path.realpath(named) in str(refused.value)  # not a checkpoint error: nothing was opened
    finally:
        os.chmod(outside, 0o755)
    assert dep.request("admin", "status")["job"]["kind"] == "load"  # no reload job was started
    still_serving(dep, 1, norm)


def test_admin_reload_under_checkpoint_roots_is_served_and_recorded(tiny_checkpoint, start_daemon, tmp_path):
    roots = tmp_path / "roots"
    folder = altered_copy(tiny_checkpoint, str(roots / "candidate"))
    d = start_daemon(tiny_checkpoint, auth_token=READ_TOKEN, push_token=PUSH_TOKEN, admin_token=ADMIN_TOKEN,
                     checkpoint_roots=[str(roots)])
    dep = Deployment(d, {"reader": Credentials(token=READ_TOKEN), "admin": Credentials(token=READ_TOKEN,
                                                                                      admin_token=ADMIN_TOKEN)})
    job = dep.wait_job("admin", dep.request("admin", "reload", checkpoint=f"{roots}/./candidate"))
    assert job["state"] == "published" and job["generation"] == 2, job
    assert torch.equal(dep.norm(), torch.full_like(dep.norm(), 7.0))
    assert dep.request("reader", "status")["checkpoint"] == folder
    run_dir = os.path.join(os.path.dirname(d.config), "run")
    with open(os.path.join(run_dir, f"{d.namespace}.gen2.json")) as f:
        assert json.load(f)["built_under"]["checkpoint"] == folder  # not the configured checkpoint
    job = dep.wait_job("admin", dep.request("admin", "reload"))  # back to the configured one
    assert job["state"] == "published" and dep.request("reader", "status")["checkpoint"] == tiny_checkpoint
    with open(os.path.join(run_dir, f"{d.namespace}.gen3.json")) as f:
        assert json.load(f)["built_under"]["checkpoint"] == tiny_checkpoint


def test_cli_on_the_host_is_admin_from_the_config(deployment):
    dep = deployment()
    done = subprocess.run(expertd_cmd("stop", "--config", dep.daemon.config), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert dep.daemon.proc.wait(30) == 0


def test_single_user_config_keeps_every_op_open(tiny_checkpoint, start_daemon):
    """No token, no key, no group: whoever may open the 0600 socket (this uid) may do everything, as before."""
    d = start_daemon(tiny_checkpoint)
    assert oct(os.stat(d.endpoint[len("ipc://"):]).st_mode & 0o777) == "0o600"
    dep = Deployment(d, {"reader": Credentials()})
    norm = dep.norm()
    with ExpertClient(d.endpoint, credentials=Credentials()) as client:
        assert client.update({NORM: norm * 3}) == 2
    job = dep.wait_job("reader", dep.request("reader", "reload"))
    assert job["state"] == "published" and job["generation"] == 3
    dep.request("reader", "stop")
    assert d.proc.wait(30) == 0


# --- a build that never ends ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def larger_checkpoint(tmp_path_factory) -> str:
    """~0.1 GB once dequantized: a reload of it plans (a meta model) and builds for a few tenths of a second, long
    enough to be caught in it."""
    from expertd.tools.generate import generate

    folder = str(tmp_path_factory.mktemp("roots") / "larger")
    generate(folder, preset="dsv3-bytes", seed=1, shards=3)
    return folder


def _freeze_answering(d, tid: int, job: int, said: list, tries: int = 10) -> None:
    """Freeze the build thread `tid` where the daemon still answers and the thread holds none of the locks a stop
    needs, as a read hung in the kernel holds neither the GIL nor a lock of the program: a place where the daemon
    does not answer, or where the thread's Python stack (the daemon's faulthandler dump on SIGQUIT) is inside logging
    (its handler's lock: the stop logs) or an import, is thawed and another one tried. What the daemon wrote to
    stderr meanwhile is appended to `said`."""
    for _ in range(tries):
        freeze.freeze(d.proc.pid, tid)
        probe = Connection(d.endpoint, timeout=3, credentials=Credentials(admin_token=ADMIN_TOKEN))
        try:
            state = probe.request("job", job=job)["state"]
        except DaemonTimeout:
            freeze.thaw(tid)
            continue
        finally:
            probe.close()
        assert state == "building", f"the reload was {state} before its thread was caught waiting"
        stack = freeze.python_stack(d.proc, "jobs.py", said)
        if "logging" in stack or "importlib" in stack:
            freeze.thaw(tid)
            continue
        return
    pytest.fail(f"the daemon never answered with its build thread frozen ({tries} places tried)")


@pytest.mark.skipif(freeze.FUTEX is None, reason="ptrace syscall numbers known for x86_64 and aarch64 only")
@pytest.mark.parametrize("how", ["stop", "sigterm"])
def test_stop_ends_the_daemon_while_a_build_hangs(how, tiny_checkpoint, larger_checkpoint, start_daemon, namespace):
    """The reload's build thread is stopped with ptrace where it waits (as on a hung file system): `stop` and SIGTERM
    still end the daemon within stop_timeout_s, exit 0, and leave no segment of the unfinished build."""
    stop_timeout_s = 1.0
    # layout_cache off: the reload plans with transformers (a meta model) as the larger checkpoint's docstring says
    d = start_daemon(tiny_checkpoint, admin_token=ADMIN_TOKEN, stop_timeout_s=stop_timeout_s,
                     checkpoint_roots=[os.path.dirname(larger_checkpoint)], layout_cache=False)
    conn = Connection(d.endpoint, timeout=30, credentials=Credentials(admin_token=ADMIN_TOKEN))
    frozen, code = None, None
    try:
        job = conn.request("reload", checkpoint=larger_checkpoint)
        frozen = freeze.thread_named(d.proc.pid, "expertd-reload")  # the job's thread, named by the daemon
        said = []  # the daemon's stderr read while freezing
        _freeze_answering(d, frozen, job["job"], said)
        started = time.monotonic()
        if how == "stop":
            conn.request("stop")
        else:
            d.proc.send_signal(signal.SIGTERM)
        code = freeze.wait_exit(d.proc, frozen, stop_timeout_s + 10)
        assert code is not None, (f"the daemon did not end within stop_timeout_s ({stop_timeout_s}s) + 10s; thread "
                                  f"{frozen} frozen\n{freeze.where(d.proc)}")
        assert time.monotonic() - started < stop_timeout_s + 10
        os.set_blocking(d.proc.stderr.fileno(), True)
        log = "".join(said) + d.proc.stderr.read()
        assert code == 0, log
        # caught building: abandoned after stop_timeout_s; caught still planning (reading headers): not waited for
        assert "did not stop within stop_timeout_s" in log or "had not started building" in log, log
        assert not glob.glob(f"/dev/shm/{namespace}*")
    finally:
        conn.close()
        if frozen is not None and code is None:  # end it whatever it does, and collect the frozen thread
            d.proc.send_signal(signal.SIGTERM)
            if freeze.wait_exit(d.proc, frozen, 30) is None:
                d.proc.kill()
                freeze.wait_exit(d.proc, frozen, 30)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_group_daemon_without_tokens_lets_its_group_read_and_its_own_uid_administer(tiny_checkpoint, start_daemon):
    """`group` and no token: a group member of another uid may read but not stop; the daemon's own uid (as the
    kernel names the sender, SO_PEERCRED) may, as `expertd stop --keep --config` in a Kubernetes preStop does."""
    d = start_daemon(tiny_checkpoint, group="root")
    member = ["setpriv", "--reuid", "65534", "--regid", "65534", "--groups", "0", "--inh-caps", "+dac_read_search",
              "--ambient-caps", "+dac_read_search"]  # another uid in the daemon's group (reads root's venv)
    script = ("import sys; from expertd.connection import Connection; from expertd.errors import PermissionDenied\n"
              "c = Connection(sys.argv[1], timeout=30)\nprint(c.request('status')['state'])\n"
              "try:\n    c.request('stop')\nexcept PermissionDenied as e:\n    print('denied', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in os.sys.path if p)}
    done = subprocess.run(member + [os.sys.executable, "-c", script, d.endpoint], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    state, denied = done.stdout.strip().splitlines()
    assert state == "serving" and denied.startswith("denied") and "'admin' permission" in denied, done.stdout
    assert d.proc.poll() is None
    done = subprocess.run(expertd_cmd("stop", "--config", d.config), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert d.proc.wait(30) == 0
