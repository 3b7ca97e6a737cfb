"""Every user mistake on the command line is one plain line on stderr with the fix, exit code 2, never a traceback."""

import os
import subprocess
import time

import pytest
import yaml

from tests.helpers.daemon import expertd_cmd, write_config

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)


def config(folder, **keys) -> str:
    """folder/cfg.yaml with `keys` (a socket in folder/run unless `endpoint` is given)."""
    keys.setdefault("endpoint", f"ipc://{folder}/run/expertd.sock")
    path = os.path.join(str(folder), "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(keys, f)
    return path


# (id, how to build argv from (tmp_path, checkpoint), words the one error line must contain)
MISTAKES = [
    ("no-command", lambda d, c: [], ["required: COMMAND"]),
    ("unknown-command", lambda d, c: ["serve"], ["invalid choice: 'serve'", "--help"]),
    ("start-without-config", lambda d, c: ["start"], ["--config"]),
    ("missing-config-file", lambda d, c: ["start", "--config", f"{d}/nope.yaml"],
     ["cannot read config", "nope.yaml", "No such file or directory", "configs/tiny.yaml is an example"]),
    ("config-not-yaml", lambda d, c: ["start", "--config", _write(d, "bad.yaml", "checkpoint: [unclosed")],
     ["not valid YAML"]),
    ("config-not-a-mapping", lambda d, c: ["start", "--config", _write(d, "list.yaml", "- a\n- b\n")],
     ["must be a mapping"]),
    ("config-without-checkpoint", lambda d, c: ["start", "--config", config(d, namespace="x")],
     ["'checkpoint'", "required"]),
    ("unknown-key", lambda d, c: ["start", "--config", config(d, checkpoint=c, segment_bytes="4GiB")],
     ["unknown key(s) segment_bytes", "Config keys"]),
    ("misspelt-key", lambda d, c: ["start", "--config", config(d, checkpoint=c, namspace="x")],
     ["unknown key(s) namspace (did you mean `namespace`?)"]),
    ("endpoint-path-in-config", lambda d, c: ["start", "--config", config(d, checkpoint=c, endpoint=f"{d}/x.sock")],
     ["looks like a socket path", "ipc://"]),
    ("endpoint-path-on-cli", lambda d, c: ["status", "--endpoint", "/run/expertd/expertd.sock"],
     ["looks like a socket path", "write it as ipc:///run/expertd/expertd.sock"]),
    ("endpoint-without-transport", lambda d, c: ["status", "--endpoint", "127.0.0.1:5555"],
     ["tcp://127.0.0.1:5555"]),
    ("endpoint-one-slash", lambda d, c: ["status", "--endpoint", "ipc:/run/expertd/expertd.sock"],
     ["has too few slashes; write it as ipc:///run/expertd/expertd.sock"]),
    ("endpoint-relative-ipc", lambda d, c: ["status", "--endpoint", "ipc://tmp/x.sock"],
     ["names the relative path tmp/x.sock", "an absolute path takes three slashes: ipc:///tmp/x.sock"]),
    ("unknown-flag-of-a-command", lambda d, c: ["start", "--config", config(d, checkpoint=c), "--bogus"],
     ["expertd start: error: unrecognized arguments: --bogus", "expertd start --help"]),
    ("checkpoint-without-config-json", lambda d, c: ["start", "--config", config(d, checkpoint=_folder(d, "empty"))],
     ["NotACheckpointError", "has no config.json", "point `checkpoint:`"]),
    ("bad-namespace", lambda d, c: ["start", "--config", config(d, checkpoint=c, namespace="a/b")],
     ["namespace", "[A-Za-z0-9_.-]"]),
    ("bad-duration", lambda d, c: ["start", "--config", config(d, checkpoint=c, lease_timeout_s="soon")],
     ["lease_timeout_s", "30s"]),
    ("bad-timeout-flag", lambda d, c: ["status", "--timeout", "abc"], ["--timeout", "duration 'abc'"]),
    ("bad-size", lambda d, c: ["convert", c, f"{d}/out", "--max-shard-size", "5XB"], ["size '5XB'", "5GB"]),
    ("bad-device", lambda d, c: ["start", "--config", config(d, checkpoint=c, device="gpu")],
     ["device must be auto, cpu, cuda or cuda:N"]),
    ("cuda-device-not-here", lambda d, c: ["start", "--config", config(d, checkpoint=c, device="cuda:99")],
     ["device 'cuda:99'", "cpu"]),
    ("bad-metrics-port", lambda d, c: ["start", "--config", config(d, checkpoint=c, metrics_port="http")],
     ["metrics_port", "1-65535"]),
    ("unknown-preset", lambda d, c: ["generate", f"{d}/ckpt", "--preset", "huge"], ["unknown preset 'huge'", "tiny"]),
    ("zero-shards", lambda d, c: ["generate", f"{d}/ckpt", "--shards", "0"], ["positive integer"]),
    ("missing-checkpoint", lambda d, c: ["start", "--config", config(d, checkpoint=f"{d}/no-such-model")],
     ["checkpoint folder does not exist", "no-such-model", "checkpoint:"]),
    ("checkpoint-is-a-file", lambda d, c: ["start", "--config", config(d, checkpoint=_write(d, "f.txt", "x"))],
     ["not a folder"]),
    ("no-daemon-status", lambda d, c: ["status", "--endpoint", f"ipc://{d}/nobody.sock"],
     ["DaemonNotRunning", "nobody.sock does not exist", "expertd start --config"]),
    ("no-daemon-status-wait", lambda d, c: ["status", "--endpoint", f"ipc://{d}/nobody.sock", "--wait", "0.3"],
     ["DaemonNotRunning", "expertd start --config"]),
    ("no-daemon-verify", lambda d, c: ["verify", "--endpoint", f"ipc://{d}/nobody.sock"], ["DaemonNotRunning"]),
    ("no-daemon-stop", lambda d, c: ["stop", "--config", config(d, checkpoint=c)], ["DaemonNotRunning"]),
    ("tcp-beyond-host-without-curve", lambda d, c: ["start", "--config", config(d, checkpoint=c, endpoint="tcp://0.0.0.0:5999")],
     ["without encryption; set curve_secret_key", "insecure_tcp: true"]),
    ("tcp-beyond-host-in-clear-without-token",
     lambda d, c: ["start", "--config", config(d, checkpoint=c, endpoint="tcp://0.0.0.0:5999", insecure_tcp=True)],
     ["set auth_token"]),
    ("ep-size-not-a-number",
     lambda d, c: ["start", "--config", config(d, checkpoint=c, expert_parallel={"size": "four"})],
     ["expert_parallel.size must be an integer >= 1"]),
]


def _folder(folder, name: str) -> str:
    path = os.path.join(str(folder), name)
    os.makedirs(path, exist_ok=True)
    return path


def _write(folder, name: str, text: str) -> str:
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(text)
    return path


def run_cli(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(expertd_cmd(*argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "EXPERTD_ENDPOINT": "", "EXPERTD_TOKEN": ""})


def assert_one_line(out: subprocess.CompletedProcess, words: list[str]) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


@pytest.mark.parametrize("argv, words", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistake_is_one_line_exit_2(argv, words, tmp_path, tiny_checkpoint, namespace):
    started = time.monotonic()
    out = run_cli(argv(tmp_path, tiny_checkpoint))
    assert_one_line(out, words)
    assert not os.path.exists(tmp_path / "run")  # a failed start leaves no run folder behind
    if "DaemonNotRunning" in words and "--wait" not in argv(tmp_path, tiny_checkpoint):
        assert time.monotonic() - started < 30  # no timeout waited for (the CLI's own start-up dominates)


def test_daemon_already_running_on_the_endpoint_or_namespace(start_daemon, tiny_checkpoint, namespace, tmp_path):
    first = start_daemon(tiny_checkpoint)
    other = tmp_path / "other"
    other.mkdir()
    # another namespace on the same (default-like) endpoint: say which key to set
    same_endpoint = config(other, checkpoint=tiny_checkpoint, endpoint=first.endpoint, namespace=namespace + "-b")
    line = assert_one_line(run_cli(["start", "--config", same_endpoint]),
                           ["EndpointBusy", first.endpoint, "set `endpoint:`"])
    assert "Traceback" not in line
    # the same namespace on another endpoint: the namespace is taken
    same_namespace = write_config(other, tiny_checkpoint, namespace)
    assert_one_line(run_cli(["start", "--config", same_namespace]), ["NamespaceBusy", namespace])
    assert first.status()["state"] == "serving"  # the first daemon is untouched


def test_help_lists_every_command_and_every_default():
    out = subprocess.run(expertd_cmd("--help"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for command in ("start", "status", "stop", "verify", "reload", "generate", "convert", "inspect", "doctor"):
        assert f"\n    {command} " in out.stdout, command
    status = subprocess.run(expertd_cmd("status", "--help"), capture_output=True, text=True, timeout=60).stdout
    assert "(default: 5.0)" in status and "--wait SECONDS" in status and "3 when it is" in status
    version = subprocess.run(expertd_cmd("--version"), capture_output=True, text=True, timeout=60)
    from expertd import __version__

    assert version.returncode == 0 and version.stdout.strip() == f"expertd {__version__}"


def test_status_wait_stop_and_a_clean_run_folder(start_daemon, tiny_checkpoint, tmp_path, namespace):
    daemon = start_daemon(tiny_checkpoint, wait=False)
    out = run_cli(["status", "--endpoint", daemon.endpoint, "--wait", "120"])
    assert out.returncode == 0 and "serving" in out.stdout, out.stderr
    run_dir = tmp_path / "run"
    assert os.path.exists(run_dir / f"{namespace}.manifest.json")
    out = run_cli(["stop", "--endpoint", daemon.endpoint])
    assert out.returncode == 0, out.stderr
    assert f"stopped expertd pid {daemon.proc.pid}" in out.stdout
    assert namespace in out.stdout and daemon.endpoint in out.stdout
    assert daemon.proc.wait(60) == 0
    assert not os.path.exists(run_dir)  # segments, index, socket, manifest: all gone, and the folder it made
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(namespace + ".")]


def test_status_wait_while_loading_exits_3(tmp_path, capsys):
    """A daemon that answers but still loads at the deadline: exit 3, said on stderr (a stand-in REP socket)."""
    import threading

    import zmq

    from expertd.protocol import pack, unpack
    from expertd.server.cli.commands import EXIT_LOADING, main

    endpoint = f"ipc://{tmp_path}/loading.sock"
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(endpoint)
    done = threading.Event()

    def answer():
        while not done.is_set():
            if rep.poll(50):
                assert unpack(rep.recv())["op"] == "status"
                rep.send(pack({"ok": True, "state": "loading", "pid": 4242, "endpoint": endpoint, "generation": 1}))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert main(["status", "--endpoint", endpoint, "--wait", "0.5"]) == EXIT_LOADING == 3
    finally:
        done.set()
        thread.join()
        rep.close(linger=0)
        ctx.term()
    err = capsys.readouterr().err
    assert "still loading generation 1" in err and "pid 4242" in err
