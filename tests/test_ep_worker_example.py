"""examples/ep_worker.py: a SIGTERM to any one rank under torchrun ends every rank cleanly and torchrun exits 0; run as
its own launcher, a SIGTERM to the script does the same (torchrun itself never gets one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.ep import free_port

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "checkpoints" / "tiny")
EP_WORKER = str(REPO / "examples" / "ep_worker.py")


def children(pid: int) -> list[int]:
    """The processes `pid` started, from /proc."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def run_until_ready_then(launcher: list[str], signal_target, start_daemon, tmp_path) -> str:
    """Start two ranks through `launcher` on a daemon serving both EP ranks, wait for rank 0's ready file, SIGTERM
    `signal_target(process)`; the output once it has exited 0 with both ranks stopped and detached."""
    import time

    d = start_daemon(TINY, expert_parallel={"size": 2})  # one host serving both EP ranks
    ready = tmp_path / "ready"
    env = {**os.environ, "EXPERTD_ENDPOINT": d.endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    torchrun_args = ["--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                     "--master_port", str(free_port())]
    proc = subprocess.Popen([*launcher(torchrun_args), "--poll", "0.2", "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        assert len(d.status()["leases"]) == 2
        os.kill(signal_target(proc), signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "Error" not in out, out
    assert "rank 0: stopping" in out and "rank 1: stopping" in out, out
    assert d.status()["leases"] == []  # both detached on the way out
    return out


def test_sigterm_to_one_rank_ends_all_ranks_and_torchrun_exits_0(start_daemon, tmp_path):
    def under_torchrun(torchrun_args):
        return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, EP_WORKER]

    def last_rank(torchrun):  # one rank only, not rank 0 (whose word all ranks follow): every rank stops
        ranks = children(torchrun.pid)
        assert len(ranks) == 2
        return ranks[-1]

    run_until_ready_then(under_torchrun, last_rank, start_daemon, tmp_path)


def test_sigterm_to_the_script_as_launcher_ends_all_ranks_and_exits_0(start_daemon, tmp_path):
    def as_launcher(torchrun_args):
        return [sys.executable, EP_WORKER, *torchrun_args, "--"]

    run_until_ready_then(as_launcher, lambda script: script.pid, start_daemon, tmp_path)
