"""Weight generations, measured side by side in one run.

    python benchmarks/bench_generations.py [--workdir /tmp/expertd-bench] [--fraction 0.125] [--reps 3]

G1  reload of a checkpoint in which `fraction` of the served bytes changed vs building it from scratch
    (what a daemon restart does), in one process: time ratio (goal <= 0.25), bytes written ratio (goal <= 0.15)
G2  the same through the real daemon: `expertd reload` until published vs `expertd start` until serving
G3  update() of one fused expert block in one process, then refresh() in a worker process: latency

The ~1 GB DeepSeek-V3-shaped FP8 checkpoint is generated into the workdir on first use; the changed
copy flips a low mantissa bit of every FP8 byte of whole expert blocks (weights re-read and re-hashed,
scales untouched), the largest blocks first, as close to `fraction` of the served bytes as whole blocks come.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers.daemon import DaemonProcess, expertd_cmd  # noqa: E402
from helpers.workers import Worker  # noqa: E402
from run_all import machine  # noqa: E402


def ensure_big(workdir: str) -> str:
    path = os.path.join(workdir, "bench-1g")
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        print("generating the ~1 GB benchmark checkpoint (once) ...", flush=True)
        subprocess.run(expertd_cmd("generate", path, "--preset", "bench-1g", "--shards", "4"), check=True,
                       stdout=subprocess.DEVNULL)
    return path


def changed_copy(src: str, dst: str, fraction: float) -> tuple[str, list[str]]:
    """A copy of `src` in which whole expert blocks covering `fraction` of the served bytes changed."""
    from safetensors.torch import load_file, save_file

    from expertd.server.load.loader import prepare

    ckpt, plan = prepare(src)
    goal, picked, covered = fraction * plan.nbytes, [], 0
    for t in sorted((t for t in plan.tensors if len(t.sources) > 1), key=lambda t: -t.nbytes):
        if covered + t.nbytes <= goal * 1.05:  # whole blocks, as close to the goal as they come
            picked.append(t)
            covered += t.nbytes
    sources = {s.name for t in picked for s in t.sources}
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for shard in sorted({weight_map[n] for n in sources}):
        tensors = load_file(os.path.join(dst, shard))
        for name in sources & tensors.keys():
            u = tensors[name].view(torch.uint8)
            tensors[name] = torch.where((u & 0x7F) < 0x7E, u ^ 1, u).view(torch.float8_e4m3fn)  # no new NaN bytes
        save_file(tensors, os.path.join(dst, shard), metadata={"format": "pt"})
    return dst, [t.name for t in picked]


def g1_in_process(a: str, b: str, reps: int) -> dict:
    from expertd.server.load.loader import build, prepare

    ns = f"benchg1{os.getpid()}"
    ckpt, plan = prepare(a)
    base = build(ckpt, plan, namespace=ns, generation=1)
    restart, reload, same = [], [], []
    try:
        for rep in range(reps):
            for kind in (("restart", "reload") if rep % 2 == 0 else ("reload", "restart")):
                t0 = time.perf_counter()
                ckpt, plan = prepare(b)
                if kind == "restart":
                    built = build(ckpt, plan, namespace=ns + "x", generation=1)
                    restart.append((time.perf_counter() - t0, built.bytes_written))
                else:
                    built = build(ckpt, plan, namespace=ns, generation=2, previous=base)
                    reload.append((time.perf_counter() - t0, built.bytes_written))
                built.close()
            t0 = time.perf_counter()
            ckpt, plan = prepare(a)  # the served folder again, unchanged files: known by identity, not re-read
            built = build(ckpt, plan, namespace=ns, generation=2, previous=base)
            same.append((time.perf_counter() - t0, built.bytes_written))
            built.close()
    finally:
        base.close()
    t_restart, t_reload = min(t for t, _ in restart), min(t for t, _ in reload)
    return {"restart_s": t_restart, "reload_s": t_reload, "time_ratio": t_reload / t_restart,
            "restart_bytes": restart[0][1], "reload_bytes": reload[0][1], "bytes_ratio": reload[0][1] / restart[0][1],
            "same_folder_s": min(t for t, _ in same), "same_folder_bytes": same[0][1]}


def g2_daemon(workdir: str, a: str, b: str) -> dict:
    ns = f"benchg2{os.getpid()}"
    daemon = DaemonProcess.launch(os.path.join(workdir, "g2"), a, ns, stdout=subprocess.DEVNULL)
    try:
        daemon.wait_serving(timeout=600)
        t0 = time.perf_counter()
        subprocess.run(expertd_cmd("reload", "--config", daemon.config, "--checkpoint", b), check=True,
                       stdout=subprocess.DEVNULL)
        t_reload = time.perf_counter() - t0
        job = daemon.status()["job"]
    finally:
        daemon.stop()
    t0 = time.perf_counter()
    fresh = DaemonProcess.launch(os.path.join(workdir, "g2b"), b, ns + "b", stdout=subprocess.DEVNULL)
    try:
        fresh.wait_serving(timeout=600)
        t_start = time.perf_counter() - t0
    finally:
        fresh.stop()
    return {"reload_cli_s": t_reload, "start_to_serving_s": t_start, "ratio": t_reload / t_start,
            "reload_job_s": job["seconds"], "reload_bytes": job["bytes_written"]}


def g3_update(workdir: str, a: str, reps: int) -> dict:
    from expertd.client import ExpertClient

    ns = f"benchg3{os.getpid()}"
    daemon = DaemonProcess.launch(os.path.join(workdir, "g3"), a, ns, stdout=subprocess.DEVNULL)
    worker = None
    try:
        daemon.wait_serving(timeout=600)
        worker = Worker(daemon.endpoint, namespace=ns, model=True)
        with ExpertClient(daemon.endpoint) as updater:
            served = updater.served_tensors()
            name = next(n for n in served if n.endswith("mlp.experts.gate_up_proj"))
            block = served[name]
            update_s, total_s = [], []
            for rep in range(reps):
                value = (block.float() * (0.5 + 0.1 * rep)).bfloat16()
                t0 = time.perf_counter()
                updater.update({name: value})
                t1 = time.perf_counter()
                moved = worker.ask("refresh")
                t2 = time.perf_counter()
                if moved["names"] != [name]:
                    raise RuntimeError(f"refresh rebound {moved['names']}, expected [{name}]")
                update_s.append(t1 - t0)
                total_s.append(t2 - t0)
                updater.refresh()
    finally:
        if worker is not None:
            worker.ask("exit")
            worker.finish()
        daemon.stop()
    return {"block": name, "block_bytes": block.nbytes, "update_ms": min(update_s) * 1e3,
            "update_to_refresh_ms": min(total_s) * 1e3, "update_to_refresh_median_ms": statistics.median(total_s) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--fraction", type=float, default=0.125)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=("G1", "G2", "G3"), help="run one measurement")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    a = ensure_big(args.workdir)
    b, picked = changed_copy(a, os.path.join(args.workdir, "bench-1g-changed"), args.fraction)
    print(f"machine: {machine()}")
    print(f"changed: {len(picked)} fused expert blocks ({picked[0]} ... {picked[-1]})", flush=True)
    run = {"G1": lambda: g1_in_process(a, b, args.reps), "G2": lambda: g2_daemon(args.workdir, a, b),
           "G3": lambda: g3_update(args.workdir, a, max(args.reps, 5))}
    results = {}
    for key, fn in run.items():
        if args.only in (None, key):
            results[key] = fn()
            print(key, json.dumps(results[key]), flush=True)
    if args.only:
        return 0
    g1, g2, g3 = results["G1"], results["G2"], results["G3"]
    print()
    print("| id | measure | result (same run) | goal |\n|---|---|---|---|")
    print(f"| G1 | reload ({g1['reload_bytes'] / 2**20:.0f} MiB of {g1['restart_bytes'] / 2**20:.0f} MiB changed) "
          f"vs build from scratch, validation included | time {g1['time_ratio']:.2f} ({g1['reload_s']:.2f} s vs "
          f"{g1['restart_s']:.2f} s); bytes written {g1['bytes_ratio']:.3f} | <= 0.25; <= 0.15 |")
    print(f"| G1b | reload of the served folder, nothing changed | {g1['same_folder_s']:.2f} s, "
          f"{g1['same_folder_bytes']} bytes written | |")
    print(f"| G2 | `expertd reload` until published vs `expertd start` until serving (process start included) | "
          f"{g2['ratio']:.2f} ({g2['reload_cli_s']:.2f} s vs {g2['start_to_serving_s']:.2f} s) | |")
    print(f"| G3 | update() of one fused block ({g3['block_bytes'] / 2**20:.1f} MiB) until refresh() returns in "
          f"another worker | {g3['update_to_refresh_ms']:.0f} ms (median {g3['update_to_refresh_median_ms']:.0f} ms; "
          f"update() alone {g3['update_ms']:.0f} ms) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
