"""The test side of `worker.py`: start a worker process, ask it one command at a time, end it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


class Worker:
    """A `worker.py` process attached to `endpoint`; `hello` is its first reply (lease, digest, model report).
    `prefix`: a command that runs it (e.g. `unshare ...`), so that `proc` is that command's process."""

    def __init__(self, endpoint: str, timeout: float = 30, cow: bool = False, namespace: str | None = None,
                 model: bool = False, save: str | None = None, prefix: list[str] | None = None):
        args = [endpoint, "--timeout", str(timeout)]
        if cow:
            args.append("--cow")
        if namespace is not None:
            args += ["--namespace", namespace]
        if model:
            args.append("--model")
        if save is not None:
            os.makedirs(save, exist_ok=True)
            args += ["--save", save]
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, WORKER_SCRIPT, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died: {self.proc.wait()} {self.proc.stderr.read()}")
        return json.loads(line)

    def send(self, cmd: str) -> None:
        """Send a command without waiting for the reply (for commands that may kill the worker)."""
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        """The reply to a command sent with `send`."""
        return self._read()

    def ask(self, cmd: str) -> dict:
        self.send(cmd)
        return self._read()

    def finish(self) -> None:
        """Kill it if it still runs, reap it, close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def worker_logits(workers, endpoint: str, namespace: str, out_dir: str):
    """The logits of a real worker process that loaded the served model, after checking that every
    parameter lies in shared memory and that it exits cleanly."""
    import torch

    worker = workers(endpoint, timeout=60, namespace=namespace, model=True, save=out_dir)
    assert worker.hello["ready"], worker.proc.stderr.read()
    assert worker.hello["outside"] == [], "parameters outside shared memory"
    assert worker.hello["writable_maps"] == 0, "a segment mapped writable"
    worker.ask("exit")
    assert worker.proc.wait(60) == 0, worker.proc.stderr.read()
    return torch.load(os.path.join(out_dir, "logits.pt"))
