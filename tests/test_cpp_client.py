"""The C++ client (client/cpp) against a real daemon: what `expertd-cpp-dump` sees is what ExpertClient sees.

client/cpp is built once per session with CMake into ~/.cache/expertd/cpp-<hash of its sources, torch and
compiler> (reused while they do not change); its ctest runs the golden protocol vectors. Missing build
prerequisites fail these tests with the package to install (CI installs them), never skip them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from expertd.client import ExpertClient
from expertd.errors import ConfigError
from expertd.index import checksum, checksum_parts, tensor_bytes, tensor_checksum
from expertd.protocol import check_endpoint
from expertd.server.serving.leases import lease_tag
from helpers.install import CACHE, locked
from helpers.polling import wait_until

REPO = Path(__file__).resolve().parent.parent
CPP = REPO / "client" / "cpp"
GOLDEN = REPO / "tests" / "golden" / "protocol"
TINY = str(REPO / "checkpoints" / "tiny")
TOKEN = "cpp-client-token-0123456789"
APT = "apt-get install -y cmake g++ pkg-config libzmq3-dev libmsgpack-cxx-dev libxxhash-dev"
BUILD_SUFFIXES = (".cpp", ".hpp", ".h", ".txt", ".cmake")  # what the build reads (not the docs or scripts)
EXIT = {"BAD": 1, "DaemonNotRunning": 3, "DaemonTimeout": 4, "AuthError": 5, "PermissionDenied": 11}


def _missing_prerequisites() -> list[str]:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake (package cmake)")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        missing.append("a C++17 compiler (package g++)")
        return missing
    for header, package in (("zmq.h", "libzmq3-dev"), ("msgpack.hpp", "libmsgpack-cxx-dev"),
                            ("xxhash.h", "libxxhash-dev")):
        probe = subprocess.run([cxx, "-x", "c++", "-std=c++17", "-E", "-", "-o", os.devnull],
                               input=f"#include <{header}>\n", capture_output=True, text=True)
        if probe.returncode != 0:
            missing.append(f"{header} (package {package})")
    return missing


def _build_key() -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in CPP.rglob("*") if p.is_file() and p.suffix in BUILD_SUFFIXES):
        h.update(str(path.relative_to(CPP)).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(f"{torch.__version__} {torch.__file__} {sys.executable}".encode())
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or ""
    h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode() if cxx else b"")
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def cpp_build() -> Path:
    """client/cpp built (Release) in ~/.cache/expertd/cpp-<key>: once, then reused while its sources are unchanged."""
    missing = _missing_prerequisites()
    if missing:
        pytest.fail(f"cannot build the C++ client (client/cpp): missing {', '.join(missing)}. "
                    f"Install them with:\n  {APT}", pytrace=False)
    build = Path(CACHE) / f"cpp-{_build_key()}"
    with locked(build.name):  # one build per key, whichever test process or session gets there first
        if not (build / ".built").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            t0 = time.monotonic()
            for cmd in (["cmake", "-S", str(CPP), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                         f"-DEXPERTD_PYTHON={sys.executable}", *generator],
                        ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)]):
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    pytest.fail(f"building client/cpp failed ({' '.join(cmd)}):\n{run.stdout[-4000:]}\n"
                                f"{run.stderr[-4000:]}\n(prerequisites: {APT})", pytrace=False)
            (build / ".built").write_text(f"{time.monotonic() - t0:.1f}\n")
            print(f"\nbuilt client/cpp in {time.monotonic() - t0:.1f}s ({build})")
    return build


def dump(build: Path, endpoint: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}  # only what the test passes
    return subprocess.run([str(build / "expertd-cpp-dump"), endpoint, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def dump_json(build: Path, endpoint: str, *args: str) -> dict:
    run = dump(build, endpoint, "--json", *args)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_golden_vectors_through_the_cpp_protocol_code(cpp_build):
    run = subprocess.run(["ctest", "--output-on-failure"], cwd=cpp_build, capture_output=True, text=True,
                         env={**os.environ, "EXPERTD_GOLDEN_DIR": str(GOLDEN)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "100% tests passed" in run.stdout


def test_cpp_client_sees_what_the_python_client_sees(cpp_build, start_daemon):
    d = start_daemon(TINY, auth_token=TOKEN)
    got = dump_json(cpp_build, d.endpoint, "--token", TOKEN, "--bench", "5")
    views = dump_json(cpp_build, d.endpoint, "--token", TOKEN, "--views")
    t0 = time.perf_counter()
    with ExpertClient(d.endpoint, token=TOKEN) as client:
        index = client.index()
        served = client.served_tensors()
        python_ms = (time.perf_counter() - t0) * 1000
        assert got["generation"] == index.generation == client.generation
        assert [t["name"] for t in got["tensors"]] == [e.name for e in index.tensors]  # every served tensor, in order
        for row, entry in zip(got["tensors"], index.tensors):
            t = served[entry.name]
            assert (row["dtype"], row["shape"], row["nbytes"]) == \
                (str(t.dtype), list(t.shape), t.numel() * t.element_size())
            assert (row["segment"], row["offset"]) == (entry.segment, entry.offset)
            assert row["recorded"] == entry.checksum
            assert row["checksum"] == entry.checksum == tensor_checksum(t, checksum_parts(entry.checksum)), entry.name
            assert row["xxh3_64"] == checksum(tensor_bytes(t))
        # per checkpoint name: the views Python derives (fused experts cut per expert) are the C++ client's too
        mine = client.tensors()
        assert sorted(t["name"] for t in views["tensors"]) == sorted(mine)
        entries = index.checkpoint_entries()
        for row in views["tensors"]:
            t, entry = mine[row["name"]], entries[row["name"]]
            assert (row["dtype"], row["shape"]) == (str(t.dtype), list(t.shape))
            assert (row["segment"], row["offset"], row["nbytes"]) == (entry.segment, entry.offset, entry.nbytes)
            assert row["xxh3_64"] == checksum(tensor_bytes(t)), row["name"]
        assert client.verify() == []
        # the tool released its leases while it still ran (not dropped later because its process went)
        assert lease_tag(got["lease"]) not in got["leases_after_release"]
        assert lease_tag(views["lease"]) not in views["leases_after_release"]
        # tensors outlive their lease: the mapping stays with them
        assert got["valid_after_release"] is True and views["valid_after_release"] is True
        assert got["bad"] == 0 and {t["verdict"] for t in got["tensors"]} == {"OK"}
        assert [held["client"] for held in d.status()["leases"]] == [lease_tag(client.lease)]
    assert d.status()["leases"] == []
    best = min(r["attach"] + r["tensors"] for r in got["bench_ms"])
    print(f"\nattach (lease + index + served tensors), tiny checkpoint: C++ best of 5 {best:.2f} ms; "
          f"Python first attach {python_ms:.2f} ms (client/cpp/bench_attach.py compares best of 5)")


def test_heartbeat_keeps_the_lease_past_its_timeout(cpp_build, start_daemon):
    d = start_daemon(TINY, lease_timeout_s=1.0)
    got = dump_json(cpp_build, d.endpoint, "--hold-s", "2.5")
    assert got["held"]["lease_alive"] is True, got["held"]
    assert got["held"]["heartbeat_error"] == ""
    assert d.status()["leases"] == []


def test_refresh_moves_to_a_pushed_generation(cpp_build, start_daemon):
    d = start_daemon(TINY, lease_timeout_s=1.5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    proc = subprocess.Popen([str(cpp_build / "expertd-cpp-dump"), d.endpoint, "--json", "--hold-s", "3", "--refresh"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not d.status()["leases"] and time.monotonic() < deadline:  # the tool has attached
            time.sleep(0.05)
        pushed = torch.full((320,), 1.5, dtype=torch.bfloat16)
        with ExpertClient(d.endpoint) as client:
            assert client.update({"model.norm.weight": pushed}) == 2
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    got = json.loads(out)
    assert got["held"]["lease_alive"] is True
    assert got["refresh"] == {"latest_seen": 2, "changed": ["model.norm.weight"], "old_views_unchanged": True}
    assert got["generation"] == 2
    row = next(t for t in got["tensors"] if t["name"] == "model.norm.weight")
    assert row["checksum"] == row["recorded"] == tensor_checksum(pushed)
    assert all(t["checksum"] == t["recorded"] for t in got["tensors"])
    assert got["leases_after_release"] == []


def test_wrong_token_is_a_typed_error(cpp_build, start_daemon):
    d = start_daemon(TINY, auth_token=TOKEN)
    run = dump(cpp_build, d.endpoint, "--token", "not-the-token-0123456789")
    assert run.returncode == EXIT["AuthError"], run.stderr
    assert run.stderr.startswith("expertd-cpp-dump: AuthError: daemon refused 'lease': request lacks"), run.stderr
    assert run.stderr.count("AuthError") == 1 and "as $EXPERTD_TOKEN or Options::token" in run.stderr, run.stderr
    run = dump(cpp_build, d.endpoint)  # no token at all
    assert run.returncode == EXIT["AuthError"], run.stderr
    assert d.status()["leases"] == []


def test_reload_and_stop_need_the_admin_permission(cpp_build, start_daemon):
    """A reader's stop and reload are PermissionDenied (typed: expertd::PermissionDenied) and change nothing; the
    admin_token (sent with those ops only) reloads and stops."""
    admin = "cpp-admin-token-0123456789"
    d = start_daemon(TINY, auth_token=TOKEN, push_token="cpp-push-token-0123456789", admin_token=admin)
    for op in ("--stop", "--stop-keep", "--reload"):
        run = dump(cpp_build, d.endpoint, "--token", TOKEN, op)
        assert run.returncode == EXIT["PermissionDenied"], run.stderr
        assert run.stderr.startswith(f"expertd-cpp-dump: PermissionDenied: daemon refused '{op[2:6]}"), run.stderr
        assert "needs the 'admin' permission" in run.stderr
    assert d.status()["generation"] == 1 and d.proc.poll() is None
    run = dump(cpp_build, d.endpoint, "--token", TOKEN, "--admin-token", admin, "--reload")
    assert run.returncode == 0 and json.loads(run.stdout)["kind"] == "reload", run.stderr
    assert dump(cpp_build, d.endpoint, "--token", TOKEN, "--admin-token", admin, "--stop").returncode == 0
    assert d.proc.wait(60) == 0


def test_no_daemon_fails_fast_and_typed(cpp_build, tmp_path):
    t0 = time.monotonic()
    run = dump(cpp_build, f"ipc://{tmp_path}/nobody.sock", "--timeout-ms", "30000")
    assert run.returncode == EXIT["DaemonNotRunning"], run.stderr
    assert "DaemonNotRunning: no expertd daemon is running at" in run.stderr
    assert time.monotonic() - t0 < 10  # at once, not after the 30 s timeout (the figure: client/cpp/bench_attach.py)
    # over tcp:// nothing tells a missing daemon from a silent one: the receive timeout does
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    run = dump(cpp_build, f"tcp://127.0.0.1:{port}", "--timeout-ms", "300")
    assert run.returncode == EXIT["DaemonTimeout"], run.stderr
    assert "DaemonTimeout: the daemon at" in run.stderr
    assert time.monotonic() - t0 < 5


def test_curve_over_tcp(cpp_build, start_daemon, tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    keys.mkdir()
    daemon_public, daemon_secret = zmq.auth.create_certificates(str(keys), "daemon")
    _, client_secret = zmq.auth.create_certificates(str(keys), "worker")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon(TINY, wait=False, endpoint=f"tcp://127.0.0.1:{port}", curve_secret_key=daemon_secret,
                     auth_token=TOKEN)
    deadline = time.monotonic() + 60
    while True:  # DaemonProcess.status() speaks without CURVE: ask with the keys
        run = dump(cpp_build, d.endpoint, "--token", TOKEN, "--server-key", daemon_public,
                   "--client-key", client_secret, "--json", "--timeout-ms", "1000")
        if run.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert len(got["tensors"]) == 47 and all(t["checksum"] == t["recorded"] for t in got["tensors"])
    assert got["leases_after_release"] == []
    # an ephemeral client key (no --client-key) connects too; without the server key the token is not sent in clear
    # (ConfigError, exit 2), and a client allowed to send it gets no answer from a CURVE daemon
    assert dump(cpp_build, d.endpoint, "--token", TOKEN, "--server-key", daemon_public).returncode == 0
    run = dump(cpp_build, d.endpoint, "--token", TOKEN, "--timeout-ms", "500")
    assert run.returncode == 2 and "not sending the auth_token" in run.stderr, run.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    run = subprocess.run([str(cpp_build / "expertd-cpp-dump"), d.endpoint, "--token", TOKEN, "--timeout-ms", "500"],
                         capture_output=True, text=True, timeout=60, env={**env, "EXPERTD_ALLOW_PLAIN_TCP_TOKENS": "1"})
    assert run.returncode == EXIT["DaemonTimeout"], run.stderr


def test_kill_9_of_the_cpp_process_gets_its_lease_reaped(cpp_build, start_daemon):
    # a lease timeout far longer than the test: only the daemon noticing the process is gone can drop the lease
    d = start_daemon(TINY, lease_timeout_s=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    proc = subprocess.Popen([str(cpp_build / "expertd-cpp-dump"), d.endpoint, "--hold-s", "600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        leases = wait_until(lambda: d.status()["leases"], "the C++ process's lease shows in status")
        assert len(leases) == 1, proc.stderr.read() if proc.poll() is not None else leases
        # the lease shows in status while held, for this process, watched (same pid namespace as the daemon)
        assert (leases[0]["pid"], leases[0]["watched"], leases[0]["generation"]) == (proc.pid, True, 1)
        proc.kill()  # SIGKILL: no release, no more heartbeats
        proc.wait()
        t0 = time.monotonic()
        wait_until(lambda: d.status()["leases"] == [], "the killed C++ process's lease is dropped", 30)
        print(f"\nlease of the killed C++ process dropped {time.monotonic() - t0:.2f} s after it died "
              "(lease timeout 600 s)")
    finally:
        proc.kill()
        proc.wait()


def test_a_corrupted_tensor_is_bad_and_the_exit_status_says_so(cpp_build, start_daemon):
    d = start_daemon(TINY)
    with ExpertClient(d.endpoint) as client:
        entry = next(e for e in client.index().tensors if e.name == "model.norm.weight")
        shm_dir = client.index().shm_dir
    # root may write what workers map read-only
    with open(os.path.join(shm_dir, entry.segment.lstrip("/")), "r+b") as f:
        f.seek(entry.offset)
        first = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([first[0] ^ 0xFF]))
    run = dump(cpp_build, d.endpoint)
    assert run.returncode == EXIT["BAD"], run.stdout + run.stderr
    lines = {line.split("\t")[0]: line.split("\t") for line in run.stdout.splitlines() if "\t" in line}
    assert lines["model.norm.weight"][-1] == "BAD"
    assert all(fields[-1] == "OK" for name, fields in lines.items() if name != "model.norm.weight")
    assert "1 tensor(s) BAD" in run.stdout
    assert lines["model.norm.weight"][1:3] == ["torch.bfloat16", "[320]"]


def test_a_socket_file_nobody_listens_on_is_no_daemon(cpp_build, tmp_path):
    path = str(tmp_path / "killed.sock")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)  # what a daemon killed with -9 leaves behind
    left.close()
    run = dump(cpp_build, f"ipc://{path}", "--timeout-ms", "30000")
    assert run.returncode == EXIT["DaemonNotRunning"], run.stderr
    assert "nothing listens on its socket file" in run.stderr and "expertd start --config" in run.stderr


def test_a_loading_daemon_is_not_ready(cpp_build, tmp_path):
    """While the first generation loads a lease reply names no index segment and `index` answers NotReady. The
    daemon's side of this is tests/test_daemon.py's loading test; here a socket answers as such a daemon does."""
    import threading

    import zmq

    from expertd.protocol import pack, unpack

    endpoint = f"ipc://{tmp_path}/loading.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    seen, done = [], threading.Event()

    def answer():
        leases = 0
        while not done.is_set():
            if not router.poll(50):
                continue
            identity, empty, frame = router.recv_multipart()
            msg = unpack(frame)
            seen.append(msg["op"])
            if msg["op"] == "lease":
                leases += 1
                reply = {"ok": True, "client": f"c{leases}", "lease_timeout_s": 30.0, "generation": None}
            elif msg["op"] == "index":
                reply = {"ok": False, "error": "NotReady", "message": "the daemon is still loading"}
            else:
                reply = {"ok": True}
            router.send_multipart([identity, empty, pack({**reply, "latest": 0})])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        run = dump(cpp_build, endpoint, "--no-wait")
        assert run.returncode == 6, run.stderr
        assert run.stderr.startswith("expertd-cpp-dump: NotReady: daemon at ") and "still loading" in run.stderr
        assert seen[:2] == ["lease", "release"]  # the lease it took is given back
        seen.clear()
        run = dump(cpp_build, endpoint, "--timeout-ms", "400")  # waits for the first generation, up to the timeout
        assert run.returncode == EXIT["DaemonTimeout"], run.stderr
        assert "still loading after" in run.stderr
        assert seen[0] == "lease" and seen.count("index") >= 2 and seen[-1] == "release"
    finally:
        done.set()
        thread.join()
        router.close(linger=0)
        ctx.term()


def test_a_bad_endpoint_is_the_python_clients_config_error(cpp_build):
    """A socket path without ipc://, tcp:// without a port, an unknown scheme: the C++ client throws ConfigError with
    the words expertd.protocol.check_endpoint uses, before libzmq could answer "Invalid argument"."""
    from tests.test_client_endpoints import BAD_ENDPOINTS

    for endpoint, words in BAD_ENDPOINTS:
        run = dump(cpp_build, endpoint, "--timeout-ms", "2000")
        with pytest.raises(ConfigError) as python:
            check_endpoint(endpoint)
        assert run.returncode == 2, (endpoint, run.stderr)
        assert run.stderr.strip().splitlines() == [f"expertd-cpp-dump: ConfigError: {python.value}"], run.stderr
        assert words in run.stderr and "Invalid argument" not in run.stderr


def test_a_build_without_torch_on_path_says_how_to_point_at_it(tmp_path):
    """CMake run where the python it finds has no torch stops with a line naming the fix (activate the venv, or
    -DEXPERTD_PYTHON / -DTorch_DIR), not CMake's generic "Could not find a package configuration file"."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed (package cmake)")
    done = subprocess.run(["cmake", "-S", str(CPP), "-B", str(tmp_path / "build"), "-DEXPERTD_PYTHON=/bin/false",
                           "-DEXPERTD_BUILD_TESTS=OFF"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    said = " ".join(done.stderr.split())
    assert "libtorch not found" in said and "-DEXPERTD_PYTHON=" in said and "activate" in said.lower(), said
