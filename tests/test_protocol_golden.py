"""The wire contract, pinned: golden message vectors (tests/golden/protocol) that both clients test.

`messages.json` holds, per op (and per error), one request and its reply as canonical msgpack (hex) and
decoded, captured from the real code paths — `ExpertClient`, `push_all`, `Connection` — against a real
daemon on checkpoints/tiny, then normalized (see `NORMALIZATION`). `index_segment.bin` is generation 1's
index segment as `expertd.index_segment.pack` writes it (from the normalized index). The C++ client's
ctest (client/cpp/tests/golden_test.cpp) decodes and re-encodes the same vectors.

Here: the vectors are self-consistent; today's client and daemon still send and answer messages of exactly
those shapes (field names and msgpack types); the daemon accepts the golden requests as they are; the
Python side decodes the golden replies and index segment. When the protocol changes on purpose, regenerate
with `python tests/test_protocol_golden.py --regenerate` (and update PROTOCOL.md).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # helpers/, also when run as a script

import expertd.connection as connection  # noqa: E402
from expertd import index_segment  # noqa: E402
from expertd.connection import Connection  # noqa: E402
from expertd.errors import AuthError, DaemonError, GenerationGone, LeaseExpired, VariantRejected, VersionMismatch  # noqa: E402,E501
from expertd.index import TensorIndex  # noqa: E402
from expertd import messages  # noqa: E402
from expertd.errors import ProtocolError  # noqa: E402
from expertd.protocol import ERRORS, OPS, PROTOCOL_VERSION, pack, unpack_reply  # noqa: E402

GOLDEN = HERE / "golden" / "protocol"
MESSAGES = GOLDEN / "messages.json"
INDEX_BIN = GOLDEN / "index_segment.bin"
TINY = HERE.parent / "checkpoints" / "tiny"
TOKEN = "golden-token-0123456789"
WRONG_TOKEN = "wrong-token-0123456789"
LEASE_TIMEOUT_S = 5.0
PUSHED = "model.norm.weight"

# What varies between runs, and what it becomes in the vectors.
NORMAL_NAMESPACE = "golden"
NORMAL_PID = 4242  # every pid (the worker's in `lease`, the daemon's in `status` and in segment names)
NORMAL_PID_NS = 4026531836
NORMAL_START_TIME = 1000
NORMAL_ENDPOINT = "ipc:///tmp/expertd-golden/expertd.sock"
NORMAL_REPO = "/repo"
VOLATILE_FLOATS = ("uptime_s", "age_s", "idle_s", "seconds")
NORMALIZATION = (
    f"namespace -> {NORMAL_NAMESPACE!r}; every 'pid' field and the daemon pid in segment names -> {NORMAL_PID}; "
    f"'pid_ns' -> {NORMAL_PID_NS}; 'start_time' -> {NORMAL_START_TIME}; the endpoint -> {NORMAL_ENDPOINT!r}; the "
    f"repository root in paths -> {NORMAL_REPO!r}; {', '.join(VOLATILE_FLOATS)} -> 0.0; an index segment "
    "descriptor's nbytes and checksum -> those of its generation's normalized index packed by "
    "expertd.index_segment.pack. Then hex = msgpack.packb(decoded, use_bin_type=True), key order as sent."
)
# job maps (commit, job, publish, reload, status.job) carry these only in some states: present or absent alike
OPTIONAL_KEYS = ("bytes_written", "tensors_written", "bytes_read", "seconds", "error", "message")


# --- capturing what the real code paths send and receive ---------------------------------------------

@dataclass
class Exchange:
    op: str
    request: dict
    request_bytes: bytes
    reply_bytes: bytes
    reply: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.reply.get("ok"))


class Recorder:
    """Patches `expertd.connection`'s pack and unpack_reply (what every Connection.request calls): each
    request with the reply it got, on whichever thread (the heartbeat's included)."""

    def __init__(self):
        self.exchanges: list[Exchange] = []
        self.indexes: dict[int, dict] = {}  # generation -> the index dict its segment held
        self._local = threading.local()
        self._lock = threading.Lock()

    def __enter__(self):
        self._pack, self._unpack = connection.pack, connection.unpack_reply

        def recording_pack(message):
            data = self._pack(message)
            self._local.pending = (copy.deepcopy(message), data)
            return data

        def recording_unpack(frame, what):
            message, data = self._local.pending
            reply = msgpack.unpackb(frame, raw=False)
            place = reply.get("index_segment") if isinstance(reply, dict) else None
            if isinstance(place, dict) and place["generation"] not in self.indexes:
                self.indexes[place["generation"]] = index_segment.read_dict(place)  # live: the reply just named it
            with self._lock:
                self.exchanges.append(Exchange(message["op"], message, data, bytes(frame), reply))
            return self._unpack(frame, what)

        connection.pack, connection.unpack_reply = recording_pack, recording_unpack
        return self

    def __exit__(self, *exc):
        connection.pack, connection.unpack_reply = self._pack, self._unpack

    def where(self, op: str, pred=lambda x: True) -> list[Exchange]:
        with self._lock:
            return [x for x in self.exchanges if x.op == op and pred(x)]


def _expect(cls, fn):
    try:
        fn()
    except cls:
        return
    raise AssertionError(f"expected {cls.__name__}")


def run_scenario(endpoint: str) -> Recorder:
    """Every op a client uses, through the real client code, against a daemon serving checkpoints/tiny with
    auth_token=TOKEN and lease_timeout_s=LEASE_TIMEOUT_S."""
    from expertd.client import ExpertClient, push_all
    from expertd.client.push import _abort, _send_staged

    with Recorder() as rec:
        conn = Connection(endpoint, timeout=30, token=TOKEN)
        try:
            conn.request("hello", protocol=PROTOCOL_VERSION)
            client = ExpertClient(endpoint, token=TOKEN)  # lease (the handshake too)
            client.served_tensors()
            conn.request("variant", client=client.lease, tensors=[{"name": "model.norm.weight", "dtype": "torch.float32"}])
            conn.request("index", client=client.lease, segment=True)  # what a lease taken while loading asks
            conn.request("index")  # the index inline (tools, push_all)
            deadline = time.monotonic() + 5 * LEASE_TIMEOUT_S
            while not rec.where("heartbeat") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert rec.where("heartbeat"), "the client's heartbeat thread sent no heartbeat"
            client.status()
            extra = ExpertClient._lease_request(conn, generation=client.generation).client  # a resume
            conn.request("release", client=extra)
            client.update({PUSHED: torch.full((320,), 1.5, dtype=torch.bfloat16)})  # update, commit, job
            client.refresh()
            push_all([endpoint], {PUSHED: torch.full((320,), 2.5, dtype=torch.bfloat16)}, token=TOKEN)  # commit hold, publish
            tensors = {PUSHED: torch.full((320,), 3.5, dtype=torch.bfloat16)}
            spec = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in tensors.items()]
            staging = conn.request("update", client=client.lease, tensors=spec)
            _send_staged(conn, client.lease, staging, tensors)  # stage: the bytes as frames (tcp:// updaters)
            _abort(conn, client.lease, staging)
            job = conn.request("reload")
            while job["state"] in ("building", "built"):
                time.sleep(0.05)
                job = conn.request("job", job=job["job"])
            # refusals
            bad = Connection(endpoint, timeout=30, token=WRONG_TOKEN)
            _expect(AuthError, lambda: bad.request("status"))
            bad.close()
            _expect(LeaseExpired, lambda: conn.request("heartbeat", client="c999"))
            _expect(VersionMismatch, lambda: conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION - 1))
            _expect(GenerationGone, lambda: conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION,
                                                         generation=99))
            _expect(VariantRejected, lambda: conn.request("variant", client=client.lease,
                                                          tensors=[{"name": "model.nope.weight", "dtype": "torch.float32"}]))
            _expect(DaemonError, lambda: conn.request("frobnicate"))
            client.close()  # release
            conn.request("stop")
        finally:
            conn.close()
    return rec


