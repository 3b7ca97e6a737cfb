"""Today's Python client and daemon still speak the golden protocol vectors (tests/golden/protocol).

The real code paths (`ExpertClient`, `push_all`, `Connection`) run the capture scenario against a real daemon:
what they send and receive has the golden shapes (field names and msgpack types); and a daemon accepts the golden
requests byte for byte (but for the lease id, 128 random bits: the one the daemon grants stands for the golden one).
The vectors themselves are checked in tests/test_protocol_golden.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers/

from expertd.protocol import pack  # noqa: E402
from helpers.golden import (  # noqa: E402
    LEASE_TIMEOUT_S, REPLAY, TINY, TOKEN, build_golden, load, run_scenario, shape, shape_diff,
)


@pytest.fixture(scope="module")
def golden() -> dict:
    return load()


def test_python_client_and_daemon_still_speak_the_golden_shapes(golden, start_daemon, namespace):
    d = start_daemon(str(TINY), auth_token=TOKEN, lease_timeout_s=LEASE_TIMEOUT_S)
    pid = d.status()["pid"]
    rec = run_scenario(d.endpoint)
    assert d.proc.wait(30) == 0  # the scenario ends with `stop`
    got, _ = build_golden(rec, namespace, pid, d.endpoint)
    problems = []
    for name, entry in golden["messages"].items():
        for side in ("request", "reply"):
            mine = got["messages"][name][side]
            problems += [f"{name} {side}{p}" for p in shape_diff(shape(mine["decoded"]), shape(entry[side]["decoded"]))]
            # requests go out as canonical msgpack of their map, whatever their values
            if side == "request":
                assert pack(mine["decoded"]) == bytes.fromhex(mine["hex"])
    for x in rec.exchanges:  # every request on the wire is the packed map, nothing else
        assert x.request_bytes == pack(x.request)
    assert not problems, "the wire contract drifted from tests/golden/protocol (regenerate on purpose, update " \
                         "PROTOCOL.md):\n" + "\n".join(problems)


def test_daemon_accepts_the_golden_requests(golden, start_daemon):
    d = start_daemon(str(TINY), auth_token=TOKEN, lease_timeout_s=LEASE_TIMEOUT_S)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(d.endpoint)
    problems = []
    try:
        granted = None  # lease ids are 128 random bits: the golden lease's id stands for the one this daemon grants
        golden_lease = golden["messages"]["lease"]["reply"]["decoded"]["client"]
        for name in REPLAY:
            entry = golden["messages"][name]
            request = bytes.fromhex(entry["request"]["hex"])
            if granted is not None and entry["request"]["decoded"].get("client") == golden_lease:
                request = pack({**entry["request"]["decoded"], "client": granted})
            sock.send(request)
            reply = msgpack.unpackb(sock.recv(), raw=False)
            if name == "lease":
                granted = reply["client"]
            problems += [f"{name} reply{p}" for p in shape_diff(shape(reply), shape(entry["reply"]["decoded"]))]
            if "error" in entry:
                assert reply.get("error") == entry["error"], (name, reply)
            else:
                assert reply["ok"] is True, (name, reply)
    finally:
        sock.close(0)
        ctx.term()
    assert not problems, "\n".join(problems)
    assert d.status()["leases"] == []  # the golden release gave back the golden lease
