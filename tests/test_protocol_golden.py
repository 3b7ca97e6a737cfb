"""The wire contract, pinned: golden message vectors (tests/golden/protocol) that both clients test.

Here, without a daemon: the vectors are self-consistent; the Python side decodes the golden replies and index
segment; every op is one typed message (with the permission it needs) and every golden request and reply reads
through its class. tests/test_protocol_live.py checks today's client and daemon against the same vectors; the C++
client's ctest (client/cpp/tests/golden_test.cpp) decodes and re-encodes them. When the protocol changes on
purpose, regenerate with `python tests/test_protocol_golden.py --regenerate` (and update PROTOCOL.md); how the
vectors are captured and normalized is in tests/helpers/golden.py.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers/, also when run as a script

from expertd import derived, index_segment, messages, replies  # noqa: E402
from expertd.errors import DaemonError, ProtocolError, DerivedRejected, VersionMismatch  # noqa: E402
from expertd.index import TensorIndex  # noqa: E402
from expertd.messages import OPS  # noqa: E402
from expertd.protocol import ERRORS, PROTOCOL_VERSION, pack, unpack_reply  # noqa: E402
from expertd.security import Credentials  # noqa: E402
from expertd.server.daemon.config import config_from_dict  # noqa: E402
from expertd.server.daemon.loop import Daemon  # noqa: E402
from helpers.golden import INDEX_BIN, SELECT, TOKEN, checksum_vectors, load, regenerate  # noqa: E402

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)


@pytest.fixture(scope="module")
def golden() -> dict:
    return load()


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
    # every reply reads as the class its op declares
    replied = {name for name in golden["messages"] if not name.startswith("error.")} - {"index.inline"}
    assert {golden["messages"][name]["op"] for name in replied} == set(OPS) - {"gather"}  # gather: live only (binary)
    for name, entry in golden["messages"].items():
        sent = entry["request"]["decoded"]
        if name == "error.ProtocolError.unknown_op":
            assert sent["op"] not in messages.REQUESTS
            continue
        if name == "error.VersionMismatch":
            with pytest.raises(VersionMismatch, match=f"client speaks protocol {PROTOCOL_VERSION - 1}, daemon speaks "
                                                      f"{PROTOCOL_VERSION}"):
                messages.parse_request(sent)
            continue
        request = messages.parse_request(sent)
        # every field the client sent is a field of the typed request, read back unchanged
        fields = {k: v for k, v in sent.items() if k not in ("op", "token")}
        assert {k: request.wire().get(k, "not a field") for k in fields} == fields, name
        if name in replied:
            reply = replies.read_reply(type(request).reply, entry["reply"]["decoded"], name)
            assert {**reply.wire(), "latest": reply.latest} == entry["reply"]["decoded"], name
    # a field of the wrong type, a missing one, one out of range: ProtocolError naming the op and the field
    for bad, words in (({"op": "heartbeat"}, "op 'heartbeat': 'client' is missing; it must be a string"),
                       ({"op": "lease", "pid": -1},
                       r"op 'lease': 'pid' must be a non-negative integer below 2\^31, got -1"),
                       ({"op": "commit", "client": "c1", "update": 1, "checksums": [7]},
                        r"op 'commit': 'checksums'\[0\] must be a string, got int"),
                       ({"op": "stage", "client": "c1", "update": "1", "tensor": 0},
                        r"op 'stage': 'update' must be a non-negative integer below 2\^64, got '1'")):
        with pytest.raises(ProtocolError, match=words):
            messages.parse_request(bad)


def test_derived_requests_are_typed_and_bounded_before_any_work():
    """A cast's and a gather's every field is checked by the parser: the daemon never sees an untyped item."""
    import torch

    item = derived.request("w", derived.encode(torch.arange(7, -1, -1)), 8, (2, 8), also=["v"])
    sent = {"op": "gather", "client": "c1", "tensors": [item.wire()]}
    assert messages.parse_request(pack_round(sent)).tensors == [item]
    lease = {"op": "gather", "client": "c1"}
    for bad, words in (
            ({**lease, "tensors": [{"name": "w", "index": "0,1", "length": 2, "shape": [2]}]},
             r"'index' must be binary data, got '0,1'"),
            ({**lease, "tensors": [{"name": "w", "index": b"x", "length": 0, "shape": [2]}]},
             r"'length' must be a positive integer"),
            ({**lease, "tensors": [{"name": "w", "index": b"x", "length": 2, "shape": []}]},
             r"'shape' must name at least one dimension"),
            ({**lease, "tensors": [{"name": "w", "index": b"x", "length": 2, "shape": [2], "blocks": 2}]},
             r"'blocks' must be a positive integer below 2"),
            ({**lease, "tensors": [{"name": "w", "index": b"x", "length": 2, "shape": [2], "also": ["v"] * 65}]},
             r"'also' holds 65 items; at most 64"),
            ({**lease, "tensors": [{"name": "w", "index": bytes(messages.MAX_INDEX_BYTES + 1), "length": 2,
                                    "shape": [2]}]}, rf"'index' holds {messages.MAX_INDEX_BYTES + 1} bytes"),
            ({"op": "cast", "client": "c1", "tensors": [{"name": "w", "dtype": "torch.float32"}] * 4097},
             r"'tensors' holds 4097 items; at most 4096"),
            ({"op": "cast", "client": "c1", "tensors": [{"name": "w", "gather": {}}]},
             r"'dtype' is missing"),
            ({"op": "variant", "client": "c1", "tensors": []}, r"unknown op 'variant'")):
        with pytest.raises(ProtocolError, match=words):
            messages.parse_request(bad)
    with pytest.raises(DerivedRejected, match=r"op 'cast': tensors\[0\]: dtype 'torch.int8' .* is not a float type"):
        messages.parse_request({"op": "cast", "client": "c1", "tensors": [{"name": "w", "dtype": "torch.int8"}]})


def pack_round(message: dict) -> dict:
    return msgpack.unpackb(pack(message), raw=False)


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


def test_one_table_names_the_permission_of_every_op():
    """The ops that change what is served need "push", reload and stop "admin", the others "read"; the client sends
    its push_token with the push ops and its admin_token with the admin ops, and nothing else with any op."""
    assert set(messages.PERMISSIONS) == set(OPS) == set(messages.REQUESTS)
    daemon = Daemon(config_from_dict({"checkpoint": "/nonexistent", "namespace": "registry"}))  # nothing started
    assert set(daemon.dispatch.handlers) == set(messages.REQUESTS.values())  # one handler each (Dispatch checks)
    by_permission = {p: {op for op, needs in messages.PERMISSIONS.items() if needs == p} for p in messages.RANKS}
    assert by_permission[messages.PUSH] == {"update", "stage", "commit", "publish", "abort"}
    assert by_permission[messages.ADMIN] == {"reload", "stop"}
    for op, cls in messages.REQUESTS.items():
        assert cls.permission == messages.PERMISSIONS[op] and cls.op == op and cls.words
    assert messages.grants(messages.ADMIN, messages.PUSH) and messages.grants(messages.PUSH, messages.READ)
    assert not messages.grants(messages.PUSH, messages.ADMIN) and not messages.grants(messages.READ, messages.PUSH)
    both = Credentials(push_token="p" * 16, admin_token="a" * 16)
    sent = {op: both.for_op(op) for op in OPS}
    assert {op for op, extra in sent.items() if extra == {"push_token": "p" * 16}} == by_permission[messages.PUSH]
    assert {op for op, extra in sent.items() if extra == {"admin_token": "a" * 16}} == by_permission[messages.ADMIN]
    assert Credentials(admin_token="a" * 16).for_op("update") == {"admin_token": "a" * 16}  # admin implies push
    assert all(not extra for op, extra in sent.items() if messages.PERMISSIONS[op] == messages.READ)


def test_protocol_md_and_the_cpp_client_state_the_same_permission_table():
    root = Path(__file__).resolve().parent.parent
    documented = {}
    for permission, ops in re.findall(r"^ *\| `(\w+)` \| ((?:`\w+` ?)+) \|$", (root / "PROTOCOL.md").read_text(), re.M):
        documented.update({op: permission for op in re.findall(r"`(\w+)`", ops)})
    assert documented == messages.PERMISSIONS
    wire_h = (root / "client/cpp/include/expertd/wire.h").read_text()
    table = wire_h[wire_h.index("PERMISSIONS[] = {"):wire_h.index("};", wire_h.index("PERMISSIONS[] = {"))]
    assert dict(re.findall(r'\{"(\w+)", "(\w+)"\}', table)) == messages.PERMISSIONS


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_protocol_golden.py --regenerate")
    regenerate()
