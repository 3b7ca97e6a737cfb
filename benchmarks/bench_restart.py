"""Restart without reloading: a successor adopting what its predecessor left, against a fresh start, in one run.

    python benchmarks/bench_restart.py [--workdir /tmp/expertd-bench] [--checkpoint DIR] [--reps 3] [--restarts 20]

R1  restart-to-serving ÷ fresh start-to-serving (`expertd start` on an empty namespace until it serves, asking
    transformers for the layout: `layout_cache: false`) of the same checkpoint (default: the ~1 GB `bench-1g`), page
    cache warm, runs alternated, medians of --reps. `cached`: a fresh start whose layout cache holds the checkpoint's
    layout (it never imports transformers). Restarts:
    SIGKILL of a serving daemon → `expertd start` on the same config until it serves (process start, imports,
    manifest and ledger, segment checks, xxh3 of every tensor with `adopt_verify: full`, socket), with `full` and
    `sizes`; and a planned one, `stop --keep` → `start` (`full`), from the stop request until the successor
    serves. The successor serves before it imports torch or transformers (its checkpoint check imports them in the
    background). Goal: <= 0.5 s with `sizes`, <= 0.5 s + one xxh3 pass with `full`; ÷ fresh <= 0.1 and <= 0.2.
R2  a worker process doing forward passes back to back (tests/helpers/worker.py `loop`) while the daemon is
    SIGKILLed and restarted --restarts times: forward passes that raised (goal 0), distinct logits seen (1), and
    whether its lease was the successor's all along.
R3  `expertd stop`: seconds from the daemon's exit to the command's return (goal <= 0.5), and the whole command;
    `expertd status` and `expertd --version`, whole commands. Medians of --reps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_loader import warm  # noqa: E402
from expertd.server.serving.leases import lease_tag  # noqa: E402
from helpers.daemon import DaemonProcess  # noqa: E402
from helpers.workers import Worker  # noqa: E402
from run_all import ensure_checkpoints, machine  # noqa: E402


def launch(folder: str, checkpoint: str, namespace: str, **extra) -> tuple[DaemonProcess, float]:
    t0 = time.perf_counter()
    d = DaemonProcess.launch(folder, checkpoint, namespace, stdout=subprocess.DEVNULL, **extra)
    return d, serving(d, t0)


def serving(d: DaemonProcess, t0: float, timeout: float = 900) -> float:
    """Seconds from `t0` until `d` answers that it serves (polled every 5 ms: the figures are sub-second)."""
    while time.perf_counter() - t0 < timeout:
        if d.proc.poll() is not None:
            raise SystemExit(f"the daemon exited {d.proc.returncode}: {d.proc.communicate()[1][-2000:]}")
        status = d.status(timeout=1.0)
        if status and status["state"] == "serving":
            return time.perf_counter() - t0
        time.sleep(0.005)
    raise SystemExit("the daemon did not serve in time")


def kill9(d: DaemonProcess) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d.proc.communicate()


def cli(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "expertd.server.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def handover(d: DaemonProcess, folder: str, checkpoint: str, namespace: str, **extra) -> tuple[DaemonProcess, float]:
    """`expertd stop --keep`, then `expertd start` on the same config: seconds from the stop until it serves."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "expertd.server.cli", "stop", "--keep", "--config", d.config], check=True,
                   stdout=subprocess.DEVNULL)
    d.stop()
    successor = DaemonProcess(d.config, d.endpoint, namespace=namespace, stdout=subprocess.DEVNULL)
    return successor, serving(successor, t0)


def r1(workdir: str, checkpoint: str, reps: int) -> dict:
    times: dict[str, list[float]] = {"fresh": [], "cached": [], "full": [], "sizes": [], "handover": []}
    layouts = os.path.join(workdir, f"layouts-{os.getpid()}")  # the `cached` starts' layout cache, made warm first
    d, _ = launch(os.path.join(workdir, f"rs-wa-{os.getpid()}"), checkpoint, f"benchrswa{os.getpid()}",
                  layout_cache=layouts)
    d.stop()
    for rep in range(reps):
        for mode in times:  # alternated: a neighbour's load hits each alike
            folder = os.path.join(workdir, f"rs-{mode[:2]}-{os.getpid()}-{rep}")  # ipc paths are short
            namespace = f"benchrs{mode[:2]}{os.getpid()}r{rep}"
            extra = {"adopt_verify": mode} if mode in ("full", "sizes") else {}
            extra["layout_cache"] = layouts if mode == "cached" else False
            d, seconds = launch(folder, checkpoint, namespace, **extra)
            if mode in ("full", "sizes"):
                kill9(d)
                d, seconds = launch(folder, checkpoint, namespace, **extra)
            elif mode == "handover":
                d, seconds = handover(d, folder, checkpoint, namespace)
            if mode != "fresh" and d.status()["generation"] != 1:
                raise SystemExit(f"{mode}: the successor did not adopt generation 1")
            times[mode].append(seconds)
            d.stop()
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(layouts, ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, f"rs-wa-{os.getpid()}"), ignore_errors=True)
    fresh = statistics.median(times["fresh"])
    return {mode: {"seconds": round(statistics.median(ts), 3), "runs": [round(t, 3) for t in ts],
                   "ratio": round(statistics.median(ts) / fresh, 3)} for mode, ts in times.items()}