def _error(kind):
    return lambda x: x.reply.get("error") == kind


# name -> (op, which exchange); the last match for "job" (a finished job) and "release" (the client's own, at
# close), else the first
SELECT = {
    "hello": ("hello", lambda x: x.ok),
    "lease": ("lease", lambda x: x.ok and "generation" not in x.request),
    "lease.generation": ("lease", lambda x: x.ok and "generation" in x.request),
    "index.segment": ("index", lambda x: x.ok and x.request.get("segment")),
    "index.inline": ("index", lambda x: x.ok and "segment" not in x.request),
    "heartbeat": ("heartbeat", lambda x: x.ok),
    "status": ("status", lambda x: x.ok),
    "refresh": ("refresh", lambda x: x.ok),
    "release": ("release", lambda x: x.ok),
    "update": ("update", lambda x: x.ok),
    "stage": ("stage", lambda x: x.ok),
    "commit": ("commit", lambda x: x.ok and not x.request.get("hold")),
    "commit.hold": ("commit", lambda x: x.ok and x.request.get("hold")),
    "job": ("job", lambda x: x.ok and x.reply.get("state") == "published"),
    "publish": ("publish", lambda x: x.ok),
    "abort": ("abort", lambda x: x.ok),
    "reload": ("reload", lambda x: x.ok),
    "stop": ("stop", lambda x: x.ok),
    "error.AuthError": ("status", _error("AuthError")),
    "error.LeaseExpired": ("heartbeat", _error("LeaseExpired")),
    "error.GenerationGone": ("lease", _error("GenerationGone")),
    "error.VersionMismatch": ("lease", _error("VersionMismatch")),
    "error.ProtocolError.unknown_op": ("frobnicate", _error("ProtocolError")),
    "variant": ("variant", lambda x: x.ok),
    "error.VariantRejected": ("variant", _error("VariantRejected")),
}
# what the daemon is sent again, as golden bytes, in this order (a fresh daemon grants lease c1 first)
REPLAY = ("hello", "lease", "variant", "error.VariantRejected", "index.segment", "index.inline", "heartbeat", "status",
          "refresh", "error.AuthError",
          "error.LeaseExpired", "error.GenerationGone", "error.VersionMismatch", "error.ProtocolError.unknown_op",
          "release")


