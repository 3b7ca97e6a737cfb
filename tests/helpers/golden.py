"""The golden protocol vectors: capturing what the real code paths send and receive, normalizing, and shapes.

tests/test_protocol_golden.py checks the vectors (tests/golden/protocol) and writes them anew
(`python tests/test_protocol_golden.py --regenerate`); tests/test_protocol_live.py checks today's client and
daemon against them. `messages.json` holds, per op (and per error), one request and its reply as canonical
msgpack (hex) and decoded, captured from the real code paths — `ExpertClient`, `push_all`, `Connection` —
against a real daemon on checkpoints/tiny, then normalized (see `NORMALIZATION`). `index_segment.bin` is
generation 1's index segment as `expertd.index_segment.pack` writes it (from the normalized index).
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch

import expertd.connection as connection
from expertd import derived, index_segment, messages
from expertd.connection import Connection
from expertd.errors import AuthError, DaemonError, GenerationGone, LeaseExpired, DerivedRejected, VersionMismatch
from expertd.index import TensorIndex
from expertd.protocol import PROTOCOL_VERSION, pack

HERE = Path(__file__).resolve().parent.parent  # tests/

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
RANDOM_NAME = re.compile(r"(\.[uiv]?\d+\.\d{3})\.[0-9a-f]{16}\b")
NORMAL_PID = 4242  # every pid (the worker's in `lease`, the daemon's in `status` and in segment names)
NORMAL_PID_NS = 4026531836
NORMAL_START_TIME = 1000
NORMAL_ENDPOINT = "ipc:///tmp/expertd-golden/expertd.sock"
NORMAL_REPO = "/repo"
VOLATILE_FLOATS = ("uptime_s", "age_s", "idle_s", "seconds")
NORMALIZATION = (
    f"namespace -> {NORMAL_NAMESPACE!r}; every 'pid' field and the daemon pid in segment names -> {NORMAL_PID}; "
    f"'pid_ns' -> {NORMAL_PID_NS}; 'start_time' -> {NORMAL_START_TIME}; the lease ids granted -> c1, c2, ... in "
    f"order; the endpoint -> {NORMAL_ENDPOINT!r}; the "
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
    from expertd.leasing import lease_request

    with Recorder() as rec:
        conn = Connection(endpoint, timeout=30, token=TOKEN)
        try:
            conn.request("hello", protocol=PROTOCOL_VERSION)
            client = ExpertClient(endpoint, token=TOKEN)  # lease (the handshake too)
            client.served_tensors()
            conn.request("cast", client=client.lease, tensors=[{"name": "model.norm.weight", "dtype": "torch.float32"}])
            conn.request("index", client=client.lease, segment=True)  # what a lease taken while loading asks
            conn.request("index")  # the index inline (tools, push_all)
            deadline = time.monotonic() + 5 * LEASE_TIMEOUT_S
            while not rec.where("heartbeat") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert rec.where("heartbeat"), "the client's heartbeat thread sent no heartbeat"
            client.status()
            reverse = derived.request("model.norm.weight", derived.encode(torch.arange(319, -1, -1)), 320, (320,),
                                      whole=True)
            # after `status`: live only, its index is binary
            conn.send(messages.Gather(client=client.lease, tensors=[reverse]))
            extra = lease_request(conn, generation=client.generation).client  # a resume
            conn.request("release", client=extra)
            client.update({PUSHED: torch.full((320,), 1.5, dtype=torch.bfloat16)})  # update, commit, job
            client.refresh()
            # commit hold, publish
            push_all([endpoint], {PUSHED: torch.full((320,), 2.5, dtype=torch.bfloat16)}, token=TOKEN)
            tensors = {PUSHED: torch.full((320,), 3.5, dtype=torch.bfloat16)}
            spec = [messages.PushedTensor(name=n, shape=list(t.shape), dtype=str(t.dtype)) for n, t in tensors.items()]
            staging = conn.send(messages.Update(client=client.lease, tensors=spec), messages.UpdateReply)
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
            nope = [{"name": "model.nope.weight", "dtype": "torch.float32"}]
            _expect(DerivedRejected, lambda: conn.request("cast", client=client.lease, tensors=nope))
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
    "cast": ("cast", lambda x: x.ok),
    "error.DerivedRejected": ("cast", _error("DerivedRejected")),
}
# what the daemon is sent again, as golden bytes, in this order (a fresh daemon grants lease c1 first)
REPLAY = ("hello", "lease", "cast", "error.DerivedRejected", "index.segment", "index.inline", "heartbeat", "status",
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
    def __init__(self, namespace: str, daemon_pid: int, endpoint: str, indexes: dict[int, dict],
                 leases: list[str] = ()):
        self.replace = [(f"{namespace}.{daemon_pid}.", f"{NORMAL_NAMESPACE}.{NORMAL_PID}."),
                        (namespace, NORMAL_NAMESPACE), (endpoint, NORMAL_ENDPOINT), (str(HERE.parent), NORMAL_REPO)]
        self.replace += [(lease, f"c{i}") for i, lease in enumerate(leases, 1)]  # 128 random bits each
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
            return RANDOM_NAME.sub(r"\1", value)  # a segment name's random part (server/arena.segment_name)
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
    granted = [x.reply["client"] for x in rec.exchanges if x.op == "lease" and x.ok and "client" in x.reply]
    norm = Normalizer(namespace, daemon_pid, endpoint, rec.indexes, list(dict.fromkeys(granted)))
    vectors = {}
    for name, x in selected(rec).items():
        entry = {"op": x.op, "request": vector(norm(x.request)), "reply": vector(norm(x.reply))}
        if not x.ok:
            entry["error"] = x.reply["error"]
        vectors[name] = entry
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
        "messages": vectors,
        "index_segment": {"file": INDEX_BIN.name,
                          "descriptor": {"segment": f"/{NORMAL_NAMESPACE}.{NORMAL_PID}.i1.000", **desc},
                          "index": index.to_dict(), "checkpoint_entries": entries},
    }
    return golden, blob


def load() -> dict:
    """The golden vectors as the tests read them."""
    assert MESSAGES.exists(), f"{MESSAGES} is missing: python tests/test_protocol_golden.py --regenerate"
    return json.loads(MESSAGES.read_text())


def checksum_vectors() -> list[dict]:
    """tensor_checksum of bytes 0..255 repeated 4 times, whole and in parts (3 parts leave a remainder unhashed)."""
    from expertd.index import tensor_checksum

    data = torch.arange(256, dtype=torch.uint8).repeat(4)
    return [{"data": "bytes 0..255 x4", "parts": parts, "checksum": tensor_checksum(data, parts)}
            for parts in (1, 3, 4, 16)]


def regenerate() -> None:
    from .daemon import DaemonProcess

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
