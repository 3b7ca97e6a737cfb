"""A worker running transformers 4.57 (per-expert modules, its own dtypes) against a daemon running 5.x:
a real virtualenv with 4.57, a real daemon, real shared memory."""

from __future__ import annotations

import json
import subprocess
import textwrap

from helpers.inputs import INPUT_IDS
from helpers.reference import write_reference_bf16

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from expertd.client import ExpertClient

    endpoint, reference, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.bfloat16)  # 4.57's own load
    with ExpertClient(endpoint) as client:
        model = client.load_model()
        with init_empty_weights():  # a model the worker built itself, bound by restore
            own = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(reference), dtype=torch.bfloat16)
        client.restore(own)
        private = client.private_tensors(model) + client.private_tensors(own)
        with torch.no_grad():
            out = {name: m(ids).logits
                   for name, m in (("load_model", model), ("restore", own), ("from_pretrained", ref))}
        print(json.dumps({
            "transformers": transformers.__version__,
            "names": sorted(n for n, _ in model.named_parameters()),
            "ref_names": sorted(n for n, _ in ref.named_parameters()),
            "dtypes": {n: str(t.dtype) for n, t in model.state_dict().items()},
            "ref_dtypes": {n: str(t.dtype) for n, t in ref.state_dict().items()},
            "equal": {k: torch.equal(v, out["from_pretrained"]) for k, v in out.items()},
            "private": private,
            "params": sum(1 for _ in model.parameters()),
        }))
    """
)


def run_worker(tf4_python: str, tmp_path, endpoint: str, reference: str) -> dict:
    """WORKER in the 4.57 venv against `endpoint`, its reference folder `reference`: what it printed."""
    script = tmp_path / "worker4.py"
    script.write_text(WORKER)
    proc = subprocess.run([tf4_python, str(script), endpoint, reference, json.dumps(INPUT_IDS)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transformers4_worker_gets_per_expert_modules_with_exact_logits(tf4_python, tiny_checkpoint, start_daemon,
                                                                        tmp_path):
    reference = write_reference_bf16(tiny_checkpoint, str(tmp_path / "bf16"))
    daemon = start_daemon(tiny_checkpoint)
    got = run_worker(tf4_python, tmp_path, daemon.endpoint, reference)
    assert got["transformers"].startswith("4.57")
    assert got["names"] == got["ref_names"]  # the model 4.57 builds: per-expert modules
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in got["names"]
    assert got["dtypes"] == got["ref_dtypes"]  # the dtypes 4.57's from_pretrained gives (bias in bf16 there)
    assert got["equal"] == {"load_model": True, "restore": True, "from_pretrained": True}
    # every parameter and loaded buffer lies in the daemon's read-only shared memory: what 4.57 loads in another
    # dtype than this release serves (the routers and the bias in bf16) is the daemon's dtype cast, not a copy
    assert got["private"] == [] and got["params"] > 0


def test_a_transformers4_worker_reads_a_stack_of_ranges(tf4_python, start_daemon, tmp_path):
    """`expert_ranges`: pushes of one expert's part each (three generations, two stacks of layer 1) make the stacks
    ranges of several generations' segments; after each, a 4.57 worker's per-expert modules are those ranges' slots
    themselves (no copy), and its logits equal 4.57's own from_pretrained of the checkpoint with every change so far."""
    from safetensors.torch import load_file, save_file

    from expertd.client import ExpertClient
    from expertd.tools.generate import generate

    paged = str(tmp_path / "paged")
    generate(paged, "tiny", hidden_size=256, moe_intermediate_size=128)  # DeepSeek-V3, FP8 blocks: 64 KiB parts
    daemon = start_daemon(paged)
    changes = {}
    for k, expert in enumerate(("model.layers.1.mlp.experts.3.up_proj.weight",
                                "model.layers.1.mlp.experts.6.down_proj.weight",
                                "model.layers.1.mlp.experts.0.gate_proj.weight")):
        with ExpertClient(daemon.endpoint, heartbeat=False) as c:
            changes[expert] = -c.tensors()[expert].clone()
            c.update({expert: changes[expert]})
            c.refresh()
            ranged = {t.name for t in c.index().tensors if t.extents}
        assert ranged == {f"model.layers.1.mlp.experts.{n}_proj" for n in ("gate_up", "down")[:min(k + 1, 2)]}
        changed = write_reference_bf16(paged, str(tmp_path / f"changed{k}"))
        weights = load_file(f"{changed}/model.safetensors")
        save_file({**weights, **{n: v.contiguous() for n, v in changes.items()}}, f"{changed}/model.safetensors")
        got = run_worker(tf4_python, tmp_path, daemon.endpoint, changed)
        assert got["transformers"].startswith("4.57") and expert in got["names"]
        assert got["equal"] == {"load_model": True, "restore": True, "from_pretrained": True}, k
        assert got["private"] == []
