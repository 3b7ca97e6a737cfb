"""The control plane answers without torch: the request loop, adoption and the control commands import neither
torch nor transformers, a successor serves what it adopted before it imports them, and a stop never waits for
that import. Real daemons, real CLI processes; torch's import is held shut in the daemon to prove it."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from expertd.client import ExpertClient
from helpers import import_gate
from helpers.daemon import DaemonProcess, daemon_settings, expertd_cmd, save_config, write_config

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)

HEAVY = ("torch", "transformers", "safetensors", "numpy")

CONTROL_MODULES = ("expertd.server.daemon.loop", "expertd.server.daemon.service", "expertd.server.restart.adopt",
                   "expertd.server.restart.runstate", "expertd.server.serving.generations",
                   "expertd.server.serving.leases", "expertd.server.serving.jobs", "expertd.server.push.pushes",
                   "expertd.server.derived.tensors", "expertd.server.cli.stopping", "expertd.server.cli.starting",
                   "expertd.server.cli.commands", "expertd.connection", "expertd.leasing", "expertd.segments",
                   "expertd.index_segment")


def test_control_modules_import_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CONTROL_MODULES)
            + f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _imported(stderr: str) -> set[str]:
    """The top-level modules `python -X importtime` reports having imported."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "expertd.server.cli", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def _launch(folder, checkpoint: str, namespace: str, env=None, **extra) -> DaemonProcess:
    settings = daemon_settings(folder, checkpoint, namespace, **extra)
    return DaemonProcess(save_config(folder, settings), settings["endpoint"], namespace=namespace, env=env)


