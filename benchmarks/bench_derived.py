"""Zero copy on any transformers: private bytes per worker, Σ Pss of mixed-release workers, the cost of a derived
tensor.

    python benchmarks/bench_derived.py [--workdir /tmp/expertd-bench] [--previous PYTHON]

V1  private bytes per worker at DeepSeek-V3's real counts (preset dsv3-counts): parameters and loaded buffers
    not in a read-only shared mapping, for a worker on this transformers and one on the release before
    (`--previous`: a python with transformers 5.23 and expertd; default the tests' cached venv). Goal 0.
V2  Σ Pss of 4 workers attached at once (two on each release, every weight touched) / served bytes, on the
    ~1 GB bench checkpoint. Goal <= 1.1.
V3  building a dtype cast once: the daemon casting served bf16 tensors to float32 (the `cast` op, end to
    end: request, cast into a fresh segment, checksum, reply) in GB/s of output, beside the fill limit (a copy
    into a fresh segment) measured in the same run; DeepSeek-V3's 58 routers (58 x 256 x 7168, 406 MiB as
    float32) at that rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers.daemon import DaemonProcess  # noqa: E402
from bench_loader import ensure_preset  # noqa: E402
from run_all import machine  # noqa: E402

WORKER = r"""
import json, os, sys
import torch, transformers
from expertd.client import ExpertClient
from expertd.hf_dtypes import loaded_tensors
client = ExpertClient(sys.argv[1])
model = client.load_model()
shm_dir, ns = client.index().shm_dir, client.index().namespace
private = client.private_tensors(model)
tensors = loaded_tensors(model)
touched = sum(float(t.float().abs().sum()) for t in tensors.values())
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # every worker attached and touched everything: now each one's share is what it keeps
pss = 0
with open("/proc/self/smaps") as f:
    mine = False
    for line in f:
        parts = line.split()
        if len(parts) >= 6 and "-" in parts[0] and ":" not in parts[0]:
            mine = parts[5].startswith(os.path.join(shm_dir, ns + "."))
        elif mine and parts and parts[0] == "Pss:":
            pss += int(parts[1]) * 1024
print(json.dumps({"transformers": transformers.__version__, "private": len(private),
                  "private_bytes": sum(tensors[n].numel() * tensors[n].element_size() for n in private),
                  "tensors": len(tensors), "pss": pss}), flush=True)
sys.stdin.readline()
client.close()
"""

ROUTERS_BYTES = 58 * 256 * 7168 * 4  # DeepSeek-V3's routers as float32


@contextlib.contextmanager
def serving(workdir: str, name: str, checkpoint: str):
    """A daemon serving `checkpoint` from a run folder of its own, stopped and its folder removed afterwards."""
    folder = os.path.join(workdir, f"run-{name}-{os.getpid()}")
    d = DaemonProcess.launch(folder, checkpoint, f"benchv{os.getpid()}{name}", stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        d.wait_serving(timeout=900)
        yield d
    finally:
        d.stop()
        shutil.rmtree(folder, ignore_errors=True)


def attach_all(pythons: list[str], endpoint: str) -> list[dict]:
    """Workers under `pythons`, all attached at once; their reports."""
    procs = [subprocess.Popen([p, "-c", WORKER, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd="/") for p in pythons]
    for p in procs:
        json.loads(p.stdout.readline())  # attached
    reports = []
    for p in procs:
        p.stdin.write("measure\n")
        p.stdin.flush()
        reports.append(json.loads(p.stdout.readline()))
    for p in procs:
        p.communicate("exit\n", timeout=120)
    return reports


def fill_rate(nbytes: int = 1 << 30) -> float:
    """GB/s of copying into a fresh tmpfs file through a mapping (the fill limit a cast also meets)."""
    import mmap

    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    path = f"/dev/shm/benchv-fill-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        m = mmap.mmap(fd, nbytes)
        t0 = time.perf_counter()
        torch.frombuffer(m, dtype=torch.float32).copy_(src)
        seconds = time.perf_counter() - t0
        del m
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / seconds / 1e9


def derived_rate(d: DaemonProcess) -> dict:
    """The `cast` op casting the largest bf16 tensors to float32, end to end: GB/s of output."""
    from expertd import messages
    from expertd.connection import Connection
    from expertd.protocol import PROTOCOL_VERSION

    conn = Connection(d.endpoint, timeout=600)
    try:
        lease = conn.send(messages.Lease(pid=os.getpid(), protocol=PROTOCOL_VERSION), messages.LeaseReply).client
        index = conn.request("index")["index"]
        bf16 = sorted((t for t in index["tensors"] if t["dtype"] == "torch.bfloat16"), key=lambda t: -t["nbytes"])
        asked = bf16[:48]
        cast = messages.Cast(client=lease, tensors=[messages.CastItem(name=t["name"], dtype="torch.float32")
                                                    for t in asked])
        t0 = time.perf_counter()
        reply = conn.send(cast, messages.DerivedReply)
        seconds = time.perf_counter() - t0
        out = sum(t["nbytes"] for t in reply.tensors)
        t1 = time.perf_counter()
        conn.send(cast, messages.DerivedReply)
        again = time.perf_counter() - t1
        conn.send(messages.Release(client=lease))
    finally:
        conn.close()
    return {"tensors": len(asked), "bytes": out, "seconds": seconds, "gbps": out / seconds / 1e9, "again_s": again}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/expertd-bench")
    parser.add_argument("--previous", default=os.path.expanduser(
        "~/.cache/expertd/venv-transformers-5.23.0-server/bin/python"))
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    previous = args.previous if os.path.exists(args.previous) else None
    print(f"machine: {machine()}", flush=True)
    counts = ensure_preset(args.workdir, "dsv3-counts", "dsv3-counts", 163)
    big = ensure_preset(args.workdir, "bench-1g", "bench-1g", 4)

    with serving(args.workdir, "counts", counts) as d:
        reports = attach_all([sys.executable] + ([previous] if previous else []), d.endpoint)
    for r in reports:
        print(f"V1  dsv3-counts, worker on transformers {r['transformers']}: {r['private']} of {r['tensors']} tensors "
              f"private, {r['private_bytes']} private bytes (goal 0)", flush=True)

    with serving(args.workdir, "big", big) as d:
        served = d.status()["bytes"]["total"]
        reports = attach_all([sys.executable] * 2 + ([previous] * 2 if previous else [sys.executable] * 2), d.endpoint)
        pss = sum(r["pss"] for r in reports)
        print(f"V2  sum Pss of 4 workers ({', '.join(r['transformers'] for r in reports)}) / served bytes: "
              f"{pss / served:.3f} (goal <= 1.1; {pss / 2**20:.0f} MiB over {served / 2**20:.0f} MiB served)",
              flush=True)
        fill = fill_rate()
        v = derived_rate(d)
    routers_s = ROUTERS_BYTES / 1e9 / v["gbps"]
    print(f"V3  derived tensor build: {v['tensors']} bf16 tensors -> float32, {v['bytes'] / 2**20:.0f} MiB in "
          f"{v['seconds']:.2f}s = {v['gbps']:.2f} GB/s; the fill limit beside it {fill:.2f} GB/s (ratio "
          f"{v['gbps'] / fill:.2f}); the same request again {v['again_s'] * 1e3:.1f} ms (made once). DeepSeek-V3's 58 "
          f"routers ({ROUTERS_BYTES / 2**20:.0f} MiB as float32) at this rate: {routers_s:.2f}s, once per host",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