def selected(rec: Recorder) -> dict[str, Exchange]:
    out = {}
    for name, (op, pred) in SELECT.items():
        found = rec.where(op, pred)
        assert found, f"the scenario produced no {name!r} exchange"
        out[name] = found[-1] if name in ("job", "release") else found[0]
    return out


# --- normalization -------------------------------------------------------------------------------------

class Normalizer:
    def __init__(self, namespace: str, daemon_pid: int, endpoint: str, indexes: dict[int, dict]):
        self.replace = [(f"{namespace}.{daemon_pid}.", f"{NORMAL_NAMESPACE}.{NORMAL_PID}."),
                        (namespace, NORMAL_NAMESPACE), (endpoint, NORMAL_ENDPOINT), (str(HERE.parent), NORMAL_REPO)]
        self.segments = {}  # generation -> (blob, descriptor) of its normalized index
        for generation, data in indexes.items():
            self.segments[generation] = index_segment.pack(TensorIndex.from_dict(self(data)))

    def __call__(self, value, key=None):
        if isinstance(value, dict):
            out = {k: self(v, k) for k, v in value.items()}
            if key == "index_segment" and isinstance(value, dict) and value.get("generation") in self.segments:
                _, desc = self.segments[value["generation"]]
                out["nbytes"], out["checksum"] = desc["nbytes"], desc["checksum"]
            return out
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, str):
            for a, b in self.replace:
                value = value.replace(a, b)
            return value
        if key == "pid" and isinstance(value, int) and not isinstance(value, bool):
            return NORMAL_PID
        if key == "pid_ns" and value is not None:
            return NORMAL_PID_NS
        if key == "start_time" and value is not None:
            return NORMAL_START_TIME
        if key in VOLATILE_FLOATS and isinstance(value, float):
            return 0.0
        return value


def vector(message: dict) -> dict:
    return {"hex": pack(message).hex(), "decoded": message}


