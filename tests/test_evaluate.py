"""`expertd evaluate`: the end-to-end cost of a format, on generated checkpoints and through a daemon."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from expertd.client import ExpertClient
from expertd.server.cli.commands import main
from expertd.tools.evaluate import compare, evaluate_model, load_checkpoint_model, token_batch
from helpers.reference import reference_tensors, write_reference_bf16


@pytest.fixture(scope="module")
def fp8_model(tiny_checkpoint):
    return load_checkpoint_model(tiny_checkpoint)


def test_checkpoint_model_holds_the_reference_dequantized_weights(fp8_model, tiny_checkpoint):
    ref = reference_tensors(tiny_checkpoint)
    q_a = "model.layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(fp8_model.get_parameter(q_a), ref[q_a])


def test_exact_format_costs_nothing_and_mxfp4_does(fp8_model):
    ids = token_batch(None, 24, fp8_model.config.vocab_size)
    result = evaluate_model(fp8_model, ids, ["bf16", "mxfp4", "hif8"], per_layer=True, activations=False)
    exact, mx = result["formats"]["bf16"], result["formats"]["mxfp4_e2m1"]
    assert exact["kl_mean"] == 0 and exact["kl_max"] == 0
    assert exact["top1_agreement"] == 1 and exact["max_abs_dlogit"] == 0
    assert mx["kl_mean"] > 0 and mx["kl_max"] >= mx["kl_mean"] and mx["max_abs_dlogit"] > 0
    assert set(mx["per_layer"]) == {"0", "1", "2"} and all(v["kl_mean"] > 0 for v in mx["per_layer"].values())
    assert all(v["kl_mean"] == 0 for v in exact["per_layer"].values())
    both = evaluate_model(fp8_model, ids, ["mxfp4_e2m1"], modules=["*mlp.experts*"])
    assert both["formats"]["mxfp4_e2m1"]["modules_simulated"] == 2


def test_compare_on_known_logits():
    base = torch.tensor([[[0.0, 0.0], [5.0, 0.0]]], dtype=torch.float64)
    r = compare(base, base.flip(-1))
    assert r["top1_agreement"] == 0.5 and r["max_abs_dlogit"] == 5.0 and r["kl_mean"] == pytest.approx(r["kl_max"] / 2)


def test_cli_on_a_bf16_folder_and_through_a_daemon(tiny_checkpoint, start_daemon, tmp_path):
    bf16 = write_reference_bf16(tiny_checkpoint, str(tmp_path / "bf16"))
    out = tmp_path / "eval"
    assert main(["evaluate", bf16, "--formats", "bf16,mxfp4_e2m1", "--random", "16", "--per-layer",
                 "--weights-only", "--out", str(out)]) == 0
    result = json.loads((out / "evaluate.json").read_text())
    assert result["formats"]["bf16"]["kl_mean"] == 0 and result["formats"]["mxfp4_e2m1"]["kl_mean"] > 0
    assert "| mxfp4_e2m1 |" in (out / "evaluate.md").read_text()
    for plot in result["plots"]:
        with Image.open(out / plot["file"]) as img:
            img.verify()
    assert {p["file"] for p in result["plots"]} == {"evaluate_kl.png", "evaluate_kl_per_layer.png"}

    daemon = start_daemon(tiny_checkpoint)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("1 2 3 4 5 6\n7 8 9 10 11 12\n")
    served = tmp_path / "served"
    assert main(["evaluate", "--endpoint", daemon.endpoint, "--formats", "bf16,hif8", "--tokens", str(tokens),
                 "--modules", "*mlp.experts*", "--out", str(served), "--no-plots"]) == 0
    result = json.loads((served / "evaluate.json").read_text())
    assert result["tokens"] == [2, 6] and result["formats"]["bf16"]["kl_mean"] == 0
    assert result["formats"]["hif8"]["kl_mean"] > 0
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        assert client.verify() == []  # evaluated on shared memory without writing it
