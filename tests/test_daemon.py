"""The control plane of a real daemon process: replies to good and bad messages, leases, timeouts."""

import os
import socket
import time

import msgpack
import pytest
import zmq

from expertd.client import DaemonNotRunning, DaemonTimeout, ExpertClient
from expertd.connection import Connection
from expertd.errors import DaemonError, ProtocolError
from expertd.protocol import PROTOCOL_VERSION
from expertd.server.serving.leases import lease_tag

from helpers.polling import wait_until

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)
LEASE_TIMEOUT_S = 2.0  # the `raw` daemon's: short, so that a lease outlives it or ends within seconds


@pytest.fixture
def raw(start_daemon, tiny_checkpoint):
    """A serving daemon and a raw REQ socket factory to poke it with."""
    daemon = start_daemon(tiny_checkpoint, lease_timeout_s=LEASE_TIMEOUT_S)
    ctx = zmq.Context()
    sockets = []

    def request(payload: bytes, timeout_ms: int = 5000):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.connect(daemon.endpoint)
        sockets.append(sock)
        sock.send(payload)
        return msgpack.unpackb(sock.recv(), raw=False)

    yield daemon, request
    for s in sockets:
        s.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("payload, error", [
    (b"\xc1garbage", "ProtocolError"),
    (msgpack.packb([1, 2, 3]), "ProtocolError"),
    (msgpack.packb({"no": "op"}), "ProtocolError"),
    (msgpack.packb({"op": 7}), "ProtocolError"),
    (msgpack.packb({"op": "explode"}), "ProtocolError"),
    (msgpack.packb({"op": "hello", "protocol": PROTOCOL_VERSION + 1}), "VersionMismatch"),
    (msgpack.packb({"op": "lease", "pid": -5}), "ProtocolError"),
    (msgpack.packb({"op": "lease", "pid": 1, "protocol": PROTOCOL_VERSION + 1}), "VersionMismatch"),
    (msgpack.packb({"op": "lease", "pid": 2**40}), "ProtocolError"),
    (msgpack.packb({"op": "heartbeat"}), "ProtocolError"),
    (msgpack.packb({"op": "heartbeat", "client": "nobody"}), "LeaseExpired"),
    (msgpack.packb({"op": "release", "client": ["x"]}), "ProtocolError"),
], ids=["garbage", "array", "no-op", "int-op", "unknown-op", "hello-version", "negative-pid", "huge-pid",
        "lease-version", "heartbeat-no-client", "heartbeat-unknown", "release-list"])
def test_bad_messages_get_error_replies_and_the_daemon_keeps_serving(raw, payload, error):
    daemon, request = raw
    reply = request(payload)
    assert reply["ok"] is False and reply["error"] == error and reply["message"]
    assert request(msgpack.packb({"op": "status"}))["state"] == "serving"
    with ExpertClient(daemon.endpoint, timeout=30) as client:
        assert len(client.tensors()) > 0


def test_lease_lifecycle(raw):
    daemon, request = raw
    hello = request(msgpack.packb({"op": "hello", "protocol": PROTOCOL_VERSION}))
    assert hello["ok"] and hello["ready"] and hello["generation"] == 1
    lease = request(msgpack.packb({"op": "lease", "pid": os.getpid()}))["client"]
    assert [held["client"] for held in daemon.status()["leases"]] == [lease_tag(lease)]  # never the id itself
    assert request(msgpack.packb({"op": "heartbeat", "client": lease}))["ok"]
    # without heartbeats the lease goes (a lease timeout after this one: to the instant in test_lease_table)
    wait_until(lambda: daemon.status()["leases"] == [], "the silent lease ends", timeout=30)
    assert request(msgpack.packb({"op": "heartbeat", "client": lease}))["error"] == "LeaseExpired"


def test_heartbeats_keep_a_client_lease_alive(raw):
    daemon, _ = raw
    with ExpertClient(daemon.endpoint, timeout=30) as client:
        first = lease_tag(client.lease)

        def outlived_its_timeout() -> bool:  # by the daemon's clock; the same lease all along, not one taken again
            rows = daemon.status()["leases"]
            assert [row["client"] for row in rows] == [first], f"the lease ended although its client beat: {rows}"
            return rows[0]["age_s"] > 1.5 * LEASE_TIMEOUT_S

        wait_until(outlived_its_timeout, "the client's lease lives past its timeout", timeout=60)
        assert lease_tag(client.lease) == first
    assert daemon.status()["leases"] == []


def test_no_daemon_fails_at_once_naming_the_socket(tmp_path):
    started = time.monotonic()
    with pytest.raises(DaemonNotRunning, match=r"nobody\.sock does not exist.*expertd start --config"):
        ExpertClient(f"ipc://{tmp_path}/nobody.sock", timeout=30)
    assert time.monotonic() - started < 30  # no wait for the timeout: there is no socket file at all
    conn = Connection(f"ipc://{tmp_path}/nobody.sock", timeout=30)
    with pytest.raises(ConnectionError):  # the standard class works too
        conn.request("status")
    conn.close()


