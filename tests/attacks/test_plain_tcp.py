"""No secrets over plain tcp: a listener that holds the daemon's port receives no token.

The review's attack (issue 37, finding 11): with `tcp://` and no CURVE, a uid that binds the port while the daemon
is down received `token` and `admin_token` from `expertd stop --config`, and the CLI then failed with a
`KeyError: 'namespace'` traceback. Any local uid may bind a free tcp port, so the impostor here is a plain ZeroMQ
REP socket on 127.0.0.1 that records what it is sent. Clients and the CLI refuse to put a token on such an endpoint
unless told to (`allow_plain_tcp_tokens: true` in the config, EXPERTD_ALLOW_PLAIN_TCP_TOKENS=1,
`ExpertClient(..., allow_plain_tcp_tokens=True)`); a reply without a daemon's status fields is one line; a daemon
started so logs one warning line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import msgpack
import pytest
import yaml
import zmq

from expertd.connection import Connection
from expertd.errors import ConfigError
from expertd.security import PLAIN_TCP_ENV, Credentials
from helpers.daemon import expertd_cmd
from test_cpp_client import cpp_build  # noqa: F401  (the session's C++ build)

pytestmark = pytest.mark.timeout(300)

TOKEN = "plain-tcp-auth-token-0123456789"
ADMIN = "plain-tcp-admin-token-0123456789"
SECRETS = ("token", "push_token", "admin_token")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Impostor:
    """A REP socket on tcp://127.0.0.1:PORT answering every request with `reply`; `received` is what it was sent."""

    def __init__(self, reply: dict):
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.reply, self.received = reply, []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self.received.append(msgpack.unpackb(self._sock.recv(), raw=False))
                self._sock.send(msgpack.packb(self.reply))

    def secrets(self) -> list[str]:
        return [k for m in self.received for k in SECRETS if k in m]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def impostor():
    made = []

    def make(reply: dict | None = None) -> Impostor:
        made.append(Impostor({"ok": True} if reply is None else reply))
        return made[-1]

    yield make
    for one in made:
        one.close()


def config(folder, endpoint: str, **keys) -> str:
    path = os.path.join(str(folder), "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"checkpoint": str(folder), "endpoint": endpoint, "namespace": "plaintcp", **keys}, f)
    return path


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k != PLAIN_TCP_ENV}
    return subprocess.run(expertd_cmd(*args), capture_output=True, text=True, timeout=120, env=env)


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_client_sends_no_token_in_clear(impostor, monkeypatch):
    monkeypatch.delenv(PLAIN_TCP_ENV, raising=False)
    fake = impostor()
    conn = Connection(fake.endpoint, timeout=5, credentials=Credentials.resolve(token=TOKEN, admin_token=ADMIN))
    try:
        with pytest.raises(ConfigError) as refused:
            conn.request("status")
        with pytest.raises(ConfigError):
            conn.request("stop")
    finally:
        conn.close()
    words = str(refused.value)
    assert fake.endpoint in words and "allow_plain_tcp_tokens" in words and PLAIN_TCP_ENV in words
    assert "binds that port" in words and "auth_token" in words
    assert fake.received == []  # nothing went out


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_client_told_so_sends_tokens_in_clear(impostor, monkeypatch, how):
    monkeypatch.delenv(PLAIN_TCP_ENV, raising=False)
    if how == "environment":
        monkeypatch.setenv(PLAIN_TCP_ENV, "1")
    fake = impostor()
    credentials = Credentials.resolve(token=TOKEN, admin_token=ADMIN,
                                      allow_plain_tcp_tokens=True if how == "argument" else None)
    conn = Connection(fake.endpoint, timeout=5, credentials=credentials)
    try:
        conn.request("stop")
    finally:
        conn.close()
    assert fake.received[0]["token"] == TOKEN and fake.received[0]["admin_token"] == ADMIN  # the risk it took


