"""A real `expertd start` process: its config file, its command line, waiting for it to serve, stopping it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import yaml

from expertd.connection import Connection
from expertd.errors import ExpertdError


def daemon_settings(folder, checkpoint: str, namespace: str, **extra) -> dict:
    """The config of a daemon run from `folder`: its socket lives in folder/run/, progress bars are off, and a reload
    may name any folder (checkpoint_roots: /; tests/attacks/test_permissions.py sets narrower roots)."""
    return {"checkpoint": checkpoint, "endpoint": f"ipc://{folder}/run/expertd.sock", "namespace": namespace,
            "progress": False, "checkpoint_roots": ["/"], **extra}


def save_config(folder, settings: dict) -> str:
    """Write `settings` as folder/expertd.yaml and return that path."""
    os.makedirs(str(folder), exist_ok=True)
    path = os.path.join(str(folder), "expertd.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(settings, f)
    return path


def write_config(folder, checkpoint: str, namespace: str, **extra) -> str:
    """folder/expertd.yaml for a daemon serving `checkpoint` in `namespace`; returns its path."""
    return save_config(folder, daemon_settings(folder, checkpoint, namespace, **extra))


def expertd_cmd(*args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "expertd.server.cli", *args]


def refused_start(folder, checkpoint: str, namespace: str, *needles: str) -> str:
    """Run `expertd start` on a checkpoint it must refuse: exit 2, one line on stderr holding every needle (and the
    checkpoint's folder), nothing of the namespace left in /dev/shm; returns the line."""
    import glob

    done = subprocess.run(expertd_cmd("start", "--config", write_config(folder, checkpoint, namespace)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in (*needles, checkpoint)), lines
    assert not glob.glob(f"/dev/shm/{namespace}*")
    return lines[0]


def daemon_status(endpoint: str, token: str | None = None, timeout: float = 2.0) -> dict | None:
    """The daemon's status reply, or None when it does not answer."""
    conn = Connection(endpoint, timeout=timeout, token=token)
    try:
        return conn.request("status")
    except ExpertdError:
        return None
    finally:
        conn.close()


class DaemonProcess:
    """`expertd start --config config`, told the endpoint and token it serves (it never reads the config back)."""

    def __init__(self, config: str, endpoint: str, token: str | None = None, namespace: str | None = None,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, python: str = sys.executable,
                 prefix: tuple[str, ...] = (), env: dict | None = None):
        self.config = config
        self.endpoint = endpoint
        self.token = token
        self.namespace = namespace
        # `python`: another virtualenv's (a daemon on another transformers release), run from outside this tree;
        # `prefix`: what runs it (e.g. setpriv as another uid), which must exec it so that signals reach it
        cwd = None if python == sys.executable else os.path.dirname(config)
        self.proc = subprocess.Popen([*prefix, *expertd_cmd("start", "--config", config, python=python)],
                                     stdout=stdout, stderr=stderr, text=True, cwd=cwd, env=env)

    @classmethod
    def launch(cls, folder, checkpoint: str, namespace: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               python: str = sys.executable, env: dict | None = None, **extra) -> DaemonProcess:
        """Write folder/expertd.yaml (see `daemon_settings`) and start a daemon on it (with `python`'s expertd)."""
        settings = daemon_settings(folder, checkpoint, namespace, **extra)
        return cls(save_config(folder, settings), settings["endpoint"], settings.get("auth_token"), namespace,
                   stdout=stdout, stderr=stderr, python=python, env=env)

    def status(self, timeout: float = 2.0) -> dict | None:
        """The daemon's status reply, or None when it does not answer."""
        return daemon_status(self.endpoint, self.token, timeout)

    def wait_serving(self, timeout: float = 120.0) -> dict:
        """Poll until the daemon serves and return its status; raise if it exits or takes longer than `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {err}")
            status = self.status()
            if status and status["state"] == "serving":
                return status
            time.sleep(0.1)
        raise TimeoutError("daemon did not start serving")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (SIGKILL after `timeout`), reap, return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.communicate()
        return self.proc.returncode
