"""`expertd inspect` on a checkpoint, a running daemon and an activation capture: numbers and valid pictures."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from expertd.hf import model_config
from expertd.server.cli.commands import main
from expertd.server.load.checkpoint import Checkpoint
from expertd.tools.capture import capture
from expertd.tools.generate import make_config
from expertd.tools.inspect import component_of, inspect
from expertd.tools.number_formats import FORMATS
from helpers.checkpoints import EXPERT, edit_checkpoint
from helpers.inputs import INPUT_IDS
from helpers.reference import reference_tensors

FEW = ["bf16", "fp8_e4m3_block128", "mxfp8_e4m3", "mxfp4_e2m1"]


def assert_valid_pngs(out: str, report: dict) -> None:
    from PIL import Image

    assert report["plots"]
    with open(os.path.join(out, "index.html")) as f:
        page = f.read()
    for plot in report["plots"]:
        path = os.path.join(out, plot["file"])
        with Image.open(path) as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100
        assert f"src='{plot['file']}'" in page


@pytest.fixture(scope="module")
def mixed_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    """Mixed dtypes (an fp32 norm, an fp16 embedding) with zeros and non-finite values in the norm."""
    ckpt = Checkpoint.open(tiny_checkpoint)
    norm = ckpt.read("model.norm.weight").float() + torch.linspace(0, 1e-3, 320)  # not all bf16-representable
    norm[:10] = 0.0
    norm[10:13] = float("nan")
    norm[13] = float("inf")
    return edit_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp("mixed") / "ckpt"),
                           replace={"model.norm.weight": norm,
                                    "model.embed_tokens.weight": ckpt.read("model.embed_tokens.weight").half()})


@pytest.fixture(scope="module")
def checkpoint_report(mixed_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("inspect") / "out")
    return out, inspect(mixed_checkpoint, out)


def test_checkpoint_statistics(mixed_checkpoint, checkpoint_report):
    out, report = checkpoint_report
    with open(os.path.join(out, "stats.json")) as f:
        assert json.load(f)["totals"] == report["totals"]  # strict JSON (no NaN) that reads back
    rows = {t["name"]: t for t in report["tensors"]}
    ckpt = Checkpoint.open(mixed_checkpoint)
    assert rows.keys() == ckpt.tensors.keys()

    # per tensor: the values the model computes with (FP8 dequantized), stats over the finite ones
    ref = reference_tensors(mixed_checkpoint)[EXPERT].float()
    row = rows[EXPERT]
    assert row["dtype"] == "float8_e4m3fn" and row["values_dtype"] == "bfloat16" and row["shape"] == [200, 320]
    assert row["bytes"] == 200 * 320 and row["component"] == "routed experts"
    assert (row["layer"], row["expert"]) == (1, 3)
    assert row["min"] == ref.min().item() and row["max"] == ref.max().item()
    assert row["mean"] == pytest.approx(ref.double().mean().item(), rel=1e-9, abs=1e-12)
    assert row["std"] == pytest.approx(ref.double().std(correction=0).item(), rel=1e-6)
    norm = rows["model.norm.weight"]
    assert norm["dtype"] == "float32" and norm["zeros"] == 10 / 320 and norm["nonfinite"] == 4 / 320
    assert math.isfinite(norm["mean"]) and norm["formats"]["bf16"]["rel_error"] > 0  # fp32 values do not fit bf16
    assert rows["model.embed_tokens.weight"]["dtype"] == "float16"
    assert rows[EXPERT + "_scale_inv"]["role"] == "scale" and "formats" not in rows[EXPERT + "_scale_inv"]

    # totals: by dtype exactly the stored bytes; footprints per dtype from the element counts
    totals = report["totals"]
    for dtype in ("float8_e4m3fn", "float32", "float16", "bfloat16"):
        want = sum(i.nbytes for i in ckpt.tensors.values() if str(i.dtype) == f"torch.{dtype}")
        assert totals["by_dtype"][dtype]["bytes"] == want
    values = sum(math.prod(i.shape) for n, i in ckpt.tensors.items() if not n.endswith("_scale_inv"))
    assert totals["footprint"]["bf16"] == 2 * values and totals["footprint"]["fp32"] == 4 * values
    assert values < totals["footprint"]["fp8"] < 2 * values
    assert list(totals["by_component"]) == ["embeddings", "attention", "dense MLP", "shared experts", "routed experts",
                                            "router", "norms"]
    assert totals["by_component"]["routed experts"]["tensors"] == 2 * 8 * 3 * 2  # weights + scales


def test_format_comparison_on_real_weights(checkpoint_report):
    _, report = checkpoint_report
    overall = report["formats"]["overall"]
    assert list(overall) == list(FORMATS)
    rel = {f: overall[f]["rel_error"] for f in overall}
    assert rel["fp16"] < rel["bf16"] < rel["fp8_e4m3_block128"] < rel["mxfp8_e4m3"] < rel["mxfp4_e2m1"]
    assert rel["fp8_e4m3_tensor"] < rel["fp8_e5m2_tensor"]
    by_component = report["formats"]["by_component"]
    # the experts were stored as bf16 rounded, 128x128-block FP8: bf16 holds them exactly, the same format nearly
    assert by_component["bf16"]["routed experts"] == {"rel_error": 0.0, "snr_db": "inf"}
    assert by_component["fp8_e4m3_block128"]["routed experts"]["rel_error"] < 0.005
    assert set(report["formats"]["by_layer"]["mxfp4_e2m1"]) == {"0", "1", "2"}
    cells = report["formats"]["by_expert"]["mxfp4_e2m1"]
    assert {(c["layer"], c["expert"]) for c in cells} == {(layer, e) for layer in (1, 2) for e in range(8)}
    assert all(20 < c["snr_db"] < 40 for c in report["formats"]["by_expert"]["mxfp8_e4m3"])


def test_checkpoint_pictures_and_page(checkpoint_report):
    out, report = checkpoint_report
    files = {p["file"] for p in report["plots"]}
    assert {"histograms.png", "boxplots.png", "qq.png", "formats_summary.png", "formats_by_layer.png",
            "experts_norm.png", "experts_scale.png", "experts_error_mxfp4_e2m1.png"} <= files
    assert_valid_pngs(out, report)
    with open(os.path.join(out, "stats.md")) as f:
        text = f.read()
    assert "| routed experts |" in text
    assert f"| {EXPERT} | float8_e4m3fn | fp8 e4m3, 128x128 block scale | 200x320 |" in text


def test_daemon_endpoint_gives_the_served_values(tiny_checkpoint, start_daemon, tmp_path):
    daemon = start_daemon(tiny_checkpoint)
    out = str(tmp_path / "out")
    assert main(["inspect", daemon.endpoint, "--out", out, "--formats", ",".join(FEW)]) == 0
    with open(os.path.join(out, "stats.json")) as f:
        report = json.load(f)
    assert report["source"]["kind"] == "daemon"
    rows = {t["name"]: t for t in report["tensors"]}
    ref = reference_tensors(tiny_checkpoint)
    assert rows.keys() == ref.keys()
    assert rows[EXPERT]["dtype"] == "bfloat16" and rows[EXPERT]["max"] == ref[EXPERT].float().max().item()
    assert rows["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "float32"
    assert list(report["formats"]["overall"]) == FEW
    assert_valid_pngs(out, report)
    none = str(tmp_path / "none")  # statistics alone: no format compared, none in the report
    assert main(["inspect", daemon.endpoint, "--out", none, "--formats", "none"]) == 0
    with open(os.path.join(none, "stats.json")) as f:
        report = json.load(f)
    assert report["formats"]["overall"] == {} and all("formats" not in t or not t["formats"] for t in report["tensors"])


def test_capture_folder_statistics_and_pictures(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(make_config("tiny")))
    ids = torch.tensor(INPUT_IDS)
    with capture(model, str(tmp_path / "cap"), modules=["*.self_attn", "*.o_proj", "*.shared_experts.*"]):
        model(ids, labels=ids).loss.backward()
    out = str(tmp_path / "out")
    report = inspect(str(tmp_path / "cap"), out, formats=FEW)
    assert report["source"]["kind"] == "capture"
    groups = {t["group"] for t in report["tensors"]}
    assert groups == {"forward input", "forward output", "backward grad_input", "backward grad_output"}
    row = next(t for t in report["tensors"] if t["name"] == "000001_L02_self_attn_backward_grad_input:hidden_states")
    assert row["role"] == "gradient" and row["component"] == "attention" and row["layer"] == 2
    assert row["dtype"] == "bfloat16" and row["formats"]["bf16"]["rel_error"] == 0.0
    assert report["totals"]["by_component"].keys() == {"attention", "shared experts"}
    assert set(report["formats"]["by_group"]["mxfp4_e2m1"]) == groups
    files = {p["file"] for p in report["plots"]}
    assert {"histograms.png", "qq.png", "formats_summary.png", "formats_by_layer.png", "formats_by_group.png"} <= files
    assert_valid_pngs(out, report)


def test_components():
    assert component_of("model.layers.3.self_attn.q_a_layernorm.weight") == "attention"
    assert component_of("model.layers.3.mlp.experts.7.down_proj.weight") == "routed experts"
    assert component_of("model.layers.3.mlp.experts.gate_up_proj") == "routed experts"
    assert component_of("model.layers.3.mlp.shared_experts.up_proj.weight") == "shared experts"
    assert component_of("model.layers.3.mlp.gate.e_score_correction_bias") == "router"
    assert component_of("model.layers.0.mlp.down_proj.weight") == "dense MLP"
    assert component_of("model.layers.0.input_layernorm.weight") == "norms"
    assert component_of("lm_head.weight") == "embeddings" and component_of("model.embed_tokens.weight") == "embeddings"


def test_missing_source_fails_with_a_typed_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    assert "MissingShardError" in capsys.readouterr().err
