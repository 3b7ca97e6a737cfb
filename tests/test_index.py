"""The tensor-index format, pinned by golden files (as safetensors pins its header bytes), and the
source-pattern encoding that keeps it small at DeepSeek-V3's counts."""

import json
import os
import random

import msgpack
import pytest

from expertd.errors import ProtocolError
from expertd.extents import Extent
from expertd.index import (
    EXTENTS_SCHEMA, SCHEMA_VERSION, SegmentEntry, TensorEntry, TensorIndex, decode_sources, derive_views,
    encode_sources, write_json_atomic,
)

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
SEG = "/ns.100.3.000"
DOWN = [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(2)]
GATE_UP = [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up")]
KV = ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"]  # no expert range: a list


def sample() -> TensorIndex:
    """A fused down_proj (one part per expert), a fused gate_up_proj (two), an irregular fused tensor and a plain
    one."""
    return TensorIndex(
        generation=3,
        namespace="ns",
        model_type="deepseek_v3",
        layout="transformers-fused",
        config={"model_type": "deepseek_v3", "hidden_size": 320},
        segments=[SegmentEntry(SEG, 1 << 20)],
        tensors=[
            TensorEntry("model.layers.1.mlp.experts.down_proj", SEG, 0, 2 * 320 * 200 * 2, [2, 320, 200],
                        "torch.bfloat16", list(DOWN)),
            TensorEntry("model.layers.1.mlp.gate.e_score_correction_bias", SEG, 258048, 8, [2],
                        "torch.float32", ["model.layers.1.mlp.gate.e_score_correction_bias"]),
            TensorEntry("model.layers.1.mlp.experts.gate_up_proj", SEG, 262144, 2 * 8 * 4 * 2, [2, 8, 4],
                        "torch.bfloat16", list(GATE_UP), checksum="xxh3_64:0123456789abcdef"),
            TensorEntry("model.layers.1.self_attn.kv_proj", SEG, 266240, 1 * 4 * 4 * 2, [1, 4, 4],
                        "torch.bfloat16", list(KV)),
        ],
        views=None,
    )


def test_json_matches_golden_file(tmp_path):
    """The published JSON, byte for byte: schema 2, compact, views left out, expert sources as patterns."""
    path = str(tmp_path / "index.json")
    write_json_atomic(path, sample().to_dict(), indent=None)
    with open(path) as f, open(os.path.join(GOLDEN, "index_v2.json")) as g:
        assert f.read() == g.read()
    assert os.listdir(tmp_path) == ["index.json"]  # no temp file left
    data = json.load(open(path))
    assert data["schema"] == SCHEMA_VERSION == 2 and "views" not in data
    assert data["tensors"][0]["sources"] == {"prefix": "model.layers.1.mlp.experts.", "experts": [0, 2],
                                             "parts": [".down_proj.weight"]}
    assert data["tensors"][2]["sources"] == {"prefix": "model.layers.1.mlp.experts.", "experts": [0, 2],
                                             "parts": [".gate_proj.weight", ".up_proj.weight"]}
    assert data["tensors"][3]["sources"] == KV


SEG2 = "/ns.100.4.000"


def ranged() -> TensorIndex:
    """`sample()` at generation 4 after a push of expert 1's gate: the gate/up stack is three ranges, the middle one
    in generation 4's segment (schema 3)."""
    index = sample()
    stack = index.tensors[2]
    part = stack.nbytes // 4
    stack.extents = [Extent(SEG, 262144, 2 * part), Extent(SEG2, 0, part), Extent(SEG, 262144 + 3 * part, part)]
    index.generation, index.segments = 4, [SegmentEntry(SEG, 1 << 20), SegmentEntry(SEG2, 4096)]
    return index


def test_an_index_with_extents_matches_its_golden_file(tmp_path):
    """Schema 3, byte for byte (tests/golden/index_v3.json: `ranged().to_dict()` written compact, on purpose, when
    extents came in): only an entry with extents carries them; its checkpoint views are cut from them."""
    path = str(tmp_path / "index.json")
    write_json_atomic(path, ranged().to_dict(), indent=None)
    with open(path) as f, open(os.path.join(GOLDEN, "index_v3.json")) as g:
        assert f.read() == g.read()
    data = json.load(open(path))
    assert data["schema"] == EXTENTS_SCHEMA == 3 and [("extents" in t) for t in data["tensors"]] == [
        False, False, True, False]
    back = TensorIndex.from_dict(data)
    assert back == ranged()
    views = {v.name: v for v in back.all_views() if v.base == "model.layers.1.mlp.experts.gate_up_proj"}
    assert [(views[n].segment, views[n].offset) for n in GATE_UP] == [
        (SEG, 262144), (SEG, 262144 + 32), (SEG2, 0), (SEG, 262144 + 96)]


def test_round_trip_and_checkpoint_names():
    for form in (lambda d: json.loads(json.dumps(d)), lambda d: msgpack.unpackb(msgpack.packb(d))):
        index = TensorIndex.from_dict(form(sample().to_dict()))
        assert index.tensors[0].sources._names is None  # attach never pays for names it does not read ...
        assert index == sample()
        assert index.views is None  # ... nor for views it does not use
    names = index.checkpoint_entries()
    assert sorted(names) == sorted([*DOWN, *GATE_UP, *KV, "model.layers.1.mlp.gate.e_score_correction_bias"])
    assert [(v.name, v.offset, v.shape, v.base) for v in index.all_views() if "gate_up" in (v.base or "")] == [
        (n, 262144 + k * 32, [4, 4], "model.layers.1.mlp.experts.gate_up_proj") for k, n in enumerate(GATE_UP)]
    assert index.total_bytes_by_dtype() == {"torch.bfloat16": 256000 + 128 + 32, "torch.float32": 8}


def test_schema_1_files_are_still_read():
    """A schema 1 index (explicit lists, views written out, indent=1) reads into the same index."""
    with open(os.path.join(GOLDEN, "index_v1.json")) as f:
        old = TensorIndex.from_dict(json.load(f))
    assert old.tensors == sample().tensors[:2]
    assert old.views == derive_views(old.tensors)
    assert TensorIndex.from_dict(old.to_dict()).tensors == old.tensors


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(schema=99),
    lambda d: d.pop("tensors"),
    lambda d: d["tensors"][0].pop("offset"),
    lambda d: d["segments"].append({"bogus": 1}),
    lambda d: d["tensors"][0].update(sources={"prefix": "x.", "experts": [0, -1], "parts": [".w"]}),
    lambda d: d["tensors"][0].update(sources={"prefix": "x.", "experts": [0, 2]}),
    lambda d: d["tensors"][0].update(sources="model.layers.1.mlp.experts.0.down_proj.weight"),
])
def test_malformed_index_is_a_protocol_error(mutate):
    data = sample().to_dict()
    mutate(data)
    with pytest.raises(ProtocolError):
        TensorIndex.from_dict(data)


