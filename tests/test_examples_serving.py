"""The workers the deployments run stay up: examples/serve.py answers over HTTP and follows new generations,
examples/ep_worker.py (torchrun, expert parallelism) refreshes every rank together; SIGTERM ends both cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from helpers.polling import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_until(proc, text: str, timeout: float = 120) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"never printed {text!r}: {''.join(seen)[-3000:]}")


def test_serve_answers_and_follows_new_generations(tiny_checkpoint, start_daemon):
    from expertd.client import ExpertClient

    d = start_daemon(tiny_checkpoint, lease_timeout_s=1.5)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "serve.py"), "--endpoint", d.endpoint,
                             "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = read_until(proc, "serving generation 1 on").split(" on ", 1)[1].strip()
        assert json.load(urllib.request.urlopen(url + "/healthz")) == {"generation": 1}
        body = json.dumps({"input_ids": [[0, 5, 17]], "max_new_tokens": 3}).encode()

        def generate() -> dict:
            return json.load(urllib.request.urlopen(urllib.request.Request(url + "/generate", body)))

        first = generate()
        assert first["generation"] == 1 and len(first["output_ids"][0]) == 6
        with ExpertClient(d.endpoint) as client:
            norm = client.tensors()["model.norm.weight"]
            assert client.update({"model.norm.weight": torch.full_like(norm, 0.5)}) == 2
        # a heartbeat tells the worker of generation 2 (within a third of the lease timeout): the next request moves
        wait_until(lambda: generate()["generation"] == 2, "a request served by generation 2", timeout=60, every=0.1)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url + "/generate", b'{"input_ids": 3}'))
        assert err.value.code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert d.status()["leases"] == []
    finally:
        proc.kill()
        proc.wait()


def test_ep_worker_stays_up_and_refreshes_every_rank(tiny_checkpoint, start_daemon, tmp_path):
    d = start_daemon(tiny_checkpoint, expert_parallel={"size": 2}, lease_timeout_s=1.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp_path / "ready"
    # TMPDIR: torchrun's own torchelastic_* log folders go with the test's folder, not into /tmp
    env = {**os.environ, "EXPERTD_ENDPOINT": d.endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                             "127.0.0.1", "--master_port", str(port), os.path.join(ROOT, "examples", "ep_worker.py"),
                             "--poll", "0.2", "--ready-file", str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        read_until(proc, "serving generation 1")
        wait_until(ready.exists, "every rank is ready", timeout=60, every=0.1)
        assert subprocess.run([sys.executable, "-m", "expertd.server.cli", "reload", "--endpoint", d.endpoint],
                              capture_output=True, timeout=120).returncode == 0
        read_until(proc, "refreshed to generation 2")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        assert d.status()["leases"] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
