"""The words a new user meets (issue 36 item 7): each refusal names its class once and says the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from expertd import errors
from expertd.protocol import pack, unpack_reply
from tests.helpers.daemon import expertd_cmd

pytestmark = pytest.mark.quick  # the quick subset: `pytest -m quick` (README)

REPO = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}


def _refused(kind: str, message: str):
    with pytest.raises(errors.DaemonError) as caught:
        unpack_reply(pack({"ok": False, "error": kind, "message": message}), "'lease'")
    return caught.value


def test_a_wrong_token_is_one_sentence_with_its_fix():
    exc = _refused("AuthError", "request lacks the daemon's auth token or carries a wrong one")
    assert isinstance(exc, errors.AuthError) and exc.kind == "AuthError"
    assert str(exc) == ("daemon refused 'lease': request lacks the daemon's auth token or carries a wrong one; give "
                        "the daemon's auth_token (its config key) as $EXPERTD_TOKEN, ExpertClient(token=...) or the "
                        "CLI's --token")


def test_a_typed_refusal_does_not_restate_its_class_and_an_untyped_one_names_its_kind():
    busy = _refused("Busy", "another reload is being built")
    assert type(busy) is errors.Busy and str(busy) == "daemon refused 'lease': another reload is being built"
    other = _refused("ShmError", "cannot map")
    assert type(other) is errors.DaemonError and str(other) == "daemon refused 'lease': ShmError: cannot map"


def test_the_cli_prints_a_wrong_tokens_class_once(start_daemon, tiny_checkpoint):
    daemon = start_daemon(tiny_checkpoint, auth_token="user-words-token-0123456789")
    out = subprocess.run(expertd_cmd("status", "--endpoint", daemon.endpoint, "--token", "not-the-token-0123456789"),
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "expertd status: error: AuthError: daemon refused 'status': request lacks the daemon's auth token or carries a "
        "wrong one; give the daemon's auth_token (its config key) as $EXPERTD_TOKEN, ExpertClient(token=...) or the "
        "CLI's --token")


@pytest.mark.parametrize("argv, blamed", [
    (["start", "--config", "x.yaml", "--bogus"], "expertd start: error: unrecognized arguments: --bogus "
                                                  "(see `expertd start --help`)"),
    (["status", "--bogus", "1"], "expertd status: error: unrecognized arguments: --bogus 1 "
                                 "(see `expertd status --help`)"),
    (["--bogus", "status"], "expertd: error: unrecognized arguments: --bogus (see `expertd --help`)"),
])
def test_an_unknown_flag_blames_the_command_it_was_given_to(argv, blamed, capsys):
    from expertd.server.cli.commands import build_parser

    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(argv)
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip() == blamed


def test_no_cli_function_is_longer_than_80_lines():
    import ast

    tree = ast.parse((REPO / "server" / "cli" / "commands.py").read_text())
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            and f.end_lineno - f.lineno + 1 > 80}
    assert not long, long


@pytest.mark.parametrize("remove, said", [
    ("config.json", "has no config.json; a HuggingFace checkpoint folder holds config.json"),
    ("model.safetensors.index.json", "has neither model.safetensors.index.json nor model.safetensors"),
])
def test_a_folder_that_is_no_checkpoint_says_what_it_lacks(tiny_checkpoint, tmp_path, remove, said):
    import shutil

    from expertd.server.load.checkpoint import Checkpoint

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, folder)
    os.unlink(folder / remove)
    with pytest.raises(errors.NotACheckpointError) as caught:
        Checkpoint.open(str(folder))
    assert str(caught.value).startswith(f"checkpoint folder {folder} {said}")
    assert "point `checkpoint:` (or --checkpoint) at the folder" in str(caught.value)
    assert isinstance(caught.value, errors.CheckpointError) and isinstance(caught.value, FileNotFoundError)


@pytest.mark.parametrize("nbytes, size", [(int(9.6 * 2**20), "11m"), (2**30, "1127m"), (70 * 2**30, "77g"), (1, "1m")])
def test_the_suggested_shm_size_follows_from_the_models_bytes(nbytes, size):
    from expertd.server.shm.arena import more_space_hint

    assert f"--shm-size={size}," in more_space_hint("/dev/shm", nbytes)
    assert f"larger size= (at least {size})" in more_space_hint("/mnt/expertd-huge", nbytes)


def test_the_example_worker_refuses_with_daemon_when_one_already_answers(tmp_path):
    """--with-daemon while a daemon answers on the config's endpoint: one line at once, before any work (a stand-in
    daemon that refuses every request: it answers, so the endpoint is taken)."""
    import zmq

    endpoint = f"ipc://{tmp_path}/taken.sock"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"checkpoint: {REPO / 'checkpoints' / 'tiny'}\nendpoint: {endpoint}\nnamespace: uwtaken\n")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    done, seen = threading.Event(), []

    def answer():
        while not done.is_set():
            if router.poll(50):
                identity, empty, frame = router.recv_multipart()[:3]
                seen.append(frame)
                router.send_multipart([identity, empty, pack({"ok": False, "error": "AuthError", "message": "no"})])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        run = subprocess.run([sys.executable, str(REPO / "examples" / "worker.py"), "--with-daemon", str(cfg)],
                             capture_output=True, text=True, timeout=300, env=ENV)
    finally:
        done.set()
        thread.join()
        router.close(linger=0)
        ctx.term()
    assert run.returncode == 2 and run.stdout == "", (run.stdout, run.stderr)
    assert run.stderr.strip() == (f"worker: error: EndpointBusy: a daemon already answers at {endpoint}: drop "
                                  f"--with-daemon to use it, or stop it first (expertd stop --endpoint {endpoint})")
    assert len(seen) == 1  # the one probe; no daemon was started, no model loaded


def test_the_vllm_example_runs_its_own_daemon_on_a_private_endpoint_unless_told():
    """examples/vllm_engine.py never takes whatever daemon answers on the default endpoint (a newcomer's other
    daemon serves another model): without --endpoint its daemon listens beside the checkpoint."""
    import importlib.util

    from expertd.protocol import default_endpoint, ipc_path

    spec = importlib.util.spec_from_file_location("vllm_example", REPO / "examples" / "vllm_engine.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # vLLM itself is imported only when it generates
    assert example.private_endpoint("/srv/vllm-example/qwen3-moe") == "ipc:///srv/vllm-example/expertd.sock"
    deep = "/" + "d" * 120 + "/qwen3-moe"  # a socket path fits 107 bytes: then under the runtime base
    assert example.private_endpoint(deep) == (
        f"ipc://{os.path.dirname(ipc_path(default_endpoint()))}/vllm-example/expertd.sock")
    assert example.private_endpoint(deep) != default_endpoint()