def test_views_of_a_fused_tensor_that_cannot_split_are_refused():
    data = sample().to_dict()
    data["tensors"][0]["sources"] = [*DOWN, "one.too.many"]
    with pytest.raises(ProtocolError, match="cannot hold 3 equal sources"):
        TensorIndex.from_dict(data).checkpoint_entries()


# --- the source-pattern encoding -------------------------------------------------------------

STYLES = {  # (prefix template, per-expert parts) as the model families name their expert weights
    "deepseek_v3": ("model.layers.{layer}.mlp.experts.", [".gate_proj.weight", ".up_proj.weight"]),
    "deepseek_v3_down": ("model.layers.{layer}.mlp.experts.", [".down_proj.weight"]),
    "qwen_moe": ("model.layers.{layer}.mlp.experts.", [".gate_proj.weight", ".up_proj.weight"]),
    "mixtral": ("model.layers.{layer}.block_sparse_moe.experts.", [".w1.weight", ".w3.weight"]),
    "mixtral_down": ("model.layers.{layer}.block_sparse_moe.experts.", [".w2.weight"]),
    "mtp": ("model.layers.{layer}.mlp.experts.", [".down_proj.weight_scale_inv"]),
    "prefixed": ("language_model.model.layers.{layer}.mlp.experts.",
                 [".gate_proj.weight", ".up_proj.weight", ".x3.weight"]),
}


def expert_sources(style: str, layer: int, experts: int, first: int = 0) -> list[str]:
    """Today's order of a fused tensor's sources: expert by expert, each expert's parts in order (`Fusion.parts`)."""
    prefix, parts = STYLES[style]
    return [f"{prefix.format(layer=layer)}{e}{p}" for e in range(first, first + experts) for p in parts]


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("layer, experts", [(0, 2), (3, 256), (61, 256), (10, 64), (1, 11), (12, 128)])
def test_expert_sources_become_patterns_and_decode_to_the_same_list(style, layer, experts):
    sources = expert_sources(style, layer, experts)
    encoded = encode_sources(sources)
    assert isinstance(encoded, dict)
    assert encoded == {"prefix": STYLES[style][0].format(layer=layer), "experts": [0, experts],
                       "parts": STYLES[style][1]}
    assert decode_sources(json.loads(json.dumps(encoded))) == sources
    assert len(json.dumps(encoded)) < 160


def _irregular(rng: random.Random, sources: list[str]) -> list[str]:
    """A list that is no longer one expert range: each change breaks the pattern in another way."""
    out = list(sources)
    k = rng.randrange(len(out))
    change = rng.choice(["swap", "drop", "pad", "rename", "dup", "order", "shift"])
    if change == "swap" and len(out) > 2:
        j = (k + rng.randrange(1, len(out))) % len(out)
        out[k], out[j] = out[j], out[k]
    elif change == "drop":
        del out[k]
    elif change == "pad":  # zero-padded expert numbers cannot come back from str(e)
        out = [s.replace(".experts.1.", ".experts.01.") for s in out]
    elif change == "rename":
        out[k] = out[k].replace("weight", "bias")
    elif change == "dup":
        out.insert(k, out[k])
    elif change == "order":  # parts grouped by projection instead of by expert
        out = sorted(out, key=lambda s: (s.rsplit(".", 2)[-2], s))
    elif change == "shift":
        out[k] = out[k].replace(".experts.", ".experts.9")
    return out


