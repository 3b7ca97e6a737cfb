"""Parameters transformers converts with more than a rename or an expert stack are computed at load.

hrm_text's checkpoint holds fused `gqkv_proj` / `gate_up_proj` that transformers `Chunk`s into four and
two parameters; inkling2_text's holds `w13_weight` expert blocks that it `Interleave`s. The served tensor
must be exactly what `from_pretrained` puts in the parameter, and its checkpoint tensors are not views.
"""

from __future__ import annotations

import pytest
import torch

from expertd.index import derive_views
from expertd.tools.generate import generate_model_type
from helpers.inputs import INPUT_IDS
from helpers.reference import write_reference_bf16
from helpers.workers import worker_logits

COMPUTED_MODEL_TYPES = {"hrm_text": "Chunk", "inkling2_text": "Interleave"}


@pytest.fixture(scope="module", params=sorted(COMPUTED_MODEL_TYPES))
def model_checkpoint(request, tmp_path_factory) -> tuple[str, str, torch.Tensor, dict]:
    """(model type, checkpoint folder, reference logits, reference state dict), generated once per type."""
    from transformers import AutoModelForCausalLM

    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    folder = str(root / "checkpoint")
    generate_model_type(folder, model_type, fp8=False)
    reference = AutoModelForCausalLM.from_pretrained(write_reference_bf16(folder, str(root / "reference")),
                                                     dtype=torch.bfloat16)
    with torch.no_grad():
        logits = reference(torch.tensor(INPUT_IDS)).logits
    return model_type, folder, logits, reference.state_dict()


def test_plan_computes_what_from_pretrained_loads(model_checkpoint, namespace):
    """The planner marks the converted parameters; the loader's tensors equal from_pretrained's, bit for bit."""
    from expertd.server.load.loader import build, prepare

    model_type, folder, _, state = model_checkpoint
    ckpt, plan = prepare(folder)
    computed = [t for t in plan.tensors if t.computed is not None]
    # (5.24's inkling2_text also unpads its vocabulary with an op of its own: more ops may appear, never fewer)
    assert computed and COMPUTED_MODEL_TYPES[model_type] in {
        type(op).__name__ for t in computed for op in t.computed.converter.operations}
    built = build(ckpt, plan, namespace=namespace, generation=1, device="cpu")
    try:
        from expertd.segments import map_segment
        from expertd.shm import segment_bytes, view

        maps = {s.name: segment_bytes(map_segment(s.name, s.nbytes)) for s in built.index.segments}
        entries = {t.name: t for t in built.index.tensors}
        for t in computed:
            entry = entries[t.name]
            assert entry.sources == []
            assert torch.equal(view(maps, entry), state[t.name]), t.name
        sources = {s.name for t in computed for s in t.sources}
        assert not sources & set(built.index.checkpoint_entries())
        assert not [v for v in derive_views(built.index.tensors) if v.base in {t.name for t in computed}]
        del maps
    finally:
        built.close()


def test_incremental_build_reuses_unchanged_computed_tensors(model_checkpoint, namespace):
    from expertd.server.load.loader import build, prepare

    _, folder, _, _ = model_checkpoint
    first = build(*prepare(folder), namespace=namespace, generation=1, device="cpu")
    try:
        second = build(*prepare(folder), namespace=namespace, generation=2, device="cpu", previous=first)
        try:
            assert second.tensors_written == 0
            assert second.index.tensors == first.index.tensors
        finally:
            second.close()
    finally:
        first.close()


def test_worker_logits_equal_transformers(model_checkpoint, start_daemon, workers, namespace, tmp_path):
    model_type, folder, expected, _ = model_checkpoint
    daemon = start_daemon(folder)
    logits = worker_logits(workers, daemon.endpoint, namespace, str(tmp_path / "worker"))
    assert torch.equal(logits, expected), f"{model_type}: max |diff| {(logits.float() - expected.float()).abs().max()}"


