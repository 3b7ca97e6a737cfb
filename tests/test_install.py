"""`pip install expertd` in a worker environment: a wheel built from this tree, installed without extras
into a fresh virtualenv, brings what the client needs and nothing of the daemon's or the tools' (no
triton, no matplotlib), and a worker there attaches to a real daemon and runs a forward.

Slow (it installs torch and transformers into the new environment; pip's cache keeps it to a minute or
two). Everything is built under tmp_path from a copy of the tracked files, so the working tree gets no
`build/` or `*.egg-info`.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import zipfile

import pytest

from helpers.install import PIP, TORCH, run


PROBE = textwrap.dedent(
    """
    import importlib.resources, importlib.util, json
    import expertd
    from expertd.client import ExpertClient
    print(json.dumps({
        "expertd": expertd.__file__,
        "triton": importlib.util.find_spec("triton") is not None,
        "matplotlib": importlib.util.find_spec("matplotlib") is not None,
        "dequant_lut.c": importlib.resources.files("expertd.kernels").joinpath("dequant_lut.c").is_file(),
    }))
    """
)

WORKER = textwrap.dedent(
    """
    import sys
    import torch
    from expertd.client import ExpertClient

    with ExpertClient(sys.argv[1]) as client:
        model = client.load_model()
        with torch.no_grad():
            logits = model(torch.tensor([[0, 5, 17, 42]])).logits
    if logits.shape[:2] != (1, 4) or not torch.isfinite(logits).all():
        sys.exit(f"bad logits: shape {tuple(logits.shape)}")
    print("OK")
    """
)


@pytest.fixture(scope="module")
def worker_python(wheel, tmp_path_factory) -> str:
    """The python of a fresh virtualenv (no system site packages) with torch, then the wheel, no extras."""
    tmp = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(tmp / "venv")], cwd=tmp)
    python = str(tmp / "venv" / "bin" / "python")
    run([python, *PIP, "install", TORCH], cwd=tmp)
    run([python, *PIP, "install", wheel], cwd=tmp)
    return python


def test_wheel_ships_the_native_kernel_source(wheel):
    with zipfile.ZipFile(wheel) as zf:
        assert "expertd/kernels/dequant_lut.c" in zf.namelist()


def test_base_install_imports_the_client_and_nothing_of_server_or_tools(worker_python, tmp_path):
    found = json.loads(run([worker_python, "-c", PROBE], cwd=tmp_path).stdout)
    venv = os.path.dirname(os.path.dirname(worker_python))
    assert found["expertd"].startswith(venv), f"expertd imported from {found['expertd']}, not the new venv"
    assert not found["triton"], "the base install pulled triton"
    assert not found["matplotlib"], "the base install pulled matplotlib"
    assert found["dequant_lut.c"]


def test_worker_from_the_base_install_attaches_and_runs_a_forward(worker_python, tiny_checkpoint, start_daemon,
                                                                   tmp_path):
    daemon = start_daemon(tiny_checkpoint)  # served from this environment, as a daemon host would
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = run([worker_python, str(script), daemon.endpoint], cwd=tmp_path, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "OK"