def test_a_socket_that_does_not_answer_is_a_typed_timeout(tmp_path):
    path = str(tmp_path / "stuck.sock")
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.bind(path)
    stuck.listen()  # the file exists and takes connections, nobody answers
    try:
        with pytest.raises(DaemonTimeout, match="did not answer attach") as info:
            ExpertClient(f"ipc://{path}", timeout=0.5)
        assert "'lease'" not in str(info.value)
        conn = Connection(f"ipc://{path}", timeout=0.2)
        with pytest.raises(TimeoutError, match="did not answer status"):
            conn.request("status")
        conn.close()
    finally:
        stuck.close()


def test_a_socket_file_nobody_listens_on_is_no_daemon(tmp_path):
    path = str(tmp_path / "killed.sock")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)  # what a daemon killed with -9 leaves: the file, no listener
    left.close()
    started = time.monotonic()
    with pytest.raises(DaemonNotRunning, match=r"nothing listens on its socket file .*killed\.sock.*expertd start"):
        ExpertClient(f"ipc://{path}", timeout=30)
    assert time.monotonic() - started < 30  # refused at once, not after the 30 s timeout


def test_a_request_over_the_message_cap_is_refused_before_it_is_sent(start_daemon, tiny_checkpoint):
    daemon = start_daemon(tiny_checkpoint)
    conn = Connection(daemon.endpoint, timeout=30)
    try:
        with pytest.raises(ProtocolError,
                           match=r"status is a \d+-byte request; the daemon takes requests of at most 1048576"):
            conn.request("status", padding="x" * (1 << 20))
        assert conn.request("status")["state"] == "serving"  # the connection still works
    finally:
        conn.close()


def test_tcp_endpoint(start_daemon, tiny_checkpoint):
    with zmq.Context() as ctx:
        probe = ctx.socket(zmq.REP)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
    daemon = start_daemon(tiny_checkpoint, endpoint=f"tcp://127.0.0.1:{port}")
    with ExpertClient(daemon.endpoint, timeout=30) as client:
        assert client.status()["endpoint"] == f"tcp://127.0.0.1:{port}"
        with pytest.raises(DaemonError, match="unknown op"):
            client._conn.request("explode")


def test_a_loading_daemon_answers_status_and_defers_the_index(tmp_path, tiny_checkpoint):
    from expertd.server.daemon.config import config_from_dict
    from expertd.server.daemon.loop import Daemon
    from expertd.server.serving.peers import Peer

    daemon = Daemon(config_from_dict({"checkpoint": tiny_checkpoint, "endpoint": f"ipc://{tmp_path}/s.sock",
                                      "namespace": "loading"}))
    local = Peer(uid=os.getuid(), pid=os.getpid())  # what the transport says beside each request
    status = daemon.handle({"op": "status"}, local)
    assert status["ok"] and status["state"] == "loading" and status["tensors"] == 0
    assert daemon.handle({"op": "index"}, local) == {"ok": False, "error": "NotReady",
                                                      "message": "the daemon is still loading"}
    lease = daemon.handle({"op": "lease", "pid": 1, "protocol": PROTOCOL_VERSION}, local)
    assert lease["ok"] and daemon.handle({"op": "heartbeat", "client": lease["client"]}, local)["ok"]


def test_a_handler_replying_with_another_class_than_its_op_declares_is_a_bug_named(tmp_path, tiny_checkpoint):
    """Dispatch checks each handler's reply against the class its request declares before serializing it."""
    from expertd import messages, replies
    from expertd.server.daemon.config import config_from_dict
    from expertd.server.daemon.loop import Daemon
    from expertd.server.serving.peers import Peer

    daemon = Daemon(config_from_dict({"checkpoint": tiny_checkpoint, "endpoint": f"ipc://{tmp_path}/s.sock",
                                      "namespace": "replies"}))
    local = Peer(uid=os.getuid(), pid=os.getpid())
    hello = {"op": "hello", "protocol": PROTOCOL_VERSION}
    assert list(daemon.handle(hello, local)) == ["ok", "protocol", "ready", "generation", "lease_timeout_s"]
    daemon.dispatch.handlers[messages.Hello] = lambda req, peer: replies.Done()
    with pytest.raises(TypeError, match="op 'hello' answered with Done, not the HelloReply its request class declares"):
        daemon.handle(hello, local)
    daemon.dispatch.handlers[messages.Hello] = lambda req, peer: {"ok": True}  # a map made by hand: refused too
    with pytest.raises(TypeError, match="answered with dict, not the HelloReply"):
        daemon.handle(hello, local)


def test_a_closed_client_keeps_no_mapping_once_its_views_are_dropped(start_daemon, tiny_checkpoint, namespace):
    import gc

    from helpers.procfs import open_paths

    def mapped() -> int:
        return len(open_paths(f"/{namespace}."))

    daemon = start_daemon(tiny_checkpoint)
    client = ExpertClient(daemon.endpoint, heartbeat=False)
    tensors = client.tensors()
    assert mapped() > 0
    kept = next(iter(tensors.values())).clone()
    client.close()
    assert mapped() > 0  # views handed out stay valid after close
    del tensors
    gc.collect()
    assert mapped() == 0  # the client's own maps went with close
    assert kept.numel() > 0