def test_a_client_without_tokens_still_talks_plain_tcp(impostor, monkeypatch):
    monkeypatch.delenv(PLAIN_TCP_ENV, raising=False)
    monkeypatch.delenv("EXPERTD_TOKEN", raising=False)
    fake = impostor()
    conn = Connection(fake.endpoint, timeout=5, credentials=Credentials())
    try:
        assert conn.request("status") == {"ok": True}
    finally:
        conn.close()
    assert fake.secrets() == []


def test_the_cpp_client_sends_no_token_in_clear(impostor, cpp_build):  # noqa: F811
    """The C++ client refuses as the Python one does (ConfigError, exit 2, naming the option) before any byte goes
    out; told so by $EXPERTD_ALLOW_PLAIN_TCP_TOKENS=1 it sends the token (the impostor is a real listener)."""
    fake = impostor()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    tool = [str(cpp_build / "expertd-cpp-dump"), fake.endpoint, "--token", TOKEN, "--timeout-ms", "2000"]
    run = subprocess.run(tool, capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2 and "ConfigError" in run.stderr and "EXPERTD_ALLOW_PLAIN_TCP_TOKENS" in run.stderr, \
        run.stderr
    assert fake.received == []
    subprocess.run(tool, capture_output=True, text=True, timeout=60, env={**env, PLAIN_TCP_ENV: "1"})
    assert "token" in fake.secrets()  # the control: the same listener does receive what a client sends


def test_stop_with_a_config_sends_no_token_to_whoever_holds_the_port(impostor, tmp_path):
    fake = impostor()
    cfg = config(tmp_path, fake.endpoint, auth_token=TOKEN, admin_token=ADMIN)
    line = one_line(cli("stop", "--config", cfg))
    assert "ConfigError" in line and fake.endpoint in line and "allow_plain_tcp_tokens" in line, line
    assert fake.received == []


def test_stop_reads_a_reply_without_status_fields_as_one_line(impostor, tmp_path):
    fake = impostor()  # answers {"ok": true}: no pid, no namespace
    cfg = config(tmp_path, fake.endpoint, admin_token=ADMIN)  # status carries no token; stop would carry the admin's
    line = one_line(cli("stop", "--config", cfg))
    assert "ProtocolError" in line and "status" in line and "missing" in line, line
    assert [m["op"] for m in fake.received] == ["status"] and fake.secrets() == []  # no stop, no admin_token


def test_stop_refuses_to_send_the_admin_token_even_after_a_plausible_status(impostor, tmp_path):
    fake = impostor({"ok": True, "state": "serving", "pid": 1, "endpoint": "tcp://127.0.0.1:1", "generation": 1})
    cfg = config(tmp_path, fake.endpoint, admin_token=ADMIN)
    line = one_line(cli("stop", "--config", cfg))
    assert "admin_token" in line and "allow_plain_tcp_tokens" in line, line
    assert fake.secrets() == []


def test_a_config_that_allows_plain_tcp_tokens_sends_them(impostor, tmp_path):
    fake = impostor()
    cfg = config(tmp_path, fake.endpoint, auth_token=TOKEN, admin_token=ADMIN, allow_plain_tcp_tokens=True)
    done = cli("stop", "--config", cfg)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr  # the impostor's reply: one line
    assert fake.received and fake.received[0]["token"] == TOKEN  # the config took that risk, by name


def test_a_daemon_on_plain_tcp_with_tokens_warns_once(tiny_checkpoint, start_daemon, monkeypatch):
    monkeypatch.setenv(PLAIN_TCP_ENV, "1")  # this test's own clients (status) may send the token in clear
    daemon = start_daemon(tiny_checkpoint, endpoint=f"tcp://127.0.0.1:{free_port()}", auth_token=TOKEN)
    daemon.proc.terminate()
    log = daemon.proc.communicate(timeout=60)[1]
    assert daemon.proc.returncode == 0, log
    warned = [line for line in log.splitlines() if "has no CURVE" in line]
    assert len(warned) == 1 and "auth_token" in warned[0] and "allow_plain_tcp_tokens" in warned[0], log
