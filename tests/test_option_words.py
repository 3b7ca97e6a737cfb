"""The client's hints name the caller's options in the caller's words, at the source (`expertd.option_words`): the
CLI's flags by default, vLLM's `model_loader_extra_config` keys where the vLLM adapter attaches (`VLLM_WORDS`) —
never a CLI flag to a vLLM user. The messages are made as a client meets them (no daemon, one that does not answer,
a token bound for plain tcp://); no vLLM needed.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest
import zmq

from expertd.connection import Connection, check_running
from expertd.errors import ConfigError, DaemonNotRunning, DaemonTimeout
from expertd.option_words import CLI, OptionWords
from expertd.security import Credentials

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)


def vllm_words() -> OptionWords:
    """The adapter's `VLLM_WORDS`, from its options module alone (plain Python: the package itself needs vLLM)."""
    path = Path(__file__).resolve().parent.parent / "client" / "engines" / "vllm" / "options.py"
    spec = importlib.util.spec_from_file_location("vllm_options", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module.VLLM_WORDS


VLLM_WORDS = vllm_words()


def timeout_message(endpoint: str, credentials: Credentials, words: OptionWords) -> str:
    with pytest.raises(DaemonTimeout) as caught:
        conn = Connection(endpoint, timeout=0.2, credentials=credentials, words=words)
        try:
            conn.request("status")
        finally:
            conn.close()
    return str(caught.value)


def hints(tmp_path, words: OptionWords) -> list[str]:
    """What a client says, worded by `words`: no daemon, a socket nobody answers (ipc, tcp, tcp with CURVE), a token
    bound for plain tcp://."""
    said = []
    with pytest.raises(DaemonNotRunning) as caught:
        check_running(f"ipc://{tmp_path}/nobody.sock", words)
    said.append(str(caught.value))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a socket whose owner never answers
    try:
        listening.bind(str(tmp_path / "stuck.sock"))
        listening.listen(8)
        said.append(timeout_message(f"ipc://{tmp_path}/stuck.sock", Credentials.resolve(), words))
    finally:
        listening.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{closed.getsockname()[1]}"  # nobody listens there while it stays bound
    try:
        said.append(timeout_message(endpoint, Credentials.resolve(), words))
        said.append(timeout_message(endpoint, Credentials.resolve(server_key=zmq.curve_keypair()[0]), words))
        with pytest.raises(ConfigError) as caught:
            Connection(endpoint, timeout=0.2, token="a-token-0123456789", words=words).request("status")
        said.append(str(caught.value))
    finally:
        closed.close()
    return said


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch):
    for name in ("EXPERTD_TOKEN", "EXPERTD_SERVER_KEY", "EXPERTD_CLIENT_KEY", "EXPERTD_ALLOW_PLAIN_TCP_TOKENS"):
        monkeypatch.delenv(name, raising=False)


def test_a_vllm_user_meets_only_vllm_option_words(tmp_path):
    said = hints(tmp_path, VLLM_WORDS)
    text = "\n".join(said)
    assert not any(flag in text for flag in ("--endpoint", "--timeout", "--server-key")), text
    for word in (VLLM_WORDS.point, VLLM_WORDS.timeout, VLLM_WORDS.server_key):
        assert word in text, (word, text)


def test_the_cli_words_are_the_default(tmp_path):
    text = "\n".join(hints(tmp_path, CLI))
    assert "model_loader_extra_config" not in text
    for word in (CLI.point, CLI.timeout, CLI.server_key):
        assert word in text, (word, text)
