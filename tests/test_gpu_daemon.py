"""A daemon with `device: cuda` (Triton dequantization on the GPU, then into shared memory) serves the bytes the CPU
path serves, bit for bit: DeepSeek FP8 blocks and gpt-oss MXFP4 experts, a reload onto a changed checkpoint, and a
push. Skipped where no CUDA GPU is visible (CI); run on a GPU host."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

from expertd.client import ExpertClient
from helpers.checkpoints import edit_checkpoint
from helpers.daemon import expertd_cmd
from helpers.kernel_cases import needs_cuda


def served(daemon) -> dict[str, torch.Tensor]:
    with ExpertClient(daemon.endpoint, timeout=120) as client:
        return {name: t.clone() for name, t in client.served_tensors().items()}


def assert_same_bytes(gpu: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor]) -> None:
    assert gpu.keys() == cpu.keys()
    for name, t in cpu.items():
        assert gpu[name].dtype == t.dtype and gpu[name].shape == t.shape, name
        assert torch.equal(gpu[name].view(torch.uint8), t.view(torch.uint8)), f"{name}: bytes differ"


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> str:
    from expertd.tools.generate import generate

    folder = str(tmp_path_factory.mktemp("gpu") / "dsv3")
    generate(folder, preset="dsv3-bytes", seed=3, shards=3)
    return folder


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory) -> str:
    from expertd.tools.generate import generate_model_type
    from expertd.tools.requantize import write_mxfp4

    folder = str(tmp_path_factory.mktemp("gpu") / "gpt-oss")
    generate_model_type(folder, "gpt_oss", fp8=False)
    write_mxfp4(folder)
    return folder


@needs_cuda
@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_a_daemon_on_the_gpu_serves_the_cpu_paths_bytes(kind, fp8_folder, mxfp4_folder, start_daemon):
    folder = fp8_folder if kind == "fp8" else mxfp4_folder
    cpu_daemon = start_daemon(folder, device="cpu")
    cpu = served(cpu_daemon)
    assert cpu_daemon.stop() == 0
    gpu_daemon = start_daemon(folder, device="cuda")
    assert_same_bytes(served(gpu_daemon), cpu)


@needs_cuda
def test_a_gpu_daemon_reloads_and_takes_a_push_as_the_cpu_path_does(fp8_folder, start_daemon, tmp_path):
    """A reload onto a checkpoint whose FP8 scales changed in one tensor (dequantized on the GPU again, the rest
    kept), then a push of one expert: the same bytes as a CPU daemon given the same two steps."""
    with open(os.path.join(fp8_folder, "model.safetensors.index.json")) as f:
        shard_of = json.load(f)["weight_map"]
    name = next(n for n in sorted(shard_of) if n.endswith("experts.0.up_proj.weight_scale_inv"))
    with safe_open(os.path.join(fp8_folder, shard_of[name]), "pt") as f:
        scale = f.get_tensor(name)
    changed = edit_checkpoint(fp8_folder, str(tmp_path / "changed"), replace={name: scale * 2})
    results = {}
    for device in ("cpu", "cuda"):
        daemon = start_daemon(fp8_folder, device=device, checkpoint_roots=[str(tmp_path)])
        args = ["reload", "--config", daemon.config, "--checkpoint", changed]
        done = subprocess.run(expertd_cmd(*args), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        with ExpertClient(daemon.endpoint, timeout=120) as client:
            expert = name.removesuffix("_scale_inv").replace("up_proj", "down_proj")
            client.update({expert: client.tensors()[expert] * 3})
        results[device] = served(daemon)
        assert daemon.stop() == 0
    assert_same_bytes(results["cuda"], results["cpu"])