def build_golden(rec: Recorder, namespace: str, daemon_pid: int, endpoint: str) -> tuple[dict, bytes]:
    norm = Normalizer(namespace, daemon_pid, endpoint, rec.indexes)
    messages = {}
    for name, x in selected(rec).items():
        entry = {"op": x.op, "request": vector(norm(x.request)), "reply": vector(norm(x.reply))}
        if not x.ok:
            entry["error"] = x.reply["error"]
        messages[name] = entry
    blob, desc = norm.segments[1]
    index = TensorIndex.from_dict(msgpack.unpackb(blob[index_segment.HEADER.size:], raw=False))
    entries = {name: [e.segment, e.offset, e.nbytes, list(e.shape), e.dtype, e.base]
               for name, e in sorted(index.checkpoint_entries().items())}
    golden = {
        "protocol": PROTOCOL_VERSION,
        "checksums": checksum_vectors(),
        "normalization": NORMALIZATION,
        "optional_keys": list(OPTIONAL_KEYS),
        "token": TOKEN,
        "messages": messages,
        "index_segment": {"file": INDEX_BIN.name, "descriptor": {"segment": f"/{NORMAL_NAMESPACE}.{NORMAL_PID}.i1.000", **desc},
                          "index": index.to_dict(), "checkpoint_entries": entries},
    }
    return golden, blob


def checksum_vectors() -> list[dict]:
    """tensor_checksum of bytes 0..255 repeated 4 times, whole and in parts (3 parts leave a remainder unhashed)."""
    from expertd.index import tensor_checksum

    data = torch.arange(256, dtype=torch.uint8).repeat(4)
    return [{"data": "bytes 0..255 x4", "parts": parts, "checksum": tensor_checksum(data, parts)} for parts in (1, 3, 4, 16)]


def regenerate() -> None:
    from helpers.daemon import DaemonProcess

    namespace = f"edtgold{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as folder:
        d = DaemonProcess.launch(folder, str(TINY), namespace, auth_token=TOKEN, lease_timeout_s=LEASE_TIMEOUT_S)
        try:
            pid = d.wait_serving()["pid"]
            rec = run_scenario(d.endpoint)
        finally:
            d.stop()
        golden, blob = build_golden(rec, namespace, pid, d.endpoint)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    MESSAGES.write_text(json.dumps(golden, indent=1) + "\n")
    INDEX_BIN.write_bytes(blob)
    print(f"wrote {MESSAGES} ({len(golden['messages'])} exchanges) and {INDEX_BIN} ({len(blob)} bytes)")


# --- shapes: field names and msgpack types -----------------------------------------------------------

