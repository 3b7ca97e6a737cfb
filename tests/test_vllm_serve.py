"""`vllm serve` with `--load-format expertd`, run as a user would: the CLI of the vLLM virtualenv (`vllm_python`'s
bin/vllm), a weightless model folder, the daemon's endpoint in `--model-loader-extra-config`, an OpenAI completion
request over HTTP. The server runs as `vllm serve` does (API server, engine core in a process of its own); with
`--skip-tokenizer-init` the prompts are token ids and `"return_token_ids": true` returns the generated ids in
`choices[i].token_ids` (the text is empty). Its greedy tokens are those of vLLM's own in-process load of the bf16
checkpoint (tests/test_vllm.py's `run_engines`, same prompts). vLLM's cache and config go to the test's folder.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

from helpers.daemon import DaemonProcess
from test_vllm import MAX_TOKENS, PROMPTS, free_port, model_folder, run_engines

pytestmark = pytest.mark.timeout(2400)  # the first session on a machine builds the vLLM virtualenv (minutes)
SHARED = "parameter(s) map shared memory"  # the loader's line (expertd/vllm/binding.py `report`)


def serve_env(folder: str) -> dict:
    """The environment of a `vllm serve` run from `folder`: the virtualenv's own packages only, vLLM's cache and
    config in `folder`, a small KV cache, no usage stats."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(PYTHONNOUSERSITE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=os.path.join(folder, "vllm-cache"), VLLM_CONFIG_ROOT=os.path.join(folder, "vllm-config"))
    return env


class Server:
    """`vllm serve MODEL --load-format expertd ...` in a session of its own, its stdout and stderr in one log file."""

    def __init__(self, python: str, folder: str, model: str, extra: dict, name: str = "serve"):
        self.port = free_port()
        self.log = os.path.join(folder, f"{name}.log")
        cmd = [os.path.join(os.path.dirname(python), "vllm"), "serve", model, "--load-format", "expertd",
               "--model-loader-extra-config", json.dumps(extra), "--dtype", "bfloat16", "--enforce-eager",
               "--skip-tokenizer-init", "--port", str(self.port), "--host", "127.0.0.1"]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=folder, env=serve_env(folder), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def tail(self, chars: int = 6000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-chars:]

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"vllm serve not healthy after {timeout} s:\n{self.tail()}")

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        request = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: HTTP {exc.code}: {exc.read()[:2000]!r}\n{self.tail()}") from None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGINT (as Ctrl-C), SIGKILL to its whole session after `timeout`; reap; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_session()
        return self.proc.wait()

    def kill_session(self) -> None:
        """SIGKILL whatever is left of the server's session (the engine core, vLLM's helpers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session this Popen started: its pgid is its pid
        except ProcessLookupError:
            pass


def leases(endpoint: str) -> int:
    from expertd.connection import Connection

    conn = Connection(endpoint, timeout=10)
    try:
        return len(conn.request("status")["leases"])
    finally:
        conn.close()


def wait_leases(endpoint: str, count: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (held := leases(endpoint)) != count and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


@pytest.fixture
def daemon(tmp_path):
    """A daemon serving a tiny Qwen3-MoE bf16 checkpoint (tmp_path/bf16), in a namespace of its own; stopped after
    the test, which must exit 0 and leave no segment."""
    from expertd.server.tools.generate import generate_model_type

    ckpt = str(tmp_path / "bf16")
    generate_model_type(ckpt, "qwen3_moe", fp8=False)
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    d = DaemonProcess.launch(tmp_path / "daemon", ckpt, namespace)
    try:
        d.wait_serving()
        d.checkpoint = ckpt
        yield d
    finally:
        code = d.stop()
        left = glob.glob(f"/dev/shm/{namespace}*")
        for path in left:
            os.unlink(path)
    assert code == 0 and not left, (code, left)


def test_vllm_serve_from_a_weightless_folder_generates_vllms_own_tokens(tmp_path, vllm_python, daemon):
    """The server holds one lease while it runs and none once stopped; the loader's line says the parameters map
    shared memory; greedy completions of token-id prompts equal vLLM's own load of the checkpoint."""
    folder = str(tmp_path)
    model = model_folder(daemon.checkpoint, str(tmp_path / "no-weights"))
    server = Server(vllm_python, folder, model, {"endpoint": daemon.endpoint})
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the reference engine while the server starts
            reference = pool.submit(run_engines, vllm_python, folder, [{"name": "vllm-bf16", "model": daemon.checkpoint}])
            server.wait_healthy()
            reply = server.post("/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            held = leases(daemon.endpoint)
            expected = reference.result()["vllm-bf16"]["tokens"]
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == expected, (reply, expected)
        assert [c["prompt_token_ids"] for c in choices] == PROMPTS
        assert all(c["text"] == "" for c in choices), reply  # no tokenizer: nothing is detokenized
        assert held == 1
        lines = [line for line in server.text().splitlines() if "expertd:" in line and SHARED in line]
        assert lines, server.tail()
    finally:
        code = server.stop()
    assert wait_leases(daemon.endpoint, 0) == 0
    assert code == 0 or code == -signal.SIGINT, (code, server.tail())


def test_vllm_serve_with_an_unknown_loader_option_exits_naming_it(tmp_path, vllm_python, daemon):
    """A misspelt key of `--model-loader-extra-config` is the loader's ConfigError: `vllm serve` exits non-zero,
    its log naming the key; no lease is left behind."""
    server = Server(vllm_python, str(tmp_path), model_folder(daemon.checkpoint, str(tmp_path / "no-weights")),
                    {"endpiont": "x"}, name="refused")
    try:
        code = server.proc.wait(240)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        server.stop()
    log = server.text()
    assert code not in (None, 0), server.tail()
    assert "ConfigError" in log and "endpiont" in log, server.tail()
    assert leases(daemon.endpoint) == 0