def test_control_commands_import_no_torch(tiny_checkpoint, namespace, tmp_path):
    d = _launch(tmp_path, tiny_checkpoint, namespace)
    try:
        d.wait_serving()
        for args in (["--version"], ["status", "--config", d.config], ["status", "--json", "--config", d.config],
                     ["verify", "--config", d.config], ["keys", str(tmp_path / "keys")]):
            done = _cli(*args)
            assert done.returncode == 0, (args, done.stderr[-2000:])
            assert not _imported(done.stderr) & set(HEAVY), args
        done = _cli("stop", "--config", d.config)
        assert done.returncode == 0 and "stopped expertd pid" in done.stdout, done.stderr[-2000:]
        assert not _imported(done.stderr) & set(HEAVY)
        assert d.proc.poll() is not None  # `stop` returns once the daemon has exited
        assert d.proc.returncode == 0
    finally:
        d.stop()
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_successor_serves_adopted_generations_while_torch_cannot_load(tiny_checkpoint, namespace, tmp_path):
    """A planned restart: the successor's `import torch` is held shut, yet it serves the handed-over generation,
    workers attach and verify it, `expertd verify` passes; its log says handover (not a reap of a dead daemon)
    and status lists no client. Once torch may load, its background check finds the checkpoint unchanged."""
    first = _launch(tmp_path, tiny_checkpoint, namespace)
    first.wait_serving()
    assert _cli("stop", "--keep", "--config", first.config).returncode == 0
    first.stop()
    gate = str(tmp_path / "gate")
    successor = DaemonProcess(first.config, first.endpoint, namespace=namespace,
                              env=import_gate.gated_env(gate, "torch", "transformers"))
    try:
        status = successor.wait_serving()
        assert status["generation"] == 1 and status["leases"] == []
        assert status["job"]["kind"] == "check" and status["job"]["state"] == "building"
        with ExpertClient(first.endpoint, heartbeat=False) as client:
            assert client.index().generation == 1
            assert client.verify() == []
        done = subprocess.run(expertd_cmd("verify", "--config", first.config), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and "all bytes match the index" in done.stdout, done.stderr
        assert import_gate.waiting(gate)[:1] == ["torch"]  # the check asked for torch, and waits: serving did not
        import_gate.open_gate(gate)
        deadline = time.monotonic() + 120
        while successor.status()["job"]["state"] == "building" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert successor.status()["job"]["state"] == "unchanged"
        successor.proc.send_signal(signal.SIGTERM)
        log = successor.proc.communicate(timeout=60)[1]
    finally:
        import_gate.open_gate(gate)
        successor.stop()
    assert successor.proc.returncode == 0
    assert "handover from pid" in log and "reaped" not in log, log
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_stop_does_not_wait_for_torch_to_load(tiny_checkpoint, namespace, tmp_path):
    """A successor stopped while its background check is still importing torch (held shut here) ends at once,
    exit 0, removing everything; nothing had been built."""
    first = _launch(tmp_path, tiny_checkpoint, namespace)
    first.wait_serving()
    first.proc.send_signal(signal.SIGUSR2)  # a handover, as `stop --keep`
    assert first.proc.wait(60) == 0
    gate = str(tmp_path / "gate")
    successor = DaemonProcess(first.config, first.endpoint, namespace=namespace,
                              env=import_gate.gated_env(gate, "torch"))
    try:
        successor.wait_serving()
        deadline = time.monotonic() + 60
        while not import_gate.waiting(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        done = subprocess.run(expertd_cmd("stop", "--config", first.config), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert successor.proc.wait(60) == 0  # while torch's import is still held shut
        out = successor.proc.stderr.read()
        assert "had not started building" in out and "did not stop within" not in out
    finally:
        import_gate.open_gate(gate)
        successor.stop()
    assert not glob.glob(f"/dev/shm/{namespace}*")
    assert not os.path.exists(os.path.dirname(first.endpoint.removeprefix("ipc://")))


def test_a_restart_after_a_crash_leaves_no_run_folder(tiny_checkpoint, namespace, tmp_path):
    """The folder a first daemon made (socket and run folder) is removed by the successor that adopted its
    generations when that one stops cleanly."""
    first = _launch(tmp_path, tiny_checkpoint, namespace)
    first.wait_serving()
    run = os.path.dirname(first.endpoint.removeprefix("ipc://"))
    first.proc.kill()
    first.stop()
    assert os.listdir(run)  # manifest, ledger and key left for a successor
    second = DaemonProcess(first.config, first.endpoint, namespace=namespace)
    second.wait_serving()
    assert second.stop() == 0
    assert not os.path.exists(run)
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_a_closed_pipe_ends_a_command_quietly(tiny_checkpoint, namespace, tmp_path):
    """`expertd status | head -1`: the reader has gone before the command writes; it ends 0 without a traceback."""
    d = _launch(tmp_path, tiny_checkpoint, namespace)
    try:
        d.wait_serving()
        for args in (["status", "--config", d.config], ["status", "--json", "--config", d.config], ["--help"]):
            proc = subprocess.Popen(expertd_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            proc.stdout.close()  # closed before the command starts writing: every write meets a broken pipe
            err = proc.stderr.read()
            assert proc.wait(120) == 0 and err == "", (args, err)
    finally:
        d.stop()


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory) -> str:
    from expertd.tools.generate import generate_model_type

    folder = str(tmp_path_factory.mktemp("dense") / "llama")
    generate_model_type(folder, "llama")
    return folder


def test_expert_parallel_on_a_dense_model_is_refused(dense_checkpoint, namespace, tmp_path):
    """A config that splits experts over EP ranks, on a model without expert stacks: exit 2, one line."""
    config = write_config(tmp_path, dense_checkpoint, namespace, expert_parallel={"size": 2, "ranks": [0]})
    done = subprocess.run(expertd_cmd("start", "--config", config), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "PartitionError" in lines[0] and "no expert stacks" in lines[0], lines
    assert dense_checkpoint in lines[0] and "llama" in lines[0]
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_verify_refused_for_a_wrong_token_names_the_command_and_the_fix(tiny_checkpoint, namespace, tmp_path):
    """`expertd verify` with a wrong token says that verify was refused (it needs a lease to read the served bytes)
    and where the token goes, not only that the daemon refused an attach the user never asked for."""
    d = DaemonProcess.launch(tmp_path, tiny_checkpoint, namespace, auth_token="the-right-token-0123456789")
    try:
        d.wait_serving()
        env = {**os.environ, "EXPERTD_TOKEN": "a-wrong-token-0123456789"}
        done = subprocess.run(expertd_cmd("verify", "--endpoint", d.endpoint), capture_output=True, text=True,
                              timeout=120, env=env)
        said = next((line for line in done.stderr.splitlines() if line.startswith("expertd verify:")), "")
        assert done.returncode != 0 and said.startswith("expertd verify: error: AuthError:"), done.stderr[-2000:]
        assert "verify reads the served bytes under a lease" in said and "--token" in said, said
    finally:
        d.stop()
