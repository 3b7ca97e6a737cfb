"""Names nobody can plant: another uid fills the shm folder with the names the daemon would make next.

The review's attack (issue 37, finding 7): segment names were `/{namespace}.{pid}.{tag}.{i}` and the pid shows in
`ls /dev/shm`, so any local uid could plant the next generation's, index's or staging segment's name (every later
push and reload failed), or every pid's first names (32,768 empty files, the host's pid_max, kept the daemon from
starting). Now every name ends in 64 random bits drawn at creation (a name found taken is left alone and drawn
again), so the attacker (uid 65534, via setpriv) plants exactly what it did before and the daemon starts, takes a
push and a reload all the same; every planted file is left as it was (not ours: never unlinked), and what the
start-up reaper says of them is one bounded line.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from expertd.client import ExpertClient
from expertd.server.shm.arena import segment_pattern
from helpers.checkpoints import edit_checkpoint
from helpers.daemon import expertd_cmd
from helpers.reference import reference_tensors

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="plants files as another uid: needs root and setpriv")]

NOBODY = 65534
NORM = "model.layers.2.post_attention_layernorm.weight"
# the attacker's program (the system python, stdlib only): create empty files named argv[2:] (a format and a count,
# or plain names) in folder argv[1], each 0644 and its own
PLANTER = r"""
import os, sys
folder, names = sys.argv[1], sys.argv[2:]
if names[0] == "--pids":
    fmt, last = names[1], int(names[2])
    names = [fmt.format(pid=p) for p in range(1, last + 1)]
for name in names:
    os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
print(len(names))
"""


def plant(*args: str) -> int:
    """Plant files in /dev/shm as uid 65534; how many it made."""
    done = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--",
                           "/usr/bin/python3", "-c", PLANTER, "/dev/shm", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def planted_files(namespace: str) -> dict[str, tuple[int, int]]:
    """(owner uid, size) of every file of `namespace` in /dev/shm that is not root's (the attacker's)."""
    out = {}
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(namespace + "."):
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != 0:
                out[entry.name] = (st.st_uid, st.st_size)
    return out


def remove_planted(namespace: str) -> None:
    for name in planted_files(namespace):
        os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture
def changed(tiny_checkpoint, tmp_path) -> str:
    """The tiny checkpoint with one norm changed: a reload builds a generation of its own."""
    norm = reference_tensors(tiny_checkpoint)[NORM] * 1.25
    return edit_checkpoint(tiny_checkpoint, str(tmp_path / "changed"), replace={NORM: norm})


def test_planted_names_block_no_start_push_or_reload(tiny_checkpoint, changed, start_daemon, namespace):
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    flood = min(pid_max, 32768)  # the review's count: on its host, every pid's first names
    try:
        made = plant("--pids", f"{namespace}.{{pid}}.1.000", str(flood))
        made += plant("--pids", f"{namespace}.{{pid}}.i1.000", str(flood))
        assert made == 2 * flood and all(segment_pattern(namespace).match(n) for n in planted_files(namespace))
        daemon = start_daemon(tiny_checkpoint)  # every pid's names of generation 1 and its index are taken
        pid = daemon.proc.pid
        predictable = [f"{namespace}.{pid}.{tag}.{i:03d}" for tag in ("2", "3", "i2", "i3", "u1", "u2", "v1", "v2")
                       for i in range(64)]  # what this daemon would have made next
        assert plant(*predictable) == len(predictable)
        before = planted_files(namespace)
        assert len(before) == 2 * flood + len(predictable)

        with ExpertClient(daemon.endpoint, heartbeat=False) as client:
            value = client.tensors()[NORM] * 2
            assert client.update({NORM: value}) == 2  # a push: update (staging u1), commit, generation 2
            client.refresh()
            assert torch.equal(client.tensors()[NORM], value) and client.verify() == []
        reload = subprocess.run(expertd_cmd("reload", "--config", daemon.config, "--checkpoint", changed),
                                capture_output=True, text=True, timeout=120)
        assert reload.returncode == 0, reload.stderr
        assert daemon.status()["generation"] == 3  # a reload: generation 3 and its index segment
        with ExpertClient(daemon.endpoint, heartbeat=False) as client:
            assert client.verify() == []

        assert planted_files(namespace) == before  # every planted file is still there, the attacker's and empty
        daemon.proc.terminate()
        log = daemon.proc.communicate(timeout=60)[1]
        assert daemon.proc.returncode == 0, log
        assert planted_files(namespace) == before  # a clean stop unlinks its own segments only
        left_alone = [line for line in log.splitlines() if "another user owns them" in line]
        judged = 2 * flood - (2 if pid <= flood else 0)  # the reaper passes over names with its own pid
        assert len(left_alone) == 1 and f"{judged} file(s)" in left_alone[0], log[-2000:]
        assert f"and {judged - 5} more" in left_alone[0] and len(left_alone[0]) < 2000  # one bounded line
        assert "Traceback" not in log
        assert {n for n in os.listdir("/dev/shm") if n.startswith(namespace + ".")} == set(before)  # none of its own
    finally:
        remove_planted(namespace)
