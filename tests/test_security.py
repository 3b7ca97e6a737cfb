"""Security across hosts: CURVE on tcp:// (encryption, which keys may connect and push), a push credential apart
from the read one on every transport, and no clear-text tcp beyond this host unless the config asks for it.
Real daemons, real clients, and a capture of the loopback traffic through a relaying proxy."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest
import torch

from expertd.client import ExpertClient, push_all
from expertd.errors import ConfigError, DaemonTimeout, PushDenied
from expertd.security import create_keys
from expertd.server.daemon.config import config_from_dict
from helpers.daemon import expertd_cmd

TOKEN = "read-token-0123456789abcdef"
PUSH = "push-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def keys(tmp_path):
    """A daemon key pair, a trainer key on the push allow-list, and a reader key on neither list."""
    root = tmp_path / "keys"
    daemon = create_keys(str(root), "daemon")
    trainer = create_keys(str(root / "push"), "trainer")
    reader = create_keys(str(root / "readers"), "reader")
    stranger = create_keys(str(root / "strangers"), "stranger")
    return {"root": root, "daemon": daemon, "trainer": trainer, "reader": reader, "stranger": stranger}


def curve_settings(keys, port: int, **extra) -> dict:
    return {"endpoint": f"tcp://127.0.0.1:{port}", "curve_secret_key": keys["daemon"][1],
            "curve_push_keys": str(keys["root"] / "push"), **extra}


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    ({"endpoint": "tcp://0.0.0.0:5555", "auth_token": TOKEN}, "without encryption; set curve_secret_key"),
    ({"push_token": TOKEN, "auth_token": TOKEN},
     "push_token must be a string of at least 16 characters, not the auth_token"),
    ({"curve_push_keys": "/tmp"}, "apply to tcp:// endpoints"),
    ({"endpoint": "tcp://127.0.0.1:5555", "curve_push_keys": "/tmp"}, "need curve_secret_key"),
    ({"endpoint": "tcp://127.0.0.1:5555", "curve_secret_key": "/nonexistent.key_secret"},
     "not a readable ZeroMQ key file"),
])
def test_security_settings_are_checked(tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"checkpoint": str(tmp_path), **extra})
    assert message in str(err.value)


def test_clear_text_tcp_beyond_this_host_only_when_asked(tmp_path, keys):
    cfg = config_from_dict({"checkpoint": str(tmp_path), "endpoint": "tcp://0.0.0.0:5555", "auth_token": TOKEN,
                            "insecure_tcp": True})
    assert cfg.insecure_tcp
    cfg = config_from_dict({"checkpoint": str(tmp_path), "endpoint": "tcp://0.0.0.0:5555",
                            "curve_secret_key": keys["daemon"][1], "auth_token": TOKEN})
    assert cfg.curve_secret_key == keys["daemon"][1]


# --- the push credential -------------------------------------------------------------------------

def test_read_credential_cannot_push_over_ipc(tiny_checkpoint, start_daemon):
    d = start_daemon(tiny_checkpoint, auth_token=TOKEN, push_token=PUSH)
    with ExpertClient(d.endpoint, token=TOKEN) as reader:
        norm = reader.tensors()["model.norm.weight"]
        with pytest.raises(PushDenied, match="may only read: pushing weights needs the daemon's push_token"):
            reader.update({"model.norm.weight": torch.zeros_like(norm)})
    assert d.status()["generation"] == 1
    with ExpertClient(d.endpoint, token=TOKEN, push_token=PUSH) as trainer:
        assert trainer.update({"model.norm.weight": torch.zeros_like(norm)}) == 2


def test_curve_keys_decide_who_connects_and_who_pushes(tiny_checkpoint, start_daemon, keys, tmp_path):
    port = free_port()
    d = start_daemon(tiny_checkpoint, wait=False,
                     **curve_settings(keys, port, curve_client_keys=str(keys["root"] / "readers")))
    # the CLI on the daemon's host presents the daemon's own key (read from the config's key file)
    done = subprocess.run(expertd_cmd("status", "--config", d.config, "--wait", "120"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    server_key = keys["daemon"][0]
    with ExpertClient(d.endpoint, server_key=server_key, client_key=keys["reader"][1]) as reader:
        norm = reader.tensors()["model.norm.weight"].clone()
        with pytest.raises(PushDenied, match="CURVE key may only read"):
            reader.update({"model.norm.weight": torch.zeros_like(norm)})
    # a key the daemon does not allow to connect, a wrong server key, no CURVE at all: no reply, a clear error
    for kwargs in ({"server_key": server_key, "client_key": keys["stranger"][1]},
                   {"server_key": keys["stranger"][0], "client_key": keys["reader"][1]}):
        started = time.monotonic()
        with pytest.raises(DaemonTimeout, match="with CURVE a daemon never answers"):
            ExpertClient(d.endpoint, timeout=1.0, **kwargs)
        assert time.monotonic() - started < 5
    with pytest.raises(DaemonTimeout, match="never answers a client without its public key"):
        ExpertClient(d.endpoint, timeout=1.0)
    assert d.status(timeout=1.0) is None  # the tests' plain status helper gets no answer either


def test_trainer_key_pushes_over_curve(tiny_checkpoint, start_daemon, keys):
    port = free_port()
    d = start_daemon(tiny_checkpoint, wait=False, **curve_settings(keys, port))
    done = subprocess.run(expertd_cmd("status", "--config", d.config, "--wait", "120"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    block = "model.layers.1.mlp.experts.gate_up_proj"
    with ExpertClient(d.endpoint, server_key=keys["daemon"][0]) as reader:  # any client with the server key reads
        norm = reader.tensors()["model.norm.weight"].clone()
        experts = reader.served_tensors()[block].clone()
    assert experts.nbytes > 1 << 20  # several frames, each encrypted: under the per-frame cap with CURVE's overhead
    pushed = {"model.norm.weight": norm * 2, block: experts * 2}
    assert push_all([d.endpoint], pushed, server_key=keys["daemon"][0], client_key=keys["trainer"][1]) == \
        {d.endpoint: 2}
    with ExpertClient(d.endpoint, server_key=keys["daemon"][0]) as reader:
        assert torch.equal(reader.tensors()["model.norm.weight"], norm * 2)
        assert torch.equal(reader.served_tensors()[block], experts * 2)


# --- what travels on the wire ----------------------------------------------------------------------

class Recorder:
    """A TCP relay on loopback that keeps every byte it passes in both directions: a capture of the traffic."""

    def __init__(self, target_port: int):
        self.target = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("curve", [False, True])
def test_a_capture_of_the_traffic_holds_the_pushed_bytes_only_without_curve(tiny_checkpoint, start_daemon, keys, curve):
    """Without CURVE the capture holds the token and the pushed tensor's bytes (so the capture does see them);
    with CURVE it holds neither."""
    port = free_port()
    settings = curve_settings(keys, port) if curve else {"endpoint": f"tcp://127.0.0.1:{port}",
                                                          "allow_plain_tcp_tokens": True}  # the CLI's token in clear
    d = start_daemon(tiny_checkpoint, wait=False, auth_token=TOKEN, **settings)
    done = subprocess.run(expertd_cmd("status", "--config", d.config, "--wait", "120"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    recorder = Recorder(port)
    try:
        via = f"tcp://127.0.0.1:{recorder.port}"
        credentials = ({"server_key": keys["daemon"][0], "client_key": keys["trainer"][1]} if curve
                       else {"allow_plain_tcp_tokens": True})  # what a capture then holds is the point
        with ExpertClient(via, token=TOKEN, heartbeat=False, **credentials) as client:
            norm = client.tensors()["model.norm.weight"]
        marker = torch.tensor([float(i % 97) + 0.5 for i in range(norm.numel())]).to(norm.dtype).reshape(norm.shape)
        assert push_all([via], {"model.norm.weight": marker}, token=TOKEN, **credentials) == {via: 2}
    finally:
        recorder.close()
    pattern = marker.reshape(-1).view(torch.uint8).numpy().tobytes()[:64]
    with recorder.lock:
        seen = bytes(recorder.seen)
    assert len(seen) > len(pattern)
    assert (pattern in seen) is (not curve)
    assert (TOKEN.encode() in seen) is (not curve)
