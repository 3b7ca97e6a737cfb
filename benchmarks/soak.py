"""Soak: cycles of attach -> random SIGKILL of workers (and sometimes the daemon) -> restart.

Reports leaked segments (must be 0), lost leases (a live worker without a lease), stale leases
(a dead worker's lease still held after the lease timeout) and wrong bytes (a worker whose
tensors differ from the checkpoint's reference digest; must be 0).

    python benchmarks/soak.py --cycles 20 --workers 3
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from expertd.server.serving.leases import lease_tag  # noqa: E402
from helpers.daemon import DaemonProcess, daemon_settings, save_config  # noqa: E402
from helpers.reference import reference_tensors  # noqa: E402
from helpers.worker import digest  # noqa: E402
from helpers.workers import Worker  # noqa: E402


class Soak:
    def __init__(self, checkpoint: str, folder: str, lease_timeout: float):
        self.namespace = f"soak{os.getpid()}"
        settings = daemon_settings(folder, checkpoint, self.namespace, lease_timeout_s=lease_timeout)
        self.config = save_config(folder, settings)
        self.endpoint = settings["endpoint"]
        self.daemon: DaemonProcess | None = None
        self.dead_daemon_pids: list[int] = []

    def start_daemon(self) -> None:
        self.daemon = DaemonProcess(self.config, self.endpoint, namespace=self.namespace,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.daemon.wait_serving()

    def kill_daemon(self) -> None:
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait()
        self.dead_daemon_pids.append(self.daemon.proc.pid)

    def segments(self) -> list[str]:
        return glob.glob(f"/dev/shm/{self.namespace}.*")


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
    want = digest(reference_tensors(args.checkpoint))
    totals = dict(cycles=0, workers_started=0, workers_killed=0, daemon_kills=0, wrong_bytes=0, lost_leases=0,
                  stale_leases=0, leaked_segments_during=0)
    with tempfile.TemporaryDirectory() as folder:
        soak = Soak(args.checkpoint, folder, args.lease_timeout)
        soak.start_daemon()
        live: list[Worker] = []
        started = time.monotonic()
        try:
            for cycle in range(args.cycles):
                totals["cycles"] += 1
                while len(live) < args.workers:
                    live.append(Worker(soak.endpoint, timeout=60))
                    totals["workers_started"] += 1
                for w in live:
                    totals["wrong_bytes"] += w.hello["digest"] != want
                for victim in rng.sample(live, rng.randrange(0, len(live) + 1)):
                    victim.finish()  # SIGKILL
                    live.remove(victim)
                    totals["workers_killed"] += 1
                if rng.random() < args.daemon_kill_rate:
                    soak.kill_daemon()
                    totals["daemon_kills"] += 1
                    for w in live:  # survivors keep valid views of the dead daemon's memory
                        totals["wrong_bytes"] += w.ask("digest")["digest"] != want
                    for w in live:  # ... then restart, as a supervisor would, and re-attach
                        w.finish()
                    live.clear()
                    soak.start_daemon()
                    # the new daemon reaped every segment of the dead ones
                    totals["leaked_segments_during"] += sum(
                        len(glob.glob(f"/dev/shm/{soak.namespace}.{pid}.*")) for pid in soak.dead_daemon_pids)
                    continue
                time.sleep(args.lease_timeout * 1.5 + 0.5)  # expiry sweeps every 0.1 s
                held = {lease["client"] for lease in soak.daemon.status()["leases"]}
                alive = {lease_tag(w.hello["lease"]) for w in live}  # status shows tags, never ids
                totals["lost_leases"] += len(alive - held)
                totals["stale_leases"] += len(held - alive)
        finally:
            for w in live:
                w.finish()
            soak.daemon.stop(60)
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
