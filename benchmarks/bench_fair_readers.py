"""Fairness among readers (issue 49, items 4 and 5): what one reader's requests cost another, side by side in one run.

    python benchmarks/bench_fair_readers.py [--workdir /tmp/expertd-bench] [--seconds 8] [--keys 10,100]

F1  another client's `status` latency (p50, p99, max of sequential asks) with no readers, then with two reader
    processes sending the largest requests the daemon makes on its request loop (INLINE_ITEMS whole-block gathers of
    INLINE_ENTRIES index entries in all, each distinct), back to back. Goal: p99 <= 20 ms.
F2  a victim's 65-item cast (a derivation job: over INLINE_ITEMS) on tcp:// with CURVE and no curve_client_keys, on a
    fresh daemon each time: seconds with no other reader, and with 10 and 100 throwaway flooding keys, each keeping 4
    large gathers parked (1.5 M index entries, refused once inflated, asked again and again). The victim's key is one
    the config names (curve_push_keys here), so it is a reader of its own; the throwaway keys are one, "anonymous".
    Goal: <= 2x the time with none. And the daemon's RSS growth under 100 keys (goal <= 64 MiB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from expertd.connection import Connection  # noqa: E402
from expertd.protocol import PROTOCOL_VERSION  # noqa: E402
from expertd.security import Credentials, create_keys  # noqa: E402
from expertd.server.derived.requests import INLINE_ENTRIES, INLINE_ITEMS  # noqa: E402
from helpers.daemon import DaemonProcess  # noqa: E402
from helpers.floods import FLOODER  # noqa: E402
from run_all import machine  # noqa: E402

BIG = "model.layers.1.mlp.experts.gate_up_proj"  # [8, 400, 320] bf16: one block of 1,024,000 elements
TINY = os.path.join(os.path.dirname(HERE), "checkpoints", "tiny")
ROOMY = {"max_derived_bytes": 8 << 30, "max_derived_bytes_per_reader": 4 << 30}

# sends the largest inline request, distinct each time, until stdin closes; prints how many it sent
INLINE_READER = """
import os, sys, threading, torch
from expertd import derived
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.protocol import PROTOCOL_VERSION
conn = Connection(sys.argv[1], timeout=60)
items, entries, seed = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
g, sent, m = torch.Generator().manual_seed(seed), 0, entries // items
made = [[derived.request(BIG, derived.encode(torch.randint(0, 1_024_000, (m,), generator=g)), m, (m,),
                         whole=True).wire() for _ in range(items)] for _ in range(int(sys.argv[5]))]
print("ready", flush=True)  # made before the first is sent: the reader's own work is not measured with the daemon's
while not done.is_set() and sent < len(made):
    request = made[sent]
    try:
        reply = conn.request("gather", client=lease, tensors=request)
        assert not reply.get("building"), "not made on the loop"
    except DaemonError:
        pass
    sent += 1
