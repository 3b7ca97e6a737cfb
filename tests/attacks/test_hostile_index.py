"""Clients distrust the daemon's index as much as the daemon distrusts readers: each test performs one attack the red
team found (issue 49 item 6), run as they ran it.

A hostile daemon listed 65,000 extents alternating over two one-page segments: the Python client composed a 253 MiB
view over 8 KiB and went from 352 to 65,352 mappings (`vm.max_map_count` 65,530). Here the daemon is a raw ZeroMQ
ROUTER speaking the real wire (the replies `expertd.replies` defines, a real index segment) over two segment files in
a folder of the test's own (its `shm_dir`). Its index gives one tensor more extents than a daemon ever serves one in
(MAX_EXTENTS), the index more than a reader maps for one (MAX_INDEX_EXTENTS), or a tensor two extents that hold the
same bytes of a segment. The Python client raises ProtocolError naming the tensor, what it found and the limit, and
maps nothing (no mapping of the folder's files, its mapping count as it was); the C++ client refuses with the same
words (exit 7). The control: the same daemon at the limit is mapped by both, so the refusals are the checks'.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash
import zmq

from expertd import replies
from expertd.client import ExpertClient
from expertd.errors import ProtocolError
from expertd.extents import MAX_EXTENTS, MAX_INDEX_EXTENTS
from expertd.index import checksum_text
from expertd.index_segment import HEADER, MAGIC
from expertd.protocol import PROTOCOL_VERSION, pack, unpack
from test_cpp_client import CPP, cpp_build, dump  # noqa: F401  (the session's C++ build)

pytestmark = pytest.mark.timeout(600)

PAGE = 4096
SEGMENTS = ("/hostile.1.1.000", "/hostile.1.1.001")
INDEX_SEGMENT = "/hostile.1.i1.000"
PROTOCOL_ERROR = 7  # expertd-cpp-dump's exit status for a ProtocolError


class HostileDaemon:
    """Generation 1 of a daemon that lies in its index: a ROUTER on a thread answering lease, index, heartbeat, hello
    and release as a daemon does, and the segment files its index names in `shm` (page k of a segment: byte k+1)."""

    def __init__(self, folder: Path):
        self.shm = folder / "shm"
        self.shm.mkdir(mode=0o700)
        self.endpoint = f"ipc://{folder}/expertd.sock"
        self.descriptor: dict = {}
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._answer, daemon=True)

    def serve(self, tensors: list[dict], pages: int) -> str:
        """Publish an index of `tensors` over SEGMENTS of `pages` pages each; the endpoint."""
        for name in SEGMENTS:
            (self.shm / name[1:]).write_bytes(b"".join(bytes([k + 1]) * PAGE for k in range(pages)))
        index = {"schema": 3, "generation": 1, "namespace": "hostile", "model_type": "qwen3_moe",
                 "layout": "transformers-fused", "config": {"model_type": "qwen3_moe"},
                 "segments": [{"name": name, "nbytes": pages * PAGE} for name in SEGMENTS], "tensors": tensors,
                 "shm_dir": str(self.shm)}
        payload = msgpack.packb(index, use_bin_type=True)
        digest = xxhash.xxh3_64_intdigest(payload)
        blob = HEADER.pack(MAGIC, 1, len(payload), digest) + payload
        (self.shm / INDEX_SEGMENT[1:]).write_bytes(blob)
        self.descriptor = {"segment": INDEX_SEGMENT, "nbytes": len(blob), "checksum": checksum_text(digest),
                           "generation": 1, "shm_dir": str(self.shm)}
        self.thread.start()
        return self.endpoint

    def _reply(self, msg: dict):
        op, latest = msg.get("op"), 1
        if op == "hello":
            return replies.HelloReply(protocol=PROTOCOL_VERSION, ready=True, generation=1, lease_timeout_s=30.0,
                                      latest=latest)
        if op == "lease":
            return replies.LeaseReply(client=os.urandom(16).hex(), lease_timeout_s=30.0, generation=1,
                                      index_segment=self.descriptor, latest=latest)
        if op in ("index", "refresh"):
            return replies.IndexSegmentReply(generation=1, index_segment=self.descriptor, latest=latest)
        if op == "heartbeat":
            return replies.HeartbeatReply(generation=1, latest=latest)
        return replies.Done(latest=latest)  # release

    def _answer(self) -> None:
        while not self.done.is_set():
            if self.sock.poll(50):
                identity, empty, frame = self.sock.recv_multipart()
                self.sock.send_multipart([identity, empty, pack(self._reply(unpack(frame)).wire())])

    def close(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.shm)


@pytest.fixture
def hostile(tmp_path):
    daemon = HostileDaemon(tmp_path)
    try:
        yield daemon
    finally:
        daemon.close()


def stack(layer: int, extents: list[list]) -> dict:
    """A served expert stack whose bytes are `extents` (bf16, no sources: no per-expert views)."""
    nbytes = sum(e[2] for e in extents)
    return {"name": f"model.layers.{layer}.mlp.experts.gate_up_proj", "segment": extents[0][0],
            "offset": extents[0][1], "nbytes": nbytes, "shape": [nbytes // 2], "dtype": "torch.bfloat16",
            "sources": [], "base": None, "checksum": None, "extents": extents}


def alternating(count: int, overlapping: bool = False) -> list[list]:
    """`count` one-page extents alternating between the two segments (none merges with the next): page k // 2 of
    each, or page 0 every time (`overlapping`: the red team's, the same two pages again and again)."""
    return [[SEGMENTS[k % 2], 0 if overlapping else k // 2 * PAGE, PAGE] for k in range(count)]


def mappings(folder: Path) -> tuple[int, int]:
    """This process's mappings: how many in all, and how many of files in `folder`."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return len(lines), sum(str(folder) in line for line in lines)


def refused_by_both(daemon: HostileDaemon, build: Path, words: str, extents: int) -> None:
    """The Python client refuses the index with `words` (a regex) and maps nothing of it (an index of `extents`
    extents would have added that many mappings), and the C++ client refuses it in the same words."""
    before, _ = mappings(daemon.shm)
    with ExpertClient(daemon.endpoint, heartbeat=False, timeout=10) as client:
        with pytest.raises(ProtocolError, match=words) as refused:
            client.served_tensors()
        after, ours = mappings(daemon.shm)
    assert ours == 0 and after - before < extents, (before, after, ours)
    run = dump(build, daemon.endpoint, "--timeout-ms", "10000")
    assert run.returncode == PROTOCOL_ERROR, run.stderr
    assert run.stderr.strip() == f"expertd-cpp-dump: ProtocolError: {refused.value}", run.stderr


def test_a_tensor_of_more_extents_than_a_daemon_serves_one_in_is_refused(hostile, cpp_build):  # noqa: F811
    hostile.serve([stack(0, alternating(MAX_EXTENTS + 1))], pages=(MAX_EXTENTS + 2) // 2)
    refused_by_both(hostile, cpp_build, rf"model\.layers\.0\.mlp\.experts\.gate_up_proj has {MAX_EXTENTS + 1} "
                                        rf"extents, more than the {MAX_EXTENTS} a daemon serves a tensor in",
                    MAX_EXTENTS + 1)


def test_an_index_of_more_extents_than_a_reader_maps_is_refused(hostile, cpp_build):  # noqa: F811
    """Every tensor within MAX_EXTENTS (the same disjoint pages each), one tensor more than MAX_INDEX_EXTENTS allows."""
    layers = MAX_INDEX_EXTENTS // MAX_EXTENTS + 1
    hostile.serve([stack(k, alternating(MAX_EXTENTS)) for k in range(layers)], pages=MAX_EXTENTS // 2)
    refused_by_both(hostile, cpp_build, rf"model\.layers\.{layers - 1}\.mlp\.experts\.gate_up_proj's {MAX_EXTENTS} "
                                        rf"extents make the index's {layers * MAX_EXTENTS}, more than the "
                                        rf"{MAX_INDEX_EXTENTS} a reader maps for one index", layers * MAX_EXTENTS)


def test_extents_of_a_tensor_that_hold_the_same_bytes_are_refused(hostile, cpp_build):  # noqa: F811
    """The red team's shape within the count: 64 extents alternating over two one-page segments (a 256 KiB view over
    8 KiB had it been mapped)."""
    hostile.serve([stack(0, alternating(MAX_EXTENTS, overlapping=True))], pages=1)
    a = re.escape(f"({SEGMENTS[0]}, 0, {PAGE})")
    refused_by_both(hostile, cpp_build, rf"gate_up_proj's extents {a} and {a} overlap: both hold bytes \[0, {PAGE}\) "
                                        rf"of segment {SEGMENTS[0]}; no byte may lie in two extents of a tensor",
                    MAX_EXTENTS)


def test_the_control_an_index_at_the_limits_is_mapped_by_both(hostile, cpp_build):  # noqa: F811
    """The same daemon with MAX_EXTENTS disjoint extents: both clients map it, each page where it belongs, so the
    refusals above are the checks' (and the limit itself is a daemon's to use)."""
    hostile.serve([stack(0, alternating(MAX_EXTENTS))], pages=MAX_EXTENTS // 2)
    with ExpertClient(hostile.endpoint, heartbeat=False, timeout=10) as client:
        pages = client.served_tensors()["model.layers.0.mlp.experts.gate_up_proj"].view(torch.uint8).view(-1, PAGE)
        assert pages[:, 0].tolist() == [k // 2 + 1 for k in range(MAX_EXTENTS)]  # extent k: page k // 2 of a segment
        assert mappings(hostile.shm)[1] >= MAX_EXTENTS
    run = dump(cpp_build, hostile.endpoint, "--timeout-ms", "10000")
    assert run.returncode == 0 and "gate_up_proj" in run.stdout, run.stderr


def test_the_cpp_client_has_the_python_clients_limits():
    header = (CPP / "include" / "expertd" / "tensor_index.h").read_text()
    found = dict(re.findall(r"inline constexpr std::size_t (MAX_\w+) = (\d+);", header))
    assert found == {"MAX_EXTENTS": str(MAX_EXTENTS), "MAX_INDEX_EXTENTS": str(MAX_INDEX_EXTENTS)}
