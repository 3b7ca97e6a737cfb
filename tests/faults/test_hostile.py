"""Hostile and careless callers: fuzzed control messages, writes into served memory, corrupted bytes, no token."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import threading

import msgpack
import pytest
import zmq

from expertd.client import ExpertClient
from expertd.errors import AuthError, ConfigError
from expertd.messages import OPS
from expertd.protocol import MAX_MESSAGE_BYTES
from helpers.daemon import expertd_cmd, write_config


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-2**31, 2**31)])
    if kind == 1:
        return rng.choice([float("nan"), float("inf"), -0.0, rng.random() * 1e308])
    if kind == 2:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(0, 40)))
    if kind == 3:
        return os.urandom(rng.randrange(0, 64))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(OPS + ("", "stop ", "STATUS", "index\x00"))
    if kind == 6:
        return rng.choice(["c1", "c999999", "x" * 1000])
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    keys = ["op", "client", "pid", "protocol", "x", 7, -1, b"op", None, 2.5]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


def random_frame(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return os.urandom(rng.randrange(0, 256))
    if kind == 1:  # a map with a known op but hostile fields (never "stop": that one is allowed to stop it)
        fields = {k: random_value(rng)
                  for k in rng.sample(["client", "pid", "protocol", "token", "x"], rng.randrange(0, 5))}
        return msgpack.packb({"op": rng.choice([o for o in OPS if o != "stop"]), **fields}, use_bin_type=True)
    if kind == 2:  # truncated or lying msgpack headers
        return rng.choice([b"\xdf\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\x93\x01"])
    if kind == 3:  # ext types and timestamps
        return msgpack.packb({"op": msgpack.ExtType(rng.randrange(128), os.urandom(8))}, use_bin_type=True)
    value = random_value(rng)
    if isinstance(value, dict) and value.get("op") == "stop":
        value["op"] = "status"
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return struct.pack("<Q", rng.getrandbits(64))


def test_fuzzed_control_socket_keeps_serving_correct_weights(tiny_checkpoint, start_daemon, workers):
    daemon = start_daemon(tiny_checkpoint)
    honest = workers(daemon.endpoint)
    ctx = zmq.Context()
    errors: list[BaseException] = []
    replies = [0]

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(150):
                kind = rng.choice([zmq.REQ, zmq.DEALER])
                sock = ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, 10000)
                try:
                    sock.connect(daemon.endpoint)
                    frames = [random_frame(rng)]
                    if kind == zmq.DEALER:  # raw peers: odd envelopes and several frames
                        frames = rng.choice([[b""] + frames, frames, frames * 3, [b"x", b""] + frames])
                    if i % 50 == 0:
                        frames = [b"\x00" * (MAX_MESSAGE_BYTES + 10)]  # over the cap: dropped, not read
                    sock.send_multipart(frames)
                    if kind == zmq.REQ and i % 50:
                        try:
                            reply = msgpack.unpackb(sock.recv(), raw=False)  # every REQ gets an answer
                        except zmq.Again:
                            raise AssertionError(f"no reply to {frames!r}") from None
                        assert isinstance(reply, dict) and "ok" in reply
                        replies[0] += 1
                finally:
                    sock.close(linger=0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(8)]  # many clients at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    ctx.term()
    assert errors == []
    assert replies[0] > 300
    status = daemon.status()
    assert status["state"] == "serving" and daemon.proc.poll() is None
    # a real client still attaches and reads exactly the loaded bytes; the holder's view never changed
    late = workers(daemon.endpoint)
    assert late.hello["digest"] == honest.hello["digest"] == honest.ask("digest")["digest"]
    with ExpertClient(daemon.endpoint) as client:
        assert client.verify() == []


def test_write_into_a_served_view_kills_only_that_worker(tiny_checkpoint, start_daemon, workers):
    daemon = start_daemon(tiny_checkpoint)
    bystander = workers(daemon.endpoint)
    vandal = workers(daemon.endpoint)
    vandal.send("write")
    assert vandal.proc.wait(60) == -11  # SIGSEGV: the mapping is read-only
    assert bystander.ask("digest")["digest"] == bystander.hello["digest"]
    out = subprocess.run(expertd_cmd("verify", "--endpoint", daemon.endpoint), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "all bytes match" in out.stdout


def test_copy_on_write_attach_keeps_writes_private(tiny_checkpoint, start_daemon, workers):
    daemon = start_daemon(tiny_checkpoint)
    bystander = workers(daemon.endpoint)
    mutator = workers(daemon.endpoint, timeout=30, cow=True)
    changed = mutator.ask("write")
    assert changed["digest"] != mutator.hello["digest"]  # it sees its own write
    assert bystander.ask("digest")["digest"] == bystander.hello["digest"]  # nobody else does
    assert workers(daemon.endpoint).hello["digest"] == bystander.hello["digest"]


def test_verify_names_a_tensor_whose_bytes_changed(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint)
    with ExpertClient(daemon.endpoint) as client:
        entry = next(t for t in client.index().tensors if t.name.endswith("experts.down_proj"))
    with open("/dev/shm" + entry.segment, "r+b") as f:  # a stray writer with write access (root here)
        f.seek(entry.offset + 1234)
        byte = f.read(1)
        f.seek(entry.offset + 1234)
        f.write(bytes([byte[0] ^ 0x01]))
    out = subprocess.run(expertd_cmd("verify", "--endpoint", daemon.endpoint), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert f"CHANGED  {entry.name}" in out.stdout and "1 changed" in out.stdout


def test_auth_token_is_required_when_set(tiny_checkpoint, start_daemon, monkeypatch):
    monkeypatch.setenv("EXPERTD_ALLOW_PLAIN_TCP_TOKENS", "1")  # plain tcp://: clients and the CLI send tokens in clear
    with zmq.Context() as ctx:
        probe = ctx.socket(zmq.REP)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
    token = "s3cret-token-0123456789"
    daemon = start_daemon(tiny_checkpoint, endpoint=f"tcp://127.0.0.1:{port}", auth_token=token)
    with pytest.raises(AuthError, match="lacks the daemon.s auth token"):
        ExpertClient(daemon.endpoint, timeout=10)
    with pytest.raises(AuthError, match="lacks the daemon.s auth token"):
        ExpertClient(daemon.endpoint, timeout=10, token="wrong-token-0123456789")
    with ExpertClient(daemon.endpoint, timeout=30, token=token) as client:
        assert client.status()["state"] == "serving"
    out = subprocess.run(expertd_cmd("status", "--config", daemon.config), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0  # the CLI takes the token from the config


def test_non_local_tcp_bind_needs_a_token(tmp_path, tiny_checkpoint):
    """Beyond this host: CURVE, or (insecure_tcp) a token at least."""
    from expertd.server.daemon.config import load_config

    cfg = write_config(tmp_path, tiny_checkpoint, "ns", endpoint="tcp://0.0.0.0:5999")
    with pytest.raises(ConfigError, match="without encryption; set curve_secret_key .* or insecure_tcp: true"):
        load_config(cfg)
    cfg = write_config(tmp_path, tiny_checkpoint, "ns", endpoint="tcp://0.0.0.0:5999", insecure_tcp=True)
    with pytest.raises(ConfigError, match="auth_token"):
        load_config(cfg)


def test_unreadable_checkpoint_folder(tmp_path, tiny_checkpoint):
    """Without the capability to override permissions (root has it), an unreadable folder is a named error."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    os.chmod(ckpt, 0)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.fail("setpriv (util-linux) is needed to drop root's permission override")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                  "--inh-caps", "-dac_override,-dac_read_search"]
    cfg = write_config(tmp_path, str(ckpt), "unreadable")
    try:
        out = subprocess.run(prefix + expertd_cmd("start", "--config", cfg), capture_output=True, text=True,
                             timeout=120)
    finally:
        os.chmod(ckpt, 0o755)
    assert out.returncode == 2
    assert "CheckpointError" in out.stderr and "unreadable" in out.stderr and str(ckpt) in out.stderr, out.stderr