print(sent, flush=True)
""".replace("BIG", repr(BIG))

def latencies(endpoint: str, count: int, while_=None) -> list[float]:
    """`count` status round trips, 10 ms apart (with `while_`: only as long as it says)."""
    conn = Connection(endpoint, timeout=30)
    out = []
    try:
        for _ in range(count):
            if while_ is not None and not while_():
                break
            t0 = time.perf_counter()
            conn.request("status")
            out.append(time.perf_counter() - t0)
            time.sleep(0.01)
    finally:
        conn.close()
    return out


def summary(waits: list[float]) -> str:
    waits = sorted(waits)
    p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))]
    return f"p50 {1e3 * statistics.median(waits):6.1f} ms   p99 {1e3 * p99:6.1f} ms   max {1e3 * waits[-1]:6.1f} ms"


def f1(workdir: str, seconds: float, requests: int) -> None:
    d = DaemonProcess.launch(os.path.join(workdir, "f1"), TINY, f"edbf1{os.getpid()}", stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, **ROOMY)
    try:
        d.wait_serving()
        count = int(seconds / 0.012)
        print(f"F1  status with no readers:             {summary(latencies(d.endpoint, count))}")
        readers = [subprocess.Popen([sys.executable, "-c", INLINE_READER, d.endpoint, str(INLINE_ITEMS),
                                     str(INLINE_ENTRIES), str(seed), str(requests)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for seed in (1, 2)]
        for r in readers:
            assert r.stdout.readline().strip() == "ready"
        busy = latencies(d.endpoint, count, while_=lambda: all(r.poll() is None for r in readers))
        sent = []
        for r in readers:
            out, _ = r.communicate("", timeout=120)
            sent.append(out.strip())
        print(f"F1  status with two inline readers:     {summary(busy)}   ({len(busy)} asks while requests of "
              f"{INLINE_ITEMS} items, {INLINE_ENTRIES} entries came: {' + '.join(sent)} sent)   goal p99 <= 20 ms")
    finally:
        d.stop()


def victim_cast(d: DaemonProcess, creds: Credentials) -> float:
    conn = Connection(d.endpoint, timeout=60, credentials=creds)
    try:
        lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
        served = [t for t in conn.request("index", client=lease)["index"]["tensors"]
                  if t["dtype"] in ("torch.bfloat16", "torch.float32")]
        warm = [{"name": t["name"], "dtype": "torch.float32"} for t in served][:16]
        items = [{"name": t["name"], "dtype": dtype} for dtype in ("torch.float16", "torch.float64")
                 for t in served][:65]
        assert len(items) == 65
        for request in (warm, items):  # the first job warms the daemon's threads and torch's ops: not measured
            t0, wait = time.perf_counter(), 0.01
            while conn.request("cast", client=lease, tensors=request).get("building"):
                time.sleep(wait)
                wait = min(2 * wait, 0.05)
        return time.perf_counter() - t0
    finally:
        conn.close()


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) << 10


def f2(workdir: str, flooding: list[int]) -> None:
    keys = os.path.join(workdir, "f2-keys")
    public, secret = create_keys(os.path.join(keys, "daemon"), "daemon")
    mine = create_keys(os.path.join(keys, "named"), "victim")[1]
    os.rename(mine, os.path.join(keys, "victim.key_secret"))  # the daemon reads public keys only from the folder
    victim = Credentials.resolve(server_key=public, client_key=os.path.join(keys, "victim.key_secret"))
    base = None
    for n in [0, *flooding]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        d = DaemonProcess.launch(os.path.join(workdir, f"f2-{n}"), TINY, f"edbf2{n}x{os.getpid()}",
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 endpoint=f"tcp://127.0.0.1:{port}", curve_secret_key=secret,
                                 curve_push_keys=os.path.join(keys, "named"), **ROOMY)
        flooder = None
        try:
            deadline = time.monotonic() + 120
            while not _serving(d.endpoint, victim) and time.monotonic() < deadline:
                time.sleep(0.2)
            before = rss(d.proc.pid)
            if n:
                flooder = subprocess.Popen([sys.executable, "-c", FLOODER, d.endpoint, public, str(n)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert flooder.stdout.readline().strip() == "flooding"
                time.sleep(3)
            took = victim_cast(d, victim)
            grown = rss(d.proc.pid) - before
            base = took if base is None else base
            print(f"F2  victim's 65-item cast, {n:3d} flooding keys: {took:6.2f} s   x{took / base:4.2f} of none "
                  f"(goal <= 2)   daemon RSS +{grown / 2**20:6.1f} MiB (goal <= 64)")
        finally:
            if flooder is not None:
                flooder.communicate("", timeout=120)
            d.stop()


def _serving(endpoint: str, creds: Credentials) -> bool:
    conn = Connection(endpoint, timeout=2, credentials=creds)
    try:
        return conn.request("status")["state"] == "serving"
    except Exception:
        return False
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/expertd-bench")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--keys", default="10,100")
    parser.add_argument("--requests", type=int, default=2000, help="F1: distinct requests each reader makes ahead")
    parser.add_argument("--only", choices=["f1", "f2"])
    args = parser.parse_args()
    made = not os.path.exists(args.workdir)  # a folder this run makes goes with it
    workdir = os.path.join(args.workdir, "fair")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    print(machine())
    try:
        if args.only in (None, "f1"):
            f1(workdir, args.seconds, args.requests)
        if args.only in (None, "f2"):
            f2(workdir, [int(k) for k in args.keys.split(",")])
    finally:
        shutil.rmtree(args.workdir if made else workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
