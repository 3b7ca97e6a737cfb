"""The real daemon process on a generated FP8 checkpoint, two real worker processes, real shared memory."""

from __future__ import annotations

import glob
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers.daemon import write_config
from helpers.inputs import INPUT_IDS
from helpers.reference import reference_tensors, write_reference_bf16

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reference_logits(tiny_checkpoint, tmp_path_factory) -> torch.Tensor:
    """transformers' own load of a bf16 checkpoint holding the reference-dequantized weights."""
    from transformers import AutoModelForCausalLM

    folder = write_reference_bf16(tiny_checkpoint, str(tmp_path_factory.mktemp("ref") / "bf16"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits, {k: str(v.dtype) for k, v in model.state_dict().items()}


def test_two_workers_share_exact_weights(tiny_checkpoint, start_daemon, namespace, tmp_path, reference_logits, workers):
    daemon = start_daemon(tiny_checkpoint)
    probes = [workers(daemon.endpoint, timeout=60, namespace=namespace, model=True, save=str(tmp_path / f"w{i}"))
              for i in range(2)]
    for w in probes:
        assert w.hello["ready"], w.proc.stderr.read()
    status = daemon.status()
    assert len(status["leases"]) == 2
    reports = [{**w.hello, **w.ask("measure")} for w in probes]  # measured while both are attached
    for w in probes:
        w.ask("exit")
        assert w.proc.wait(60) == 0, w.proc.stderr.read()

    ref_logits, ref_dtypes = reference_logits
    expected = reference_tensors(tiny_checkpoint)
    for i, report in enumerate(reports):
        # exact numerics and dtypes of transformers' own load
        logits = torch.load(tmp_path / f"w{i}" / "logits.pt")
        assert torch.equal(logits, ref_logits)
        assert {k: v for k, v in report["dtypes"].items() if k in ref_dtypes} == ref_dtypes
        assert report["dtypes"]["model.layers.1.mlp.gate.e_score_correction_bias"] == "torch.float32"
        assert not report["training"]
        assert report["forbidden_imports"] == []  # the client imports no server or kernel code
        # zero copy: every parameter's storage lies in a read-only shared mapping
        assert report["outside"] == []
        assert report["writable_maps"] == 0
        # tensors(): every checkpoint tensor bitwise the reference dequant, in the dtype the model loads it as
        # (transformers 5.24 keeps DeepSeek-V3's bf16-stored routers in float32: served cast once)
        views = load_file(str(tmp_path / f"w{i}" / "tensors.safetensors"))
        assert views.keys() == expected.keys()
        for name, ref in expected.items():
            assert str(views[name].dtype) == ref_dtypes.get(name, str(ref.dtype)), name
            ref = ref.to(views[name].dtype).contiguous()
            assert torch.equal(views[name].view(torch.uint8), ref.view(torch.uint8)), name
        # the pages are shared: each of the two workers accounts for about half of every mapping
        assert report["size"] >= status["bytes"]["total"]
        assert 0.4 <= report["pss"] / report["size"] <= 0.6, report

    # leases released on close
    assert daemon.status()["leases"] == []
    assert daemon.stop() == 0
    assert not glob.glob(f"/dev/shm/{namespace}*")
    assert not os.path.exists(daemon.endpoint[len("ipc://"):])


def test_status_cli_reports_what_is_served(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint)
    status = daemon.status()
    assert status["state"] == "serving" and status["generation"] == 1
    sock_path = daemon.endpoint[len("ipc://"):]
    assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    for seg in status["segments"]:
        assert stat.S_IMODE(os.stat("/dev/shm" + seg).st_mode) == 0o600
    assert status["tensors"] > 0 and status["bytes"]["torch.bfloat16"] > 0
    assert status["bytes"]["torch.float32"] > 0  # e_score_correction_bias stays F32
    text = subprocess.run([sys.executable, "-m", "expertd.server.cli", "status", "--config", daemon.config],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "generation  1" in text.stdout and "torch.bfloat16" in text.stdout
    stop = subprocess.run([sys.executable, "-m", "expertd.server.cli", "stop", "--config", daemon.config],
                          capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and f"stopped expertd pid {daemon.proc.pid}" in stop.stdout
    assert daemon.proc.wait(30) == 0
    assert not os.path.exists(sock_path)
    gone = subprocess.run([sys.executable, "-m", "expertd.server.cli", "status", "--endpoint", daemon.endpoint,
                           "--timeout", "30"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 2 and "DaemonNotRunning" in gone.stderr and "expertd start --config" in gone.stderr


def test_sigint_stops_cleanly(tiny_checkpoint, start_daemon, namespace):
    daemon = start_daemon(tiny_checkpoint)
    assert glob.glob(f"/dev/shm/{namespace}.*")
    index_path = os.path.join(os.path.dirname(daemon.endpoint[len("ipc://"):]), f"{namespace}.index.json")
    assert os.path.exists(index_path)
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(30) == 0
    assert not glob.glob(f"/dev/shm/{namespace}*") and not os.path.exists(index_path)


def test_bad_checkpoint_exits_nonzero_and_creates_nothing(tiny_checkpoint, start_daemon, namespace, tmp_path):
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(tiny_checkpoint, broken)
    os.unlink(os.path.join(broken, "model-00002-of-00003.safetensors"))
    daemon = start_daemon(broken, wait=False)
    assert daemon.proc.wait(120) != 0
    err = daemon.proc.stderr.read()
    assert "MissingShardError" in err and "model-00002-of-00003.safetensors" in err
    assert not glob.glob(f"/dev/shm/{namespace}*")
    assert not os.path.exists(daemon.endpoint[len("ipc://"):])


def test_example_worker_with_the_bundled_checkpoint(tmp_path, namespace):
    cfg = write_config(tmp_path, os.path.join(ROOT, "checkpoints", "tiny"), namespace)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "worker.py"), "--with-daemon", cfg],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "generated: [0, 5, 17, 42," in out.stdout and "0 tensor(s) private" in out.stdout, out.stdout
    # the dtypes from_pretrained gives: bf16, and float32 where this transformers keeps routers in fp32
    assert "dtypes: ['torch.bfloat16'" in out.stdout
