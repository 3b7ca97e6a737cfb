"""Attach cold as fast as warm: the first load_model() in a fresh worker process vs a repeat one.

    python benchmarks/bench_attach.py [--workdir /tmp/expertd-bench] [--reps 3]

A1  the ~1 GB DeepSeek-V3-shaped checkpoint (preset bench-1g)
A2  DeepSeek-V3's real counts at tiny dims (preset dsv3-counts: 61 layers, 256 routed experts, the MTP
    layer, ~92k checkpoint tensors)

Each worker is a fresh process that has imported torch, transformers and the model's modeling module
(as a worker serving that model has) before the clock starts; "cold" is ExpertClient() + the first
load_model() (lease, index, mappings, model, binding), "warm" a second load_model() in the same process.
Goal: cold <= 2x warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers.daemon import DaemonProcess, expertd_cmd  # noqa: E402
from run_all import machine  # noqa: E402

WORKER = r"""
import importlib, json, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM
model_type = sys.argv[2]
importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
from expertd.client import ExpertClient
import transformers.conversion_mapping as cm
t0 = time.perf_counter()
client = ExpertClient(sys.argv[1], heartbeat=False)
model = client.load_model()
t1 = time.perf_counter()
again = client.load_model()
t2 = time.perf_counter()
print(json.dumps({"cold_ms": (t1 - t0) * 1e3, "warm_ms": (t2 - t1) * 1e3, "tensors": len(client.index().tensors),
                  "conversion_mapping_built": cm._checkpoint_conversion_mapping_cache is not None}))
client.close()
"""


def ensure(workdir: str, name: str, preset: str) -> str:
    path = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        print(f"generating {name} (once) ...", flush=True)
        subprocess.run(expertd_cmd("generate", path, "--preset", preset, "--shards", "8"), check=True,
                       stdout=subprocess.DEVNULL)
    return path


def measure(workdir: str, name: str, checkpoint: str, reps: int) -> dict:
    daemon = DaemonProcess.launch(os.path.join(workdir, f"attach-{name}"), checkpoint, f"bencha{name}{os.getpid()}",
                                  stdout=subprocess.DEVNULL)
    try:
        status = daemon.wait_serving(timeout=1800)
        with open(os.path.join(checkpoint, "config.json")) as f:
            model_type = json.load(f)["model_type"]
        runs = []
        for _ in range(reps):
            out = subprocess.run([sys.executable, "-c", WORKER, daemon.endpoint, model_type], capture_output=True,
                                 text=True, check=True, timeout=900)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        daemon.stop()
    cold = statistics.median(r["cold_ms"] for r in runs)
    warm = statistics.median(r["warm_ms"] for r in runs)
    return {"cold_ms": cold, "warm_ms": warm, "ratio": cold / warm, "served_tensors": runs[0]["tensors"],
            "views": status["views"], "conversion_mapping_built": any(r["conversion_mapping_built"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    print(f"machine: {machine()}", flush=True)
    results = {}
    for key, name, preset in (("A1", "bench-1g", "bench-1g"), ("A2", "dsv3-counts", "dsv3-counts")):
        results[key] = measure(args.workdir, name, ensure(args.workdir, name, preset), args.reps)
        print(key, json.dumps(results[key]), flush=True)
    print("\n| id | checkpoint | cold (first load_model) | warm (repeat) | cold / warm | goal |\n|---|---|---|---|---|---|")
    for key, what in (("A1", "~1 GB bench model"), ("A2", "DeepSeek-V3 counts, tiny dims")):
        r = results[key]
        print(f"| {key} | {what} ({r['served_tensors']} served, {r['views']} views) | {r['cold_ms']:.1f} ms | "
              f"{r['warm_ms']:.1f} ms | {r['ratio']:.2f} | <= 2 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
