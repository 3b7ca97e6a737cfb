"""The C++ client maps a stack of several generations' ranges (index schema 3, issue 39) as the Python client does:
one contiguous read-only view, the same bytes, its checksum and its per-expert views. Real daemon, the built tool."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from expertd.client import ExpertClient
from expertd.index import checksum, tensor_bytes
from expertd.tools.generate import generate_model_type
from helpers.polling import wait_until
from test_cpp_client import cpp_build, dump_json  # noqa: F401  (the session's build of client/cpp)

STACK = "model.layers.1.mlp.experts.gate_up_proj"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("paged") / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False, hidden_size=256, moe_intermediate_size=128)
    return folder


def push_negated(client: ExpertClient):
    """Push EXPERT's part negated and refresh onto it (the stack then three ranges): the part as it was."""
    part = client.tensors()[EXPERT].clone()
    client.update({EXPERT: -part})
    client.refresh()
    return part


def test_the_cpp_client_maps_a_stack_of_several_segments_as_python_does(cpp_build, start_daemon, paged):  # noqa: F811
    d = start_daemon(paged, expert_ranges=True)
    with ExpertClient(d.endpoint, heartbeat=False) as client:
        part = push_negated(client)
        (entry,) = [t for t in client.index().tensors if t.name == STACK]
        assert entry.extents and len(entry.extents) == 3
        got = dump_json(cpp_build, d.endpoint)
        views = dump_json(cpp_build, d.endpoint, "--views")
        assert got["generation"] == 2 and got["bad"] == 0
        served, mine = client.served_tensors(), client.tensors()
        for row in got["tensors"]:
            assert row["checksum"] == row["recorded"], row["name"]
            assert row["xxh3_64"] == checksum(tensor_bytes(served[row["name"]])), row["name"]
        for row in views["tensors"]:
            assert row["xxh3_64"] == checksum(tensor_bytes(mine[row["name"]])), row["name"]
        assert checksum(tensor_bytes(mine[EXPERT])) == checksum(tensor_bytes(-part))


def test_the_cpp_client_refreshes_onto_more_ranges_and_its_old_views_stay(cpp_build, start_daemon, paged):  # noqa: F811
    """The C++ client holds generation 2's views (the stack of three ranges) while a push of another expert makes
    generation 3 (five ranges); its refresh composes the new stack from the old view's unchanged ranges and the
    segments: the new bytes are the daemon's, every view taken before reads what it read."""
    d = start_daemon(paged, expert_ranges=True, max_generations=4)
    with ExpertClient(d.endpoint, heartbeat=False) as client:
        push_negated(client)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
        proc = subprocess.Popen([str(cpp_build / "expertd-cpp-dump"), d.endpoint, "--json", "--hold-s", "3",
                                 "--refresh"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            wait_until(lambda: any(x["pid"] == proc.pid for x in d.status()["leases"]), "the C++ lease shows")
            other = "model.layers.1.mlp.experts.6.gate_proj.weight"
            client.update({other: client.tensors()[other] * 2})
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        got = json.loads(out)
        client.refresh()
        (entry,) = [t for t in client.index().tensors if t.name == STACK]
        assert got["generation"] == 3 and len(entry.extents) == 5, (got["generation"], entry.extents)
        assert STACK in got["refresh"]["changed"] and got["refresh"]["old_views_unchanged"] is True
        served = client.served_tensors()
        for row in got["tensors"]:
            assert row["checksum"] == row["recorded"], row["name"]
            assert row["xxh3_64"] == checksum(tensor_bytes(served[row["name"]])), row["name"]


def test_the_cpp_client_maps_ranges_of_whole_2mib_pages_into_a_2mib_aligned_view(cpp_build, start_daemon,  # noqa: F811
                                                                                  tmp_path):
    """Parts of 2 MiB (a huge-page tmpfs's unit): the C++ view of the stack starts on a 2 MiB boundary (the range
    reserved larger, its ends given back) and reads the daemon's bytes."""
    folder = str(tmp_path / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False, hidden_size=1024, moe_intermediate_size=1024)
    d = start_daemon(folder, expert_ranges=True)
    with ExpertClient(d.endpoint, heartbeat=False) as client:
        push_negated(client)
        (entry,) = [t for t in client.index().tensors if t.name == STACK]
        assert len(entry.extents) == 3 and all(x.offset % (2 << 20) == 0 for x in entry.extents)
        got = dump_json(cpp_build, d.endpoint)
        served = client.served_tensors()
        (row,) = [r for r in got["tensors"] if r["name"] == STACK]
        assert row["checksum"] == row["recorded"] and row["xxh3_64"] == checksum(tensor_bytes(served[STACK]))
