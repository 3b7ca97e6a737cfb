"""`shm_dir:`: segments in another tmpfs folder, one mounted with huge pages, with real processes.

The huge-page tmpfs exists only in a private mount namespace (`unshare -m`), so the whole scenario
(daemons, workers, `expertd verify`) runs inside it: see helpers/shm_dir_scenario.py.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from expertd.errors import ConfigError
from expertd.server.daemon.config import config_from_dict
from expertd.server.shm.shmdir import HUGETLBFS, inspect, mount_of
from helpers.daemon import expertd_cmd, write_config

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "shm_dir_scenario.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def needs_root_and_unshare():
    if os.geteuid() != 0:
        pytest.skip("mounting a huge-page tmpfs needs root (CI runs as root)")
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare for a private mount namespace")


def worktree_files() -> set[str] | None:
    """Untracked files of the checkout (None outside a git checkout)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                         text=True)
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


# --- config --------------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda tmp: str(tmp / "missing"), r"missing does not exist; mount a tmpfs for it \(as root: mkdir -p "
                                       r"\S+/missing && mount -t tmpfs -o size=SIZE,huge=always expertd \S+/missing, "
                                       r"SIZE the bytes"),
    (lambda tmp: (tmp / "file").write_text("x") and str(tmp / "file"), r"file is not a directory"),
    (lambda tmp: str(tmp), r"is on \w+ \(mounted at .*\), not tmpfs or hugetlbfs"),
    (lambda tmp: ((tmp / "full").mkdir(), (tmp / "full" / "kept").write_text("x"), str(tmp / "full"))[-1],
     r"mount -t tmpfs -o size=SIZE,huge=always expertd /mnt/expertd, .*then shm_dir: /mnt/expertd \(\S+/full holds "
     r"files a mount would hide\)"),
    (lambda tmp: 7, r"shm_dir must be a folder path"),
])
def test_bad_shm_dir_is_a_config_error_naming_the_path(tmp_path, make, match):
    if mount_of(str(tmp_path))[1] == "tmpfs":
        pytest.skip(f"{tmp_path} is itself on tmpfs")
    shm_dir = make(tmp_path)
    with pytest.raises(ConfigError, match=match) as info:
        config_from_dict({"checkpoint": "/ckpt", "shm_dir": shm_dir}, source="expertd.yaml")
    assert "shm_dir" in str(info.value) and (not isinstance(shm_dir, str) or shm_dir in str(info.value))


def test_shm_dir_default_and_explicit_dev_shm():
    assert config_from_dict({"checkpoint": "/ckpt"}).shm_dir == "/dev/shm"
    assert config_from_dict({"checkpoint": "/ckpt", "shm_dir": "/dev/shm"}).shm_dir == "/dev/shm"
    shm = inspect("/dev/shm")
    assert shm.fstype in ("tmpfs", HUGETLBFS) and shm.unit >= 4096


