"""examples/ep_two_hosts.sh for real: two `unshare --ipc --mount` hosts, two daemons, torchrun --nnodes 2, a push to
both daemons that both ranks refresh to, and a clean stop that leaves nothing in either /dev/shm or in /tmp."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "ep_two_hosts.sh"


def _unshare_permitted() -> bool:
    try:
        return subprocess.run(["unshare", "--ipc", "--mount", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _unshare_permitted(), reason="`unshare --ipc --mount` is not permitted (needs root or "
                                                      "CAP_SYS_ADMIN): the script's hosts cannot be simulated")
def test_the_two_hosts_recipe_runs_end_to_end_and_leaves_nothing():
    folders = set(glob.glob("/tmp/expertd-ep-*"))
    shm = set(os.listdir("/dev/shm"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert "Traceback" not in out + run.stderr
    lines = out.splitlines()
    for rank in (0, 1):
        assert any(line.startswith(f"host {rank}: daemon serving EP rank {rank} of 2 on tcp://") for line in lines), out
        assert any(line.startswith(f"rank {rank}/2: serving generation 1 from tcp://") for line in lines), out
        assert f"rank {rank}: refreshed to generation 2" in lines, out
        assert f"host {rank}: torchrun exited 0; daemon stopped; /dev/shm holds 0 file(s)" in lines, out
    pushed = next(line for line in lines if line.startswith("pushed model.norm.weight to both daemons: "))
    assert pushed.count("generation 2") == 2, pushed
    assert lines[-1] == "stopped: both ranks and both daemons exited 0; nothing left in either host's /dev/shm"
    assert set(glob.glob("/tmp/expertd-ep-*")) == folders  # its folder (configs, logs, torchrun's files) went
    assert not {n for n in set(os.listdir("/dev/shm")) - shm if n.startswith("expertd-ep")}
