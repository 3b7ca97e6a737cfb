"""Clients check whose daemon they talk to before they trust it: each test performs one attack the review found.

A user who owns the socket folder can replace the socket and collect the token of every client that connects
(its first request carries it). The Python and the C++ client check the folder and the socket first (expertd/trust.py:
writable by its owner only, owned by root, the client's uid, $EXPERTD_DAEMON_UID, or given to its owner by root) and
refuse with DaemonNotTrusted naming the path, owner and mode, having sent nothing; a segment that belongs to nobody
they trust is not mapped. Another user is uid 65534 (root hands it the files with chown).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import zmq

from expertd.client import ExpertClient
from expertd.errors import DaemonNotTrusted
from test_cpp_client import cpp_build, dump  # noqa: F401  (the session's C++ build)

NOBODY = 65534
TOKEN = "the-victims-token-0123456789"

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0, reason="hands files to another uid: needs root (chown)")]


@pytest.fixture(autouse=True)
def _trusting_nobody_yet():
    """This process trusts no daemon uid found earlier: a test before this one in the same worker process may have
    attached to a daemon of uid 65534 (`expertd.trust` remembers the uids behind sockets it trusted)."""
    from expertd import trust

    before = set(trust._daemons)
    trust._daemons.clear()
    yield
    trust._daemons.clear()
    trust._daemons.update(before)


@pytest.fixture
def planted():
    """A fake daemon: a socket listening in a folder of /tmp that another user owns, as that user would plant it;
    yields (endpoint, folder, the socket that records what reaches it)."""
    folder = tempfile.mkdtemp(prefix="expertd-planted-", dir="/tmp")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{folder}/expertd.sock"
    sock.bind(endpoint)
    os.chmod(folder, 0o755)
    for path in (folder, f"{folder}/expertd.sock"):
        os.chown(path, NOBODY, NOBODY)
    try:
        yield endpoint, folder, sock
    finally:
        sock.close(0)
        ctx.term()
        shutil.rmtree(folder)


def collected(sock: zmq.Socket) -> list[bytes]:
    """Everything that reached the fake daemon within half a second."""
    got = []
    while sock.poll(500):
        got += sock.recv_multipart()
    return got


def test_the_python_client_refuses_a_socket_planted_by_another_user(planted):
    endpoint, folder, sock = planted
    with pytest.raises(DaemonNotTrusted, match=f"{folder}.*uid {NOBODY}.*mode 0755"):
        ExpertClient(endpoint, token=TOKEN, timeout=2)
    assert not any(TOKEN.encode() in frame for frame in collected(sock))
    assert collected(sock) == []  # nothing at all was sent


def test_the_cpp_client_refuses_a_socket_planted_by_another_user(planted, cpp_build):  # noqa: F811
    endpoint, folder, sock = planted
    env = {"PATH": os.environ["PATH"], "EXPERTD_TOKEN": TOKEN}
    run = subprocess.run([str(cpp_build / "expertd-cpp-dump"), endpoint, "--timeout-ms", "2000"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.returncode == 10 and "DaemonNotTrusted" in run.stderr and folder in run.stderr, run.stderr
    assert f"uid {NOBODY}" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert collected(sock) == []


def test_a_segment_of_another_user_is_not_mapped(tiny_checkpoint, start_daemon, cpp_build):  # noqa: F811
    daemon = start_daemon(tiny_checkpoint)
    path = "/dev/shm/" + daemon.status()["segments"][0].lstrip("/")
    os.chown(path, NOBODY, NOBODY)  # as if another user's file stood under the segment's name
    try:
        with ExpertClient(daemon.endpoint, heartbeat=False) as client:
            with pytest.raises(DaemonNotTrusted, match=f"{path}.*uid {NOBODY}"):
                client.tensors()
        run = dump(cpp_build, daemon.endpoint)
        assert run.returncode == 10 and path in run.stderr, run.stderr
    finally:
        os.chown(path, 0, 0)  # the daemon unlinks only what its uid owns
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        assert client.verify() == []
