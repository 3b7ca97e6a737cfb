"""Shared fixtures: generated checkpoints, unique namespaces checked for leaks, a real daemon process."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from expertd.client.connection import Connection
from expertd.errors import ExpertdError
from expertd.server.tools.generate import generate

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 FP8 checkpoint (partial blocks, scales in other shards), generated once."""
    folder = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    generate(folder, preset="tiny", seed=0, shards=3)
    return folder


@pytest.fixture
def namespace():
    """A namespace unique to this test; afterwards nothing of it may be left in /dev/shm."""
    ns = f"edt{uuid.uuid4().hex[:10]}"
    yield ns
    left = glob.glob(f"/dev/shm/{ns}*")
    for path in left:
        os.unlink(path)
    assert not left, f"test left shared memory behind: {left}"


def write_config(folder, checkpoint: str, namespace: str, **extra) -> str:
    path = os.path.join(str(folder), "expertd.yaml")
    cfg = {"checkpoint": checkpoint, "endpoint": f"ipc://{folder}/run/expertd.sock", "namespace": namespace,
           "progress": False, **extra}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def expertd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "expertd.server.cli", *args]


class DaemonProcess:
    def __init__(self, config: str, endpoint: str):
        self.config = config
        self.endpoint = endpoint
        self.proc = subprocess.Popen(expertd_cmd("start", "--config", config), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def status(self, timeout: float = 2.0) -> dict | None:
        """The daemon's status reply, or None when it does not answer."""
        with open(self.config) as f:
            token = yaml.safe_load(f).get("auth_token")
        conn = Connection(self.endpoint, timeout=timeout, token=token)
        try:
            return conn.request("status")
        except ExpertdError:
            return None
        finally:
            conn.close()

    def wait_serving(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.proc.stderr.read()}")
            status = self.status()
            if status and status["state"] == "serving":
                return status
            time.sleep(0.1)
        raise TimeoutError("daemon did not start serving")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.communicate()
        return self.proc.returncode


@pytest.fixture
def start_daemon(tmp_path, namespace):
    """Start real `expertd start` processes; each is stopped (and checked to exit 0) after the test."""
    started: list[DaemonProcess] = []

    def start(checkpoint: str, wait: bool = True, **extra) -> DaemonProcess:
        cfg = write_config(tmp_path, checkpoint, namespace, **extra)
        with open(cfg) as f:
            endpoint = yaml.safe_load(f)["endpoint"]
        d = DaemonProcess(cfg, endpoint)
        started.append(d)
        if wait:
            d.wait_serving()
        return d

    yield start
    for d in started:
        d.stop()
