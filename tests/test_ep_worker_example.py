"""examples/ep_worker.py under torchrun: a SIGTERM to any one rank ends every rank cleanly, and torchrun exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.ep import free_port

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "checkpoints" / "tiny")


def children(pid: int) -> list[int]:
    """The processes `pid` started (torchrun's ranks), from /proc."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_sigterm_to_one_rank_ends_all_ranks_and_torchrun_exits_0(start_daemon, tmp_path):
    d = start_daemon(TINY, expert_parallel={"size": 2})  # one host serving both EP ranks
    ready = tmp_path / "ready"
    env = {**os.environ, "EXPERTD_ENDPOINT": d.endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(REPO / "examples" / "ep_worker.py"),
         "--poll", "0.2", "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        while not ready.exists():
            assert torchrun.poll() is None, torchrun.stdout.read()
            time.sleep(0.1)
        ranks = children(torchrun.pid)
        assert len(ranks) == 2
        assert len(d.status()["leases"]) == 2
        os.kill(ranks[-1], signal.SIGTERM)  # one rank only (not rank 0's decision alone): every rank stops
        out, _ = torchrun.communicate(timeout=300)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.communicate()
    assert torchrun.returncode == 0, out
    assert "Traceback" not in out and "Error" not in out, out
    assert "rank 0: stopping" in out and "rank 1: stopping" in out, out
    assert d.status()["leases"] == []  # both detached on the way out
