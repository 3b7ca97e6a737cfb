"""One simulated host of a multi-host expert-parallel run, to be started inside `unshare --ipc --mount --fork`.

It mounts a private tmpfs on /dev/shm (this host's shared memory), starts its own daemon from CONFIG, runs
this host's node of `torchrun --nnodes N` (helpers/ep_worker.py) against it, optionally reloads the daemon
onto another checkpoint once the workers have compared their first logits, stops the daemon and writes
OUT/host<NODE>.json: the daemon's status after loading (and after the reload), the exit codes, and what
was left in this host's /dev/shm.

    python ep_host.py CONFIG NODE NNODES NPROC PORT OUT REFERENCE NAMESPACE [--reload CKPT REFERENCE2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def expertd(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertd.server.cli", *args], capture_output=True, text=True, **kwargs)


def status(config: str) -> dict:
    done = expertd("status", "--config", config, "--json")
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("config", "node", "nnodes", "nproc", "port", "out", "reference", "namespace"):
        ap.add_argument(name)
    ap.add_argument("--reload", nargs=2, default=None, metavar=("CHECKPOINT", "REFERENCE"))
    args = ap.parse_args()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=1777", "expertd-host", "/dev/shm"], check=True)
    report: dict = {"node": int(args.node)}
    daemon = subprocess.Popen([sys.executable, "-m", "expertd.server.cli", "start", "--config", args.config],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        waited = expertd("status", "--config", args.config, "--wait", "120")
        report["loaded"] = status(args.config)
        if waited.returncode != 0:
            report["daemon_error"] = waited.stderr
            return
        endpoint = report["loaded"]["endpoint"]
        worker = [sys.executable, "-m", "torch.distributed.run", "--nnodes", args.nnodes,
                  "--nproc_per_node", args.nproc,
                  "--node_rank", args.node, "--master_addr", "127.0.0.1", "--master_port", args.port,
                  os.path.join(HERE, "ep_worker.py"), args.out, args.reference, args.namespace]
        if args.reload:
            worker += ["--then-refresh", args.reload[1]]
        # TMPDIR: torchrun's own torchelastic_* log folders go with the test's folder, not into /tmp
        env = {**os.environ, "EXPERTD_ENDPOINT": endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": args.out}
        torchrun = subprocess.Popen(worker, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if args.reload:
            ranks = range(int(args.node) * int(args.nproc), (int(args.node) + 1) * int(args.nproc))
            deadline = time.monotonic() + 300
            while not all(os.path.exists(os.path.join(args.out, f"rank{r}.ready")) for r in ranks):
                if torchrun.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            reload = expertd("reload", "--config", args.config, "--checkpoint", args.reload[0])
            report["reload"] = [reload.returncode, reload.stdout, reload.stderr]
            report["reloaded"] = status(args.config)
        out, _ = torchrun.communicate(timeout=600)
        report["torchrun"] = [torchrun.returncode, out[-4000:]]
    finally:
        stop = expertd("stop", "--config", args.config)
        report["stop"] = [stop.returncode, stop.stderr]
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        report["daemon_exit"] = daemon.returncode
        report["daemon_stderr"] = daemon.stderr.read()[-4000:]
        report["left_in_shm"] = sorted(os.listdir("/dev/shm"))
        with open(os.path.join(args.out, f"host{args.node}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
