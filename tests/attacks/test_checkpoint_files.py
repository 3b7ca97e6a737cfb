"""Checkpoint files that are not regular files: refused at once, by name, never read.

A FIFO named config.json blocked the reader's open() forever (it wedged a reload's build slot); a shard that
is /dev/zero never ends. The reader opens every file O_NONBLOCK and reads only what fstat calls a regular
file, so each of these is one line naming the file and what it is, and the daemon, `inspect` and `convert`
stop at once. Symlinks are followed on purpose (HuggingFace caches link shards into blobs/): only their
target's kind matters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from expertd.errors import NotRegularFileError
from expertd.server.load.checkpoint import Checkpoint
from helpers.checkpoints import INDEX
from helpers.daemon import expertd_cmd, refused_start

pytestmark = pytest.mark.timeout(300)  # a blocked open would otherwise hang the run: it is a failure here


def copy_with(tiny_checkpoint: str, folder, name: str, make) -> tuple[str, str]:
    """A copy of the tiny checkpoint in folder/ckpt whose file `name` (config.json, or "shard": its first shard)
    is replaced by what `make(path)` creates there: (the copy, that file's path)."""
    ckpt = str(folder / "ckpt")
    shutil.copytree(tiny_checkpoint, ckpt)
    if name == "shard":
        with open(os.path.join(ckpt, INDEX)) as f:
            name = sorted(set(json.load(f)["weight_map"].values()))[0]
    path = os.path.join(ckpt, name)
    os.unlink(path)
    make(path)
    return ckpt, path


CASES = {
    "config-fifo": ("config.json", os.mkfifo, "config.json is a FIFO (named pipe), not a regular file"),
    "shard-fifo": ("shard", os.mkfifo, "shard is a FIFO (named pipe), not a regular file"),
    "shard-dev-zero": ("shard", lambda p: os.symlink("/dev/zero", p),
                       "shard is a symlink to /dev/zero, which is a character device, not a regular file"),
    "shard-directory": ("shard", os.mkdir, "shard is a directory, not a regular file"),
}


@pytest.mark.parametrize("case", CASES)
def test_start_refuses_a_checkpoint_file_that_is_not_regular(tiny_checkpoint, tmp_path, namespace, case):
    """`expertd start` exits 2 with one line naming the file and its kind (a subprocess timeout turns a blocked
    open into a failure); nothing is left in /dev/shm."""
    name, make, says = CASES[case]
    ckpt, path = copy_with(tiny_checkpoint, tmp_path, name, make)
    refused_start(tmp_path / "run", ckpt, namespace, "NotRegularFileError", says, f"(file {path})")


def test_reload_of_a_fifo_config_is_refused_and_the_next_reload_runs(tiny_checkpoint, tmp_path, start_daemon):
    """The finding: a reload whose config.json is a FIFO held the build slot forever. Now it is refused in one
    line, the generation served stays, and the next reload is built."""
    daemon = start_daemon(tiny_checkpoint)
    bad, fifo = copy_with(tiny_checkpoint, tmp_path / "bad", "config.json", os.mkfifo)

    def reload(checkpoint: str) -> subprocess.CompletedProcess:
        return subprocess.run(expertd_cmd("reload", "--config", daemon.config, "--checkpoint", checkpoint),
                              capture_output=True, text=True, timeout=120)

    refused = reload(bad)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json is a FIFO" in lines[0] and f"(file {fifo})" in lines[0]
    assert daemon.status()["generation"] == 1
    again = reload(tiny_checkpoint)  # the build slot is free: this one runs (and finds nothing changed)
    assert again.returncode == 0, again.stderr
    assert daemon.status()["state"] == "serving"


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_offline_tools_refuse_a_fifo_config(tiny_checkpoint, tmp_path, command):
    """`expertd inspect` and `convert` read through the same reader: the same one-line refusal, no hang."""
    ckpt, fifo = copy_with(tiny_checkpoint, tmp_path, "config.json", os.mkfifo)
    out = str(tmp_path / "out")
    args = [ckpt, "--out", out, "--no-plots"] if command == "inspect" else [ckpt, out, "--no-progress"]
    done = subprocess.run(expertd_cmd(command, *args), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "NotRegularFileError" in lines[0] and f"(file {fifo})" in lines[0]


def test_symlinked_shards_are_followed_to_regular_files(tiny_checkpoint, tmp_path):
    """A HuggingFace cache's layout: snapshots/REV/*.safetensors are symlinks into ../../blobs/. Their targets are
    regular files, so the checkpoint reads as the original does; only a target of another kind is refused."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    os.makedirs(blobs)
    os.makedirs(snapshot)
    for i, name in enumerate(sorted(os.listdir(tiny_checkpoint))):
        shutil.copy(os.path.join(tiny_checkpoint, name), blobs / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snapshot / name)
    linked, original = Checkpoint.open(str(snapshot)), Checkpoint.open(tiny_checkpoint)
    try:
        assert linked.config == original.config and linked.tensors.keys() == original.tensors.keys()
        for name in list(original.tensors)[:5]:
            info = linked.tensors[name]
            assert info.file.startswith(str(snapshot))  # errors name the checkpoint's file, not the blob
            assert linked.read(name).equal(original.read(name)) and linked.view(info).equal(original.read(name))
    finally:
        linked.close()
        original.close()
    shard = next(n for n in os.listdir(snapshot) if n.endswith(".safetensors"))
    os.unlink(snapshot / shard)
    os.symlink("/dev/null", snapshot / shard)
    with pytest.raises(NotRegularFileError,
                       match=f"shard is a symlink to /dev/null, which is a character device.*{shard}"):
        Checkpoint.open(str(snapshot))