def r3(workdir: str, checkpoint: str, reps: int) -> dict:
    folder = os.path.join(workdir, f"restart-cli-{os.getpid()}")
    namespace = f"benchcli{os.getpid()}"
    after_exit, stop, status, version = [], [], [], []
    try:
        for _ in range(reps):
            d, _ = launch(folder, checkpoint, namespace)
            status.append(cli("status", "--config", d.config))
            version.append(cli("--version"))
            exited = []
            waiter = threading.Thread(target=lambda: (d.proc.wait(), exited.append(time.perf_counter())))
            waiter.start()
            stop.append(cli("stop", "--config", d.config))
            returned = time.perf_counter()
            waiter.join()
            after_exit.append(returned - exited[0])
            d.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    return {"stop_after_exit": med(after_exit), "stop": med(stop), "status": med(status), "version": med(version)}


def r2(workdir: str, checkpoint: str, restarts: int) -> dict:
    folder = os.path.join(workdir, f"restart-loop-{os.getpid()}")
    namespace = f"benchrl{os.getpid()}"
    # a lease timeout a worker busy with forward passes on a loaded host keeps beating within (6 s was too tight)
    d, _ = launch(folder, checkpoint, namespace, lease_timeout_s=20)
    worker = Worker(d.endpoint, timeout=60, namespace=namespace, model=True)
    try:
        lease = worker.ask("lease")["lease"]
        before = worker.ask("logits")
        worker.send(f"loop {max(30, 4 * restarts)}")
        seconds = []
        for _ in range(restarts):
            time.sleep(0.5)
            kill9(d)
            d, s = launch(folder, checkpoint, namespace, lease_timeout_s=20)
            seconds.append(s)
        looped = worker.receive()
        after = worker.ask("lease")["lease"]
        # status shows tags
        kept = after == lease and lease_tag(after) in {held["client"] for held in d.status()["leases"]}
        return {"restarts": restarts, "forwards": looped.get("forwards"), "errors": 0 if "error" not in looped else 1,
                "error": looped.get("message"), "distinct_logits": len(looped.get("digests", [])),
                "logits_as_before": looped.get("digests") == [before["logits"]], "same_lease": kept,
                "restart_seconds_median": round(statistics.median(seconds), 3)}
    finally:
        worker.finish()
        d.stop()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--checkpoint", help="default: the generated ~1 GB bench-1g")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=["R1", "R3", "R2"])
    args = ap.parse_args()
    checkpoint = os.path.abspath(args.checkpoint) if args.checkpoint else ensure_checkpoints(args.workdir)["big"]
    warm(checkpoint)
    print(machine(), flush=True)
    result = {}
    if "R1" in args.only:
        result["R1"] = r1(args.workdir, checkpoint, args.reps)
        for mode, row in result["R1"].items():
            print(f"R1 {mode}: {row['seconds']} s to serving (runs {row['runs']}); / fresh {row['ratio']}", flush=True)
    if "R3" in args.only:
        result["R3"] = row = r3(args.workdir, checkpoint, args.reps)
        print(f"R3 `expertd stop` returned {row['stop_after_exit']} s after the daemon exited "
              f"({row['stop']} s in all); "
              f"`expertd status` {row['status']} s, `expertd --version` {row['version']} s", flush=True)
    if "R2" in args.only:
        result["R2"] = row = r2(args.workdir, checkpoint, args.restarts)
        print(f"R2 {row['restarts']} SIGKILL restarts under a worker: {row['forwards']} forward passes, "
              f"{row['errors']} raised, {row['distinct_logits']} distinct logits (as before: "
              f"{row['logits_as_before']}), same lease throughout: {row['same_lease']}; median restart-to-serving "
              f"{row['restart_seconds_median']} s", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