def shape(value):
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        kinds = []
        for v in value:
            s = shape(v)
            if s not in kinds:
                kinds.append(s)
        return ["array", sorted(kinds, key=json.dumps)]
    if value is None:
        return "nil"
    return {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin"}[type(value)]


def shape_diff(got, want, path="") -> list[str]:
    """Where two shapes differ (keys in OPTIONAL_KEYS may be absent on either side)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            if k not in got or k not in want:
                if k not in OPTIONAL_KEYS:
                    out.append(f"{path}.{k}: {'missing' if k not in got else 'unexpected'}")
                continue
            out += shape_diff(got[k], want[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want[1]) == len(got[1]):
        return [d for g, w in zip(got[1], want[1]) for d in shape_diff(g, w, f"{path}[]")]
    return [] if got == want else [f"{path}: {json.dumps(got)[:200]} != {json.dumps(want)[:200]}"]


# --- tests -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden() -> dict:
    assert MESSAGES.exists(), f"{MESSAGES} is missing: python tests/test_protocol_golden.py --regenerate"
    return json.loads(MESSAGES.read_text())


def test_vectors_are_canonical_msgpack_of_their_decoded_maps(golden):
    assert golden["protocol"] == PROTOCOL_VERSION
    assert set(golden["messages"]) == set(SELECT)
    for name, entry in golden["messages"].items():
        for side in ("request", "reply"):
            data = bytes.fromhex(entry[side]["hex"])
            assert msgpack.unpackb(data, raw=False) == entry[side]["decoded"], (name, side)
            assert pack(entry[side]["decoded"]) == data, (name, side)
        assert entry["request"]["decoded"]["op"] == entry["op"]
        assert "latest" in entry["reply"]["decoded"], name  # every reply the loop sends names the latest generation
        assert entry["request"]["decoded"]["token"] == TOKEN or name == "error.AuthError"


def test_checksum_vectors(golden):
    assert golden["checksums"] == checksum_vectors()


def test_python_client_decodes_the_golden_replies(golden):
    for name, entry in golden["messages"].items():
        data = bytes.fromhex(entry["reply"]["hex"])
        if "error" in entry:
            with pytest.raises(DaemonError) as info:
                unpack_reply(data, repr(entry["op"]))
            assert info.value.kind == entry["error"], name
            assert type(info.value) is ERRORS.get(entry["error"], DaemonError), name  # typed by name, one table
        else:
            assert unpack_reply(data, repr(entry["op"])) == entry["reply"]["decoded"], name
    lease = golden["messages"]["lease"]["reply"]["decoded"]
    assert lease["index_segment"] == golden["index_segment"]["descriptor"]


def test_every_op_is_one_typed_message_and_the_golden_requests_parse_into_them(golden):
    assert set(messages.REQUESTS) == set(OPS)  # one class per op, in one module
    replies = {"hello": messages.HelloReply, "lease": messages.LeaseReply, "lease.generation": messages.LeaseReply,
               "heartbeat": messages.HeartbeatReply, "index.segment": messages.IndexSegmentReply,
               "refresh": messages.IndexSegmentReply, "release": messages.Done, "abort": messages.Done,
               "stop": messages.Done, "variant": messages.VariantReply}
    for name, entry in golden["messages"].items():
        sent = entry["request"]["decoded"]
        if name == "error.ProtocolError.unknown_op":
            assert sent["op"] not in messages.REQUESTS
            continue
        if name == "error.VersionMismatch":
            with pytest.raises(VersionMismatch, match="client speaks protocol 2, daemon speaks 3"):
                messages.parse_request(sent)
            continue
        request = messages.parse_request(sent)
        # every field the client sent is a field of the typed request, read back unchanged
        fields = {k: v for k, v in sent.items() if k not in ("op", "token")}
        assert {k: request.wire().get(k, "not a field") for k in fields} == fields, name
        if name in replies:
            reply = messages.read_reply(replies[name], entry["reply"]["decoded"], name)
            assert {**reply.wire(), "latest": reply.latest} == entry["reply"]["decoded"], name
    # a field of the wrong type, a missing one, one out of range: ProtocolError naming the op and the field
    for bad, words in (({"op": "heartbeat"}, "op 'heartbeat': 'client' is missing; it must be a string"),
                       ({"op": "lease", "pid": -1}, r"op 'lease': 'pid' must be a non-negative integer below 2\^31, got -1"),
                       ({"op": "commit", "client": "c1", "update": 1, "checksums": [7]},
                        r"op 'commit': 'checksums'\[0\] must be a string, got int"),
                       ({"op": "stage", "client": "c1", "update": "1", "tensor": 0},
                        "op 'stage': 'update' must be an integer, got '1'")):
        with pytest.raises(ProtocolError, match=words):
            messages.parse_request(bad)


def test_index_segment_vector_is_what_pack_writes_and_unpack_reads(golden):
    blob, desc = INDEX_BIN.read_bytes(), golden["index_segment"]["descriptor"]
    data = index_segment.unpack(blob, desc)
    assert data == golden["index_segment"]["index"]
    index = TensorIndex.from_dict(data)
    again, again_desc = index_segment.pack(index)
    assert again == blob and {**again_desc, "segment": desc["segment"]} == desc
    entries = {n: [e.segment, e.offset, e.nbytes, list(e.shape), e.dtype, e.base]
               for n, e in sorted(index.checkpoint_entries().items())}
    assert entries == golden["index_segment"]["checkpoint_entries"]
    # a segment file in an shm_dir, read the way a worker reads it
    with tempfile.TemporaryDirectory() as shm_dir:
        Path(shm_dir, desc["segment"].lstrip("/")).write_bytes(blob)
        assert index_segment.read({**desc, "shm_dir": shm_dir}).to_dict() == golden["index_segment"]["index"]


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
        for name in REPLAY:
            entry = golden["messages"][name]
            sock.send(bytes.fromhex(entry["request"]["hex"]))
            reply = msgpack.unpackb(sock.recv(), raw=False)
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


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_protocol_golden.py --regenerate")
    regenerate()
