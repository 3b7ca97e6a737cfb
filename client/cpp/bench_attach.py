"""Attach time, C++ client next to the Python one, against one daemon serving a checkpoint (default checkpoints/tiny).

    python client/cpp/bench_attach.py BUILD_DIR [--checkpoint DIR] [--runs 5]

BUILD_DIR holds a built `expertd-cpp-dump` (cmake -S client/cpp -B BUILD_DIR && cmake --build BUILD_DIR). An
attach is lease + index + every served tensor as a view (C++: `client.attach()`, `lease.tensors()`;
Python: `ExpertClient(...)`, `index()`, `served_tensors()`), timed in-process after one warm-up attach; the
release is timed apart. Prints the best of RUNS for each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--checkpoint", default=os.path.join(REPO, "checkpoints", "tiny"))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    from expertd.client import ExpertClient
    from expertd.connection import Connection
    from expertd.errors import ExpertdError

    folder = tempfile.mkdtemp(prefix="expertd-bench-")
    endpoint = f"ipc://{folder}/expertd.sock"
    config = os.path.join(folder, "expertd.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"checkpoint": os.path.abspath(args.checkpoint), "endpoint": endpoint,
                        "namespace": f"bench{uuid.uuid4().hex[:8]}", "progress": False}, f)
    daemon = subprocess.Popen([sys.executable, "-m", "expertd.server.cli", "start", "--config", config],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if daemon.poll() is not None:
                raise SystemExit(f"daemon exited: {daemon.stderr.read()}")
            conn = Connection(endpoint, timeout=1)
            try:
                if conn.request("status")["state"] == "serving":
                    break
            except ExpertdError:
                pass
            finally:
                conn.close()
            if time.monotonic() > deadline:
                raise SystemExit("daemon did not start serving")
            time.sleep(0.1)

        run = subprocess.run([os.path.join(args.build, "expertd-cpp-dump"), endpoint, "--json", "--bench",
                              str(args.runs)], capture_output=True, text=True, check=True)
        cpp = json.loads(run.stdout)
        cpp_attach = [r["attach"] + r["tensors"] for r in cpp["bench_ms"]]
        cpp_close = [r["release"] for r in cpp["bench_ms"]]

        py_attach, py_close = [], []
        for k in range(args.runs + 1):  # the first one warms up
            t0 = time.perf_counter()
            client = ExpertClient(endpoint)
            client.index()
            tensors = client.served_tensors()
            t1 = time.perf_counter()
            client.close()
            t2 = time.perf_counter()
            del tensors
            if k:
                py_attach.append((t1 - t0) * 1000)
                py_close.append((t2 - t1) * 1000)

        n = len(cpp["tensors"])
        print(f"{args.checkpoint}: {n} served tensors, generation {cpp['generation']}; best of {args.runs}")
        print(f"  C++    attach {min(cpp_attach):7.2f} ms   release {min(cpp_close):6.2f} ms")
        print(f"  Python attach {min(py_attach):7.2f} ms   release {min(py_close):6.2f} ms")
        print(f"  ratio C++/Python attach {min(cpp_attach) / min(py_attach):.2f}")

        # no daemon: the whole expertd-cpp-dump process (start, libtorch loaded, DaemonNotRunning, exit) with a 30 s
        # timeout, for a missing socket file and for one a killed daemon left behind with nothing listening
        left = os.path.join(folder, "killed.sock")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.bind(left)
        probe.close()
        for what, where in (("missing socket file", os.path.join(folder, "nobody.sock")),
                            ("socket nobody listens on", left)):
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                run = subprocess.run([os.path.join(args.build, "expertd-cpp-dump"), f"ipc://{where}",
                                      "--timeout-ms", "30000"], capture_output=True, text=True)
                times.append((time.perf_counter() - t0) * 1000)
                if run.returncode != 3 or "DaemonNotRunning" not in run.stderr:
                    raise SystemExit(f"expected DaemonNotRunning (exit 3) with no daemon, got exit {run.returncode}: "
                                     f"{run.stderr.strip()}")
            print(f"  no daemon ({what}): DaemonNotRunning, whole process {min(times):.0f} ms best, "
                  f"{max(times):.0f} ms worst (timeout 30000 ms)")
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
