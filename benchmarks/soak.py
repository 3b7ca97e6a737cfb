"""Soak: cycles of attach -> random SIGKILL of workers (and sometimes the daemon) -> restart.

Reports leaked segments (must be 0), lost leases (a live worker without a lease), stale leases
(a dead worker's lease still held after the lease timeout) and wrong bytes (a worker whose
tensors differ from the checkpoint's reference digest; must be 0).

    python benchmarks/soak.py --cycles 20 --workers 3
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import yaml

from expertd.client.connection import Connection
from expertd.errors import ExpertdError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = r"""
import hashlib, json, sys, torch
from expertd.client import ExpertClient
c = ExpertClient(sys.argv[1], timeout=60)
def digest():
    v = c.tensors(); h = hashlib.sha256()
    for n in sorted(v):
        h.update(n.encode()); h.update(v[n].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
print(json.dumps({"lease": c.lease, "digest": digest()}), flush=True)
for line in sys.stdin:
    print(json.dumps({"lease": c.lease, "digest": digest()}), flush=True)
"""


def reference_digest(checkpoint: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from reference import reference_tensors

    tensors = reference_tensors(checkpoint)
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].contiguous().view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


class Soak:
    def __init__(self, checkpoint: str, folder: str, lease_timeout: float):
        self.namespace = f"soak{os.getpid()}"
        self.endpoint = f"ipc://{folder}/run/expertd.sock"
        self.config = os.path.join(folder, "expertd.yaml")
        with open(self.config, "w") as f:
            yaml.safe_dump({"checkpoint": checkpoint, "endpoint": self.endpoint, "namespace": self.namespace,
                            "progress": False, "lease_timeout_s": lease_timeout}, f)
        self.daemon: subprocess.Popen | None = None
        self.dead_daemon_pids: list[int] = []

    def status(self) -> dict | None:
        conn = Connection(self.endpoint, timeout=2)
        try:
            return conn.request("status")
        except ExpertdError:
            return None
        finally:
            conn.close()

    def start_daemon(self) -> None:
        self.daemon = subprocess.Popen([sys.executable, "-m", "expertd.server.cli", "start", "--config", self.config],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            s = self.status()
            if s and s["state"] == "serving":
                return
            time.sleep(0.1)
        raise RuntimeError("daemon did not come up")

    def kill_daemon(self) -> None:
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait()
        self.dead_daemon_pids.append(self.daemon.pid)

    def segments(self) -> list[str]:
        return glob.glob(f"/dev/shm/{self.namespace}.*")


def start_worker(endpoint: str) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", WORKER, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    return p, json.loads(p.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--daemon-kill-rate", type=float, default=0.25)
    parser.add_argument("--lease-timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "tiny"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    want = reference_digest(args.checkpoint)
    totals = dict(cycles=0, workers_started=0, workers_killed=0, daemon_kills=0, wrong_bytes=0, lost_leases=0,
                  stale_leases=0, leaked_segments_during=0)
    with tempfile.TemporaryDirectory() as folder:
        soak = Soak(args.checkpoint, folder, args.lease_timeout)
        soak.start_daemon()
        live: list[tuple[subprocess.Popen, dict]] = []
        started = time.monotonic()
        try:
            for cycle in range(args.cycles):
                totals["cycles"] += 1
                while len(live) < args.workers:
                    live.append(start_worker(soak.endpoint))
                    totals["workers_started"] += 1
                for p, hello in live:
                    totals["wrong_bytes"] += hello["digest"] != want
                for victim in rng.sample(live, rng.randrange(0, len(live) + 1)):
                    victim[0].send_signal(signal.SIGKILL)
                    victim[0].wait()
                    live.remove(victim)
                    totals["workers_killed"] += 1
                if rng.random() < args.daemon_kill_rate:
                    soak.kill_daemon()
                    totals["daemon_kills"] += 1
                    for p, _ in live:  # survivors keep valid views of the dead daemon's memory
                        p.stdin.write("digest\n")
                        p.stdin.flush()
                        totals["wrong_bytes"] += json.loads(p.stdout.readline())["digest"] != want
                    for p, _ in live:  # ... then restart, as a supervisor would, and re-attach
                        p.kill()
                        p.wait()
                    live.clear()
                    soak.start_daemon()
                    # the new daemon reaped every segment of the dead ones
                    totals["leaked_segments_during"] += sum(
                        len(glob.glob(f"/dev/shm/{soak.namespace}.{pid}.*")) for pid in soak.dead_daemon_pids)
                    continue
                time.sleep(args.lease_timeout * 1.5 + 0.5)  # expiry sweeps every 0.1 s
                held = {l["client"] for l in soak.status()["leases"]}
                alive = {hello["lease"] for _, hello in live}
                totals["lost_leases"] += len(alive - held)
                totals["stale_leases"] += len(held - alive)
        finally:
            for p, _ in live:
                p.kill()
                p.wait()
            if soak.daemon.poll() is None:
                soak.daemon.send_signal(signal.SIGTERM)
                soak.daemon.wait(60)
            leaked = soak.segments()
            for path in leaked:
                os.unlink(path)
        elapsed = time.monotonic() - started
    totals["leaked_segments_after_stop"] = len(leaked)
    print(f"soak: {args.cycles} cycles in {elapsed:.0f}s on {os.cpu_count()} cores")
    print(f"| {'measure':<28} | {'value':>6} | goal |")
    print(f"|{'-' * 30}|{'-' * 8}|------|")
    goals = {"wrong_bytes": "0", "lost_leases": "0", "stale_leases": "0", "leaked_segments_during": "0",
             "leaked_segments_after_stop": "0"}
    for k, v in totals.items():
        print(f"| {k:<28} | {v:>6} | {goals.get(k, ''):<4} |")
    failed = any(totals[k] for k in goals)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
