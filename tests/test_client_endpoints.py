"""A malformed endpoint given to a client is the CLI's one-line ConfigError, never ZeroMQ's bare "Invalid argument"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import ConfigError, ExpertdError
from expertd.protocol import check_endpoint
from tests.helpers.daemon import expertd_cmd

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)

REPO = Path(__file__).resolve().parent.parent

# (endpoint, words its error must hold): a socket path without ipc://, tcp:// without a port, an unknown scheme, ...
BAD_ENDPOINTS = [
    ("/tmp/expertd-nowhere/x.sock", "looks like a socket path; write it as ipc:///tmp/expertd-nowhere/x.sock"),
    ("relative.sock", "looks like a relative socket path; write it as ipc:// followed by its absolute path, "
                      "e.g. ipc:///run/expertd/expertd.sock"),
    ("ipc:/run/expertd/expertd.sock", "has too few slashes; write it as ipc:///run/expertd/expertd.sock"),
    ("tcp:localhost:5555", "has too few slashes; write it as tcp://localhost:5555"),
    ("ipc://tmp/x.sock", "names the relative path tmp/x.sock, which each process would look for under its own working "
                         "folder; an absolute path takes three slashes: ipc:///tmp/x.sock"),
    ("ipc://./x.sock", "names the relative path ./x.sock, which each process would look for under its own working "
                       "folder; write it as ipc:// followed by its absolute path, e.g. ipc:///run/expertd/expertd.sock"),
    ("tcp://localhost", "names no port; write it as tcp://localhost:PORT"),
    ("localhost:5555", "needs its transport; write it as tcp://localhost:5555"),
    ("zmq://daemon", "must be ipc://PATH (a unix socket) or tcp://HOST:PORT"),
    ("ipc://", "names no socket path"),
]


def _cli_error(endpoint: str) -> str:
    """The one line `expertd status --endpoint ENDPOINT` prints: what the client must say too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    run = subprocess.run([*expertd_cmd(), "status", "--endpoint", endpoint], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 2, run.stderr
    return run.stderr.strip()


@pytest.mark.parametrize("endpoint,words", BAD_ENDPOINTS, ids=[e for e, _ in BAD_ENDPOINTS])
def test_the_python_client_refuses_a_bad_endpoint_as_the_cli_does(endpoint, words):
    with pytest.raises(ConfigError) as caught:
        ExpertClient(endpoint, heartbeat=False)
    message = str(caught.value)
    assert message == f"endpoint {endpoint!r} {words}"
    assert "Invalid argument" not in message
    cli = _cli_error(endpoint)
    assert cli.endswith(message) and "ConfigError" in cli, cli  # the same check, the same words
    with pytest.raises(ConfigError) as direct:
        Connection(endpoint)
    assert str(direct.value) == message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ExpertdError)


def test_an_environment_endpoint_is_named_in_its_error(monkeypatch):
    monkeypatch.setenv("EXPERTD_ENDPOINT", "/tmp/expertd-nowhere/x.sock")
    with pytest.raises(ConfigError, match=r"^\$EXPERTD_ENDPOINT: endpoint '/tmp/expertd-nowhere/x.sock' looks like"):
        ExpertClient(heartbeat=False)


def test_good_endpoints_pass_unchanged():
    for endpoint in ("ipc:///run/expertd/expertd.sock", "tcp://127.0.0.1:5555", "tcp://host-a:1"):
        assert check_endpoint(endpoint) == endpoint
    assert check_endpoint("ipc://run/x.sock", relative=True) == "ipc://run/x.sock"  # a config's: its folder anchors it


def test_a_config_resolves_a_relative_socket_path_and_a_flag_refuses_it(tmp_path):
    """A config file anchors `ipc://run/x.sock` at its own folder; on the command line or in $EXPERTD_ENDPOINT the
    same words would name a different file from each process's working folder: refused, the fix said."""
    from expertd.server.daemon.config import load_config, resolve_endpoint

    (tmp_path / "cfg.yaml").write_text("checkpoint: ckpt\nendpoint: ipc://run/x.sock\n")
    assert load_config(str(tmp_path / "cfg.yaml")).endpoint == f"ipc://{tmp_path}/run/x.sock"
    with pytest.raises(ConfigError, match=r"^--endpoint: endpoint 'ipc://run/x.sock' names the relative path run/x.sock"
                                          r".*three slashes: ipc:///run/x.sock$"):
        resolve_endpoint("ipc://run/x.sock")


def test_the_example_worker_says_one_line_for_a_socket_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    run = subprocess.run([sys.executable, str(REPO / "examples" / "worker.py"), "--endpoint", f"{tmp_path}/x.sock"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines == [f"worker: error: ConfigError: endpoint '{tmp_path}/x.sock' looks like a socket path; "
                     f"write it as ipc://{tmp_path}/x.sock"], run.stderr
    assert os.listdir(tmp_path) == []
