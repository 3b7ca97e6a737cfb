"""What a client sends is bounded before the daemon reads it: each test performs one attack the review found.

libzmq caps each frame (MAXMSGSIZE = MAX_MESSAGE_BYTES on the daemon's socket: a larger frame disconnects its
peer) but not a message's frame count; the daemon refuses a request of more frames or bytes than any op takes
right after receiving it, before it decodes a byte (so before the token check), and what it received goes back to
the system with the refusal (malloc_trim: glibc keeps freed heap otherwise). What a reply or a log line repeats of
a client's values is clipped to 120 characters.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq

from expertd.protocol import MAX_MESSAGE_BYTES, MAX_REQUEST_FRAMES, PROTOCOL_VERSION, pack

pytestmark = pytest.mark.timeout(300)

TOKEN = "input-limits-token-0123456789"
MiB = 1 << 20


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def raw_socket(endpoint: str, timeout_ms: int = 20000) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(endpoint)
    return ctx, sock


def test_a_status_with_400_extra_megabyte_frames_is_refused_before_it_is_read(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, auth_token=TOKEN)
    pid = daemon.proc.pid
    before = rss_mib(pid)
    ctx, sock = raw_socket(daemon.endpoint)
    junk = bytes(MiB - 64)
    try:
        for _ in range(3):  # again and again: nothing of it stays
            sock.send_multipart([pack({"op": "status"})] + [junk] * 400, copy=False)  # and no token
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["error"] == "ProtocolError", reply  # not AuthError: refused before the token is looked at
            assert f"at most {MAX_REQUEST_FRAMES}" in reply["message"], reply
        after = rss_mib(pid)
        sock.send(pack({"op": "status", "token": TOKEN}))
        assert msgpack.unpackb(sock.recv(), raw=False)["state"] == "serving"  # still serving
    finally:
        sock.close(0)
        ctx.term()
    print(f"\ndaemon RSS {before:.0f} MiB before, {after:.0f} MiB after three 400 MiB floods, peak "
          f"{rss_mib(pid, 'VmHWM'):.0f} MiB (libzmq holds a message whole until the daemon receives it)")
    assert after < before + 64, (before, after)  # the refused floods' buffers went back to the system


def test_a_frame_over_the_cap_is_dropped_by_libzmq_and_the_daemon_serves_on(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint)
    pid = daemon.proc.pid
    before = rss_mib(pid)
    ctx, sock = raw_socket(daemon.endpoint, timeout_ms=2000)
    try:
        sock.send(pack({"op": "status", "pad": bytes(64 * MiB)}))  # one 64 MiB frame: over MAXMSGSIZE
        with pytest.raises(zmq.Again):
            sock.recv()  # libzmq dropped the peer while reading the frame's header: no reply at all
    finally:
        sock.close(0)
        ctx.term()
    assert rss_mib(pid) < before + 16  # it never held the 64 MiB
    assert daemon.status()["state"] == "serving"


def test_a_huge_client_string_is_not_echoed(tiny_checkpoint, start_daemon, tmp_path):
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, stderr=log)
    ctx, sock = raw_socket(daemon.endpoint)
    huge = "x" * (MAX_MESSAGE_BYTES - 100_000)  # 900 KB: fits one message
    try:
        for op in ("heartbeat", "refresh", "index"):
            sock.send(pack({"op": op, "client": huge}))
            frame = sock.recv()
            reply = msgpack.unpackb(frame, raw=False)
            # refused by the parser (a lease id is 32 hex digits: at most 64 characters), nothing of it echoed
            assert reply["error"] == "ProtocolError" and len(frame) < 1000, (op, len(frame))
            assert f"'client' holds {len(huge)} characters; at most 64" in reply["message"], reply["message"]
        sock.send(pack({"op": "lease", "pid": os.getpid(), "protocol": PROTOCOL_VERSION, huge: 1}))
        assert msgpack.unpackb(sock.recv(), raw=False)["ok"]  # unknown keys are ignored, not echoed
    finally:
        sock.close(0)
        ctx.term()
    assert daemon.status()["state"] == "serving"  # answered after the requests above were handled and logged
    assert os.path.getsize(log_path) < 20_000  # nothing of it logged whole
