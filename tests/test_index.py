"""The tensor-index format, pinned by a golden file (as safetensors pins its header bytes)."""

import json
import os

import pytest

from expertd.errors import ProtocolError
from expertd.index import SegmentEntry, TensorEntry, TensorIndex, write_json_atomic

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "index_v1.json")


def sample() -> TensorIndex:
    return TensorIndex(
        generation=3,
        namespace="ns",
        model_type="deepseek_v3",
        layout="transformers-fused",
        config={"model_type": "deepseek_v3", "hidden_size": 320},
        segments=[SegmentEntry("/ns.100.3.000", 1 << 20)],
        tensors=[
            TensorEntry("model.layers.1.mlp.experts.down_proj", "/ns.100.3.000", 0, 2 * 320 * 200 * 2, [2, 320, 200],
                        "torch.bfloat16", ["model.layers.1.mlp.experts.0.down_proj.weight",
                                           "model.layers.1.mlp.experts.1.down_proj.weight"]),
            TensorEntry("model.layers.1.mlp.gate.e_score_correction_bias", "/ns.100.3.000", 258048, 8, [2],
                        "torch.float32", ["model.layers.1.mlp.gate.e_score_correction_bias"]),
        ],
        views=[
            TensorEntry("model.layers.1.mlp.experts.0.down_proj.weight", "/ns.100.3.000", 0, 128000, [320, 200],
                        "torch.bfloat16", ["model.layers.1.mlp.experts.0.down_proj.weight"],
                        "model.layers.1.mlp.experts.down_proj"),
            TensorEntry("model.layers.1.mlp.experts.1.down_proj.weight", "/ns.100.3.000", 128000, 128000, [320, 200],
                        "torch.bfloat16", ["model.layers.1.mlp.experts.1.down_proj.weight"],
                        "model.layers.1.mlp.experts.down_proj"),
        ],
    )


def test_json_matches_golden_file(tmp_path):
    path = str(tmp_path / "index.json")
    write_json_atomic(path, sample().to_dict())
    with open(path) as f, open(GOLDEN) as g:
        assert json.load(f) == json.load(g)
    assert os.listdir(tmp_path) == ["index.json"]  # no temp file left


def test_round_trip_and_checkpoint_names():
    index = TensorIndex.from_dict(json.loads(json.dumps(sample().to_dict())))
    assert index == sample()
    names = index.checkpoint_entries()
    assert sorted(names) == [
        "model.layers.1.mlp.experts.0.down_proj.weight",
        "model.layers.1.mlp.experts.1.down_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ]
    assert index.total_bytes_by_dtype() == {"torch.bfloat16": 256000, "torch.float32": 8}


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(schema=99),
    lambda d: d.pop("tensors"),
    lambda d: d["tensors"][0].pop("offset"),
    lambda d: d["segments"].append({"bogus": 1}),
])
def test_malformed_index_is_a_protocol_error(mutate):
    data = sample().to_dict()
    mutate(data)
    with pytest.raises(ProtocolError):
        TensorIndex.from_dict(data)


def test_wire_form_leaves_views_out_and_they_are_derived_back():
    wire = sample().to_wire()
    assert "views" not in wire
    index = TensorIndex.from_dict(json.loads(json.dumps(wire)))
    assert index.views is None  # attach never pays for views it does not use
    assert index.checkpoint_entries() == sample().checkpoint_entries()
    assert index.to_dict() == sample().to_dict()


def test_views_of_a_fused_tensor_that_cannot_split_are_refused():
    data = sample().to_wire()
    data["tensors"][0]["sources"].append("one.too.many")
    with pytest.raises(ProtocolError, match="cannot hold 3 equal sources"):
        TensorIndex.from_dict(data).checkpoint_entries()
