"""Every MoE model type the generator builds: save_pretrained checkpoint -> real daemon -> real worker, exact logits.

The checkpoint is what transformers itself writes for the family (per-expert names, renamed modules),
FP8-quantized where the family's releases are FP8 (scales in the family's dtype). The worker's logits
must be bitwise those of `from_pretrained` on a bf16 checkpoint of the reference-dequantized weights.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from expertd.tools.generate import FP8_SCALE_DTYPES, MOE_MODEL_TYPES, generate_model_type
from helpers.daemon import DaemonProcess
from helpers.inputs import INPUT_IDS
from helpers.reference import write_reference_bf16
from helpers.releases import CANNOT_RUN_4_57, ReleaseWorker, check_report, with_released_keys


@pytest.fixture(scope="module", params=MOE_MODEL_TYPES)
def model_checkpoint(request, tmp_path_factory) -> tuple[str, str, str]:
    """(model type, checkpoint folder, its bf16 reference's folder), generated once per model type: its config names
    the experts as the family's releases do (`with_released_keys`, what 4.57 reads; the newest release reads both)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    folder = str(root / "checkpoint")
    config = generate_model_type(folder, model_type)
    assert config["vocab_size"] > max(max(row) for row in INPUT_IDS)
    with_released_keys(folder)
    return model_type, folder, write_reference_bf16(folder, str(root / "reference"))


@pytest.fixture(scope="module")
def served(model_checkpoint, tmp_path_factory):
    """One daemon serving the family's checkpoint for every test of it (they only read: workers attach, each of
    its own release); afterwards it must have exited 0 and left nothing of its namespace in /dev/shm."""
    folder = model_checkpoint[1]
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    daemon = DaemonProcess.launch(tmp_path_factory.mktemp("run"), folder, namespace)
    try:
        daemon.wait_serving()
        yield daemon
    finally:
        code = daemon.stop()
        left = glob.glob(f"/dev/shm/{namespace}*")
        for path in left:
            os.unlink(path)
        assert code == 0 and not left, (code, left)


@pytest.fixture(scope="module")
def newest_worker(tmp_path_factory):
    """A worker process on this environment's transformers that attaches to each family's daemon in turn."""
    worker = ReleaseWorker(sys.executable, tmp_path_factory.mktemp("newest-worker"))
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def tf4_worker(tf4_python, tmp_path_factory):
    """The same on transformers 4.57, and the model types 4.57 has a config class for (`AutoConfig.for_model`)."""
    listed = subprocess.run([tf4_python, "-c", "import json; from transformers.models.auto.configuration_auto "
                             "import CONFIG_MAPPING_NAMES as m; print(json.dumps(sorted(m)))"],
                            capture_output=True, text=True, timeout=300, check=True)
    worker = ReleaseWorker(tf4_python, tmp_path_factory.mktemp("tf4-worker"))
    yield worker, set(json.loads(listed.stdout))
    worker.close()


def test_worker_logits_equal_transformers(model_checkpoint, served, newest_worker):
    """A worker's model from the daemon: logits bitwise those of its own from_pretrained of the bf16 reference, its
    dtypes, every parameter and loaded buffer in read-only shared memory."""
    import transformers

    model_type, _, reference = model_checkpoint
    check_report(newest_worker.run(served.endpoint, reference, use_cache=True), transformers.__version__)


def test_transformers4_worker_maps_every_tensor(model_checkpoint, tf4_worker, served):
    """The same family's checkpoint, served by this release's daemon, to a worker on transformers 4.57: every
    parameter and loaded buffer in read-only shared memory (derived tensors where 4.57 loads another dtype), logits
    equal to 4.57's own from_pretrained of the bf16 reference."""
    model_type, _, reference = model_checkpoint
    worker, known = tf4_worker
    if model_type not in known:
        pytest.skip(f"transformers 4.57 has no model type {model_type!r}")
    if model_type in CANNOT_RUN_4_57:
        pytest.skip(CANNOT_RUN_4_57[model_type])
    check_report(worker.run(served.endpoint, reference), "4.57")


def test_fp8_families_are_quantized_with_their_scale_dtype(model_checkpoint):
    """The checkpoint of an FP8 family holds FP8 weights with partial blocks and scales in the family's dtype."""
    from expertd.server.load.checkpoint import Checkpoint

    model_type, folder, _ = model_checkpoint
    ckpt = Checkpoint.open(folder)
    scales = {n: i for n, i in ckpt.tensors.items() if n.endswith("_scale_inv")}
    if model_type not in FP8_SCALE_DTYPES:
        assert scales == {} and "quantization_config" not in ckpt.config
        return
    assert scales and {i.dtype for i in scales.values()} == {FP8_SCALE_DTYPES[model_type]}
    weights = [ckpt.tensors[n[: -len("_scale_inv")]] for n in scales]
    assert {w.dtype for w in weights} == {torch.float8_e4m3fn}
    assert any(w.shape[0] % 128 or w.shape[1] % 128 for w in weights)
    assert any(ckpt.tensors[n[: -len("_scale_inv")]].file != i.file for n, i in scales.items())


def test_cli_generates_a_model_type(tmp_path, capsys):
    from expertd.server.cli.commands import main
    from expertd.server.load.checkpoint import Checkpoint

    out = str(tmp_path / "qwen3")
    assert main(["generate", out, "--model-type", "qwen3_moe", "--no-fp8"]) == 0
    ckpt = Checkpoint.open(out)
    assert ckpt.config["model_type"] == "qwen3_moe" and "quantization_config" not in ckpt.config
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in ckpt.tensors
    assert main(["generate", str(tmp_path / "ds"), "--no-fp8"]) == 2  # the presets are always FP8