@pytest.fixture
def conversion(monkeypatch):
    """Register a transformers conversion mapping for llama in this process (the daemon's own is untouched)."""
    from transformers import conversion_mapping

    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the cache
    cache = conversion_mapping._checkpoint_conversion_mapping_cache

    def register(mapping):
        monkeypatch.setitem(cache, "llama", mapping)

    yield register


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory) -> tuple[str, str]:
    """(a tiny FP8 llama checkpoint, the same with every down_proj stored transposed as `down_proj_t`,
    scales transposed with it: dequantizing commutes with transposing square blocks)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from expertd.server.load.checkpoint import Checkpoint

    root = tmp_path_factory.mktemp("llama")
    folder, moved = str(root / "checkpoint"), root / "transposed"
    generate_model_type(folder, "llama", fp8=True)
    ckpt = Checkpoint.open(folder)
    tensors = {}
    for name in ckpt.tensors:
        t = ckpt.read(name)
        if ".mlp.down_proj." in name:
            name, t = name.replace("down_proj", "down_proj_t"), t.T.contiguous()
        tensors[name] = t
    moved.mkdir()
    save_file(tensors, str(moved / "model.safetensors"))
    shutil.copy(root / "checkpoint" / "config.json", moved / "config.json")
    assert json.loads((moved / "config.json").read_text())["quantization_config"]
    return folder, str(moved)


def test_fp8_sources_are_dequantized_before_the_ops(llama_fp8, conversion, namespace):
    from transformers.core_model_loading import Transpose, WeightConverter

    from expertd.server.load.loader import build, prepare
    from expertd.shm import map_segments, view

    folder, moved = llama_fp8
    plain = build(*prepare(folder), namespace=namespace, generation=1, device="cpu")
    conversion([WeightConverter("mlp.down_proj_t.weight", "mlp.down_proj.weight", [Transpose(0, 1)])])
    ckpt, plan = prepare(moved)
    computed = {t.name: t for t in plan.tensors if t.computed is not None}
    assert sorted(computed) == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    assert all(s.scale is not None for t in computed.values() for s in t.sources)
    converted = build(ckpt, plan, namespace=namespace, generation=2, device="cpu")
    try:
        ours, theirs = ({t.name: t for t in b.index.tensors} for b in (converted, plain))
        maps = map_segments(converted.index.segments + plain.index.segments)
        for name in computed:
            assert ours[name].sources == [] and list(ours[name].shape) == [192, 320]
            assert torch.equal(view(maps, ours[name]), view(maps, theirs[name])), name
        assert not {n for n in converted.index.checkpoint_entries() if "down_proj_t" in n}
        del maps
    finally:
        converted.close()
        plain.close()


def test_a_computed_shape_that_does_not_fit_is_named(llama_fp8, conversion, namespace):
    from transformers.core_model_loading import Transpose, WeightConverter

    from expertd.errors import ShapeError
    from expertd.server.load.loader import build, prepare

    folder, _ = llama_fp8
    conversion([WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", [Transpose(0, 1)])])
    ckpt, plan = prepare(folder)
    with pytest.raises(ShapeError, match=r"\[320, 192\].*'model.layers.0.mlp.down_proj.weight' has shape \[192, 320\]"):
        build(ckpt, plan, namespace=namespace, generation=1, device="cpu")


def test_a_changed_source_recomputes_its_tensor_whole(llama_fp8, conversion, namespace, tmp_path):
    """Reload: a computed tensor with one changed source is rebuilt from all its sources; the rest are kept."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    from expertd.server.load.loader import build, prepare
    from expertd.shm import map_segments, view

    _, moved = llama_fp8
    changed = tmp_path / "changed"
    shutil.copytree(moved, changed)
    tensors = load_file(str(changed / "model.safetensors"))
    for suffix in ("weight", "weight_scale_inv"):  # layer 1's down_proj becomes layer 0's
        tensors[f"model.layers.1.mlp.down_proj_t.{suffix}"] = \
            tensors[f"model.layers.0.mlp.down_proj_t.{suffix}"].clone()
    save_file(tensors, str(changed / "model.safetensors"))
    conversion([WeightConverter("mlp.down_proj_t.weight", "mlp.down_proj.weight", [Transpose(0, 1)])])
    first = build(*prepare(moved), namespace=namespace, generation=1, device="cpu")
    try:
        second = build(*prepare(str(changed)), namespace=namespace, generation=2, device="cpu", previous=first)
        try:
            assert second.tensors_written == 1
            new = {t.name: t for t in second.index.tensors}
            old = {t.name: t for t in first.index.tensors}
            layer0, layer1 = (f"model.layers.{i}.mlp.down_proj.weight" for i in range(2))
            assert new[layer0] == old[layer0] and new[layer1].segment != old[layer1].segment
            maps = map_segments(second.index.segments)
            assert torch.equal(view(maps, new[layer1]), view(maps, new[layer0]))
            del maps
        finally:
            second.close()
    finally:
        first.close()


def test_natural_key_gives_transformers_keys():
    from transformers.core_model_loading import dot_natural_key

    from expertd.hf import natural_key

    names = ["model.layers.10.mlp.experts.2.w1.weight", "model.layers.2.mlp.experts.11.w1.weight", "lm_head.weight",
             "model.layers.2.mlp.experts.11.w1.weight_scale_inv", "a..b", "", "x.shard_11.y", "x.shard_2.y", "7",
             "model.layers.2.mlp.gate.e_score_correction_bias", "model.embed_tokens.weight", "x.007.y", "x.7.y"]
    key = natural_key(dot_natural_key)
    for name in names + names:  # the second pass takes the remembered parts
        assert key(name) == dot_natural_key(name), name
    assert sorted(names, key=key) == sorted(names, key=dot_natural_key)