def test_any_list_round_trips_and_only_exact_ranges_become_patterns():
    """Property: decode(encode(x)) == x for every list; a pattern only for lists that are an exact expert range."""
    rng = random.Random(0)
    for _ in range(600):
        style = rng.choice(sorted(STYLES))
        sources = expert_sources(style, rng.randrange(64), rng.randrange(2, 40), first=rng.choice([0, 0, 0, 1, 7]))
        for candidate in (sources, _irregular(rng, sources), _irregular(rng, _irregular(rng, sources))):
            encoded = encode_sources(candidate)
            assert decode_sources(json.loads(json.dumps(encoded))) == candidate
            if isinstance(encoded, dict):
                prefix, (first, count), parts = encoded["prefix"], encoded["experts"], encoded["parts"]
                assert count >= 2
                assert candidate == [f"{prefix}{e}{p}" for e in range(first, first + count) for p in parts]
    for odd in ([], ["a"], ["a", "b"], ["x.1.y", "x.1.y"], ["x.0.y", "x.2.y"], ["x.00.y", "x.01.y"], KV):
        assert encode_sources(odd) == odd


def test_a_deepseek_v3_sized_index_is_small(tmp_path):
    """DeepSeek-V3's counts (58 MoE layers of 256 experts + the MTP layer, 1,755 served tensors): the wire
    form stays <= 2 MB (it was ~2.6 MB with explicit lists) and the JSON is about the same size."""
    index = synthetic_dsv3_index()
    assert len(index.tensors) == 1755 and len(index.all_views()) == 44544
    wire = msgpack.packb(index.to_dict(), use_bin_type=True)
    assert len(wire) <= 2_000_000
    path = str(tmp_path / "index.json")
    write_json_atomic(path, index.to_dict(), indent=None)
    assert os.path.getsize(path) <= 2_000_000
    back = TensorIndex.from_dict(msgpack.unpackb(wire))
    assert back.tensors == index.tensors and back.all_views() == index.all_views()


def synthetic_dsv3_index() -> TensorIndex:
    """A TensorIndex with DeepSeek-V3's real counts at tiny dims: what the dsv3-counts preset serves."""
    tensors, n = [], 0

    def add(name, shape, sources, dtype="torch.bfloat16"):
        nonlocal n
        nbytes = 2 * __import__("math").prod(shape)
        tensors.append(TensorEntry(name, f"/dsv3.4242.1.{n:03d}", 0, nbytes, shape, dtype, sources,
                                   checksum=f"xxh3_64:{n:016x}"))
        n += 1

    add("model.embed_tokens.weight", [128, 16], ["model.embed_tokens.weight"])
    for layer in range(61):  # the MTP layer 61 is served as plain tensors (below)
        p = f"model.layers.{layer}"
        for w in ("input_layernorm", "post_attention_layernorm"):
            add(f"{p}.{w}.weight", [16], [f"{p}.{w}.weight"])
        for w in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                  "o_proj"):
            add(f"{p}.self_attn.{w}.weight", [16, 16], [f"{p}.self_attn.{w}.weight"])
        if layer < 3:
            for w in ("gate_proj", "up_proj", "down_proj"):
                add(f"{p}.mlp.{w}.weight", [16, 16], [f"{p}.mlp.{w}.weight"])
            continue
        add(f"{p}.mlp.gate.weight", [256, 16], [f"{p}.mlp.gate.weight"])
        add(f"{p}.mlp.gate.e_score_correction_bias", [256], [f"{p}.mlp.gate.e_score_correction_bias"], "torch.float32")
        add(f"{p}.mlp.experts.gate_up_proj", [256, 8, 16], expert_sources("deepseek_v3", layer, 256))
        add(f"{p}.mlp.experts.down_proj", [256, 16, 4], expert_sources("deepseek_v3_down", layer, 256))
        for w in ("gate_proj", "up_proj", "down_proj"):
            add(f"{p}.mlp.shared_experts.{w}.weight", [16, 16], [f"{p}.mlp.shared_experts.{w}.weight"])
    for w in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        add(f"model.layers.61.{w}.weight", [16, 16], [f"model.layers.61.{w}.weight"])
    add("model.norm.weight", [16], ["model.norm.weight"])
    add("lm_head.weight", [128, 16], ["lm_head.weight"])
    for k in range(1755 - len(tensors)):  # the rest of the real count: plain tensors
        add(f"model.extra.{k}.weight", [16], [f"model.extra.{k}.weight"])
    return TensorIndex(1, "dsv3", "deepseek_v3", "transformers-fused", {"model_type": "deepseek_v3"},
                       [SegmentEntry(t.segment, 4096) for t in tensors], tensors, None)


def test_view_count_is_the_number_of_derived_views():
    index = sample()
    count = index.view_count()
    assert count == len(derive_views(index.tensors)) == len(index.all_views()) > 0