def test_start_with_a_bad_shm_dir_exits_2_and_creates_nothing(tmp_path, tiny_checkpoint, namespace):
    cfg = write_config(tmp_path, tiny_checkpoint, namespace, shm_dir=str(tmp_path / "nowhere"))
    out = subprocess.run(expertd_cmd("start", "--config", cfg), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "ConfigError" in out.stderr and f"{tmp_path}/nowhere does not exist" in out.stderr
    assert "Traceback" not in out.stderr
    assert not glob.glob(f"/dev/shm/{namespace}*") and not os.path.exists(tmp_path / "run")


# --- huge pages (tmpfs, hugetlbfs), end to end--------------------------------------------------------

def free_huge_pages() -> int:
    """Free 2 MiB pages in the hugetlb pool (what a hugetlbfs mount can take)."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    if info.get("Hugepagesize", "").split()[:1] != ["2048"]:
        return 0
    return int(info["HugePages_Free"].split()[0]) - int(info["HugePages_Rsvd"].split()[0])


NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def huge_page_pool(need: int):
    """At least `need` free 2 MiB pages in the hugetlb pool for the test: as root, the pool grows by what is
    missing and shrinks back to its size before afterwards (CI runs as root); otherwise the test skips."""
    short = need - free_huge_pages()
    if short <= 0:
        yield
        return
    if os.geteuid() != 0 or not os.access(NR_HUGEPAGES, os.W_OK):
        pytest.skip(f"hugetlbfs needs ~{need} free 2 MiB huge pages, the pool has {free_huge_pages()} "
                    f"(reserve them with: echo {need + 8} > {NR_HUGEPAGES})")
    with open(NR_HUGEPAGES) as f:
        before = int(f.read())
    try:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before + short))
        if free_huge_pages() < need:  # the kernel found too little contiguous memory
            pytest.skip(f"the kernel gave only {free_huge_pages()} free huge pages of the {need} asked for")
        yield
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))


MOUNTS = {  # (options of the served folder, of the one too small for the model)
    "tmpfs": ("-t tmpfs -o size=256m,huge=always", "-t tmpfs -o size=16m,huge=always"),
    "hugetlbfs": ("-t hugetlbfs -o pagesize=2M,size=256m", "-t hugetlbfs -o pagesize=2M,size=16m"),
}


@pytest.mark.parametrize("kind", ["tmpfs", "hugetlbfs"])
def test_daemon_serves_from_huge_pages(tmp_path, tiny_checkpoint, namespace, kind):
    needs_root_and_unshare()
    with huge_page_pool(128) if kind == "hugetlbfs" else contextlib.nullcontext():
        served_from_huge_pages(tmp_path, tiny_checkpoint, namespace, kind)


def served_from_huge_pages(tmp_path, tiny_checkpoint, namespace, kind):
    before = worktree_files()
    huge, small = tmp_path / "hugeshm", tmp_path / "smallshm"
    huge.mkdir()
    small.mkdir()
    served, too_small = MOUNTS[kind]
    script = (
        f"mount {served} expertd-huge {huge} || exit 97; "
        f"mount {too_small} expertd-small {small} || exit 98; "
        f"exec {sys.executable} {SCENARIO} {tiny_checkpoint} {tmp_path} {namespace} {huge} {small}"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    if out.returncode in (97, 98):
        pytest.skip(f"this kernel cannot mount {served}: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    huge, small = str(huge), str(small)

    # the daemon serves from the huge-page folder: segments 0600, whole 2 MiB huge pages, none in /dev/shm
    assert seen["status"]["shm_dir"] == huge and seen["status"]["state"] == "serving"
    files = seen["files"]
    # NS.PID.TAG.K.RANDOM: the index segment's TAG is i<generation>
    tensor_files = {name: f for name, f in files.items() if not name.split(".")[2].startswith("i")}
    assert len(tensor_files) == len(seen["status"]["segments"]) > 0
    assert len(files) == len(tensor_files) + 1  # the generation's index segment lives there too
    assert {f["mode"] for f in files.values()} == {"0o600"}
    assert all(f["size"] % (2 * MiB) == 0 for f in files.values())
    assert seen["dev_shm_while_serving"] == []

    # the worker's parameters lie in read-only mappings of those files, mapped with huge pages
    worker = seen["worker"]
    assert worker["ready"] and worker["outside"] == [] and worker["exit"] == 0
    assert worker["shm_dir"] == huge and worker["writable_maps"] == 0
    pages = worker["pages"]
    assert pages["files"] == sorted(os.path.join(huge, name) for name in tensor_files)
    assert pages["perms"] == ["r--s"] and pages["modes"] == ["0o600"]
    huge_kb = sum(pages["huge_kb"].values())  # PMD-mapped tmpfs, or hugetlbfs pages
    assert huge_kb > 0, pages
    assert huge_kb == pages["size_kb"], "every touched page of a 2 MiB-sized segment is a huge page"

    # the same logits as from /dev/shm
    plain = torch.load(os.path.join(tmp_path, "plain", "out", "logits.pt"))
    assert seen["plain_worker"]["shm_dir"] == "/dev/shm" and seen["plain_stop"] == 0
    assert torch.equal(torch.load(os.path.join(tmp_path, "huge", "out", "logits.pt")), plain)

    # `expertd verify` and `status` work against it
    assert seen["verify"]["rc"] == 0, seen["verify"]
    assert seen["status_cli"]["rc"] == 0 and f"shm_dir     {huge}" in seen["status_cli"]["stdout"]

    # an update writes its new segment there; the old generation's replaced segment goes when it retires
    old, new = seen["update_segments"]
    assert seen["update_generation"] == 2 and seen["generation_after_refresh"] == 2 and old != new
    assert ".2." in new
    assert new.lstrip("/") in seen["files_after_update"] and old.lstrip("/") in seen["files_after_update"]
    assert not any(".u" in name for name in seen["files_after_update"])  # the staging segment went after commit
    assert old.lstrip("/") not in seen["files_after_retire"] and new.lstrip("/") in seen["files_after_retire"]

    # a SIGKILLed daemon's segments stay there; its successor adopts the pushed generation (verified) from the
    # huge-page folder and reaps the rest (the dead daemon's index segment)
    dead = f"{namespace}.{seen['dead_pid']}."
    assert any(name.startswith(dead) for name in seen["files_after_kill"])
    assert seen["successor_status"]["generation"] == 2
    kept = [name for name in seen["files_after_reap"] if name.startswith(dead)]
    assert kept and not any(".i" in name for name in kept) and new.lstrip("/") in seen["files_after_reap"]
    assert seen["successor_worker"]["outside"] == []
    updated = torch.load(os.path.join(tmp_path, "huge", "out1", "logits.pt"))
    assert not torch.equal(updated, plain)
    assert torch.equal(torch.load(os.path.join(tmp_path, "huge", "out2", "logits.pt")), updated)
    assert seen["successor_stop"] == 0 and seen["files_after_stop"] == {}

    # a huge-page folder too small for the model (47 tensors, each a 2 MiB page): exit 2 before any segment
    small_run = seen["small"]
    assert small_run["rc"] == 2, small_run["stderr"]
    assert "ShmSpaceError" in small_run["stderr"] and small in small_run["stderr"]
    assert "MiB free but the model needs 96.0 MiB (in huge pages)" in small_run["stderr"]  # 47 tensors + the index
    assert "Traceback" not in small_run["stderr"] and seen["small_files"] == []
    said = small_run["stderr"]  # said before the socket, the progress bar or any work: one line after the plan's
    assert "control socket" not in said and "expertd load" not in said and said.count("ShmSpaceError") == 1, said

    # nothing left: no files, no /dev/shm segments, no processes, nothing in the working tree
    assert seen["dev_shm_at_end"] == [] and seen["alive"] == []
    assert os.listdir(huge) == [] and os.listdir(small) == []  # the mounts went with their namespace
    assert worktree_files() == before
