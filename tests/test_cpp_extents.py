"""The C++ client maps a stack of several generations' ranges (index schema 3, issue 39) as the Python client does:
one contiguous read-only view, the same bytes, its checksum and its per-expert views. Real daemon, the built tool."""

from __future__ import annotations

import pytest

from expertd.client import ExpertClient
from expertd.index import checksum, tensor_bytes
from expertd.tools.generate import generate_model_type
from test_cpp_client import cpp_build, dump_json  # noqa: F401  (the session's build of client/cpp)

STACK = "model.layers.1.mlp.experts.gate_up_proj"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("paged") / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False, hidden_size=256, moe_intermediate_size=128)
    return folder


def test_the_cpp_client_maps_a_stack_of_several_segments_as_python_does(cpp_build, start_daemon, paged):  # noqa: F811
    d = start_daemon(paged, expert_ranges=True)
    with ExpertClient(d.endpoint, heartbeat=False) as client:
        part = client.tensors()[EXPERT].clone()
        client.update({EXPERT: -part})
        client.refresh()
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
