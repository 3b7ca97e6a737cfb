"""What DeepSeek-V3's real tensor counts cost beyond their bytes, phase by phase, as a daemon's load meets them.

    python benchmarks/bench_counts.py [--workdir /tmp/expertd-bench] [--reps 3]
        [--counts-checkpoint DIR --bytes-checkpoint DIR]

The daemon's path to serving, phase by phase, each load in a fresh process as a daemon makes it (the best of
REPS, the two checkpoints alternating):
imports (the daemon's modules, in a fresh process), plan (`loader.prepare`: headers read, checkpoint checked
and planned), build (`loader.build`), index (`generations.place_index`: packed into its segment), JSON
(`built.publish`: the index file) and ledger (`ledger.write`: the sealed record). "publish" is the last three,
what a daemon does between a finished build and serving. The checkpoints: DeepSeek-V3's real counts at tiny
dims (`--preset dsv3-counts --shards 163`: ~92k checkpoint tensors) and about the same bytes in ~70 tensors
(`--preset dsv3-bytes`); the cost per checkpoint tensor beyond the bytes is (t_counts - t_bytes) / n_tensors.
A fresh process per load puts the garbage collector where a daemon's start has it, once the imports' objects
are collected (a cost of any start, which the many allocations of the real counts only bring forward): what
the checkpoint's own objects cost in collections lands in whichever phase it falls, as in the daemon.
Goals (issue 30): <= 30 us a tensor, publish <= 0.2 s at the real counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_loader import ensure_preset, warm  # noqa: E402
from run_all import machine  # noqa: E402

PHASES = ("plan", "build", "index", "JSON", "ledger")
IMPORTS = "import time; t = time.perf_counter(); import expertd.server.daemon.loop; print(time.perf_counter() - t)"


def imports_seconds(reps: int) -> float:
    """The daemon's imports, in fresh processes (the same for any checkpoint)."""
    return min(float(subprocess.run([sys.executable, "-c", IMPORTS], check=True, capture_output=True,
                                    text=True).stdout) for _ in range(reps))


def phases(checkpoint: str) -> tuple[dict[str, float], int]:
    """Seconds per phase of one load and publish of `checkpoint` (everything made is removed), and its tensor count."""
    from expertd.server.restart import ledger
    from expertd.server.load import loader
    from expertd.server.shm.arena import unlink_segment
    from expertd.server.load.built import publish
    from expertd.server.serving.generations import place_index

    times, run_dir = {}, tempfile.mkdtemp(prefix="bench-counts-")
    namespace = f"benchcounts{os.getpid()}"
    t0 = time.perf_counter()
    ckpt, plan = loader.prepare(checkpoint)
    n_tensors = len(ckpt.tensors)
    t1 = time.perf_counter()
    built = loader.build(ckpt, plan, namespace=namespace, generation=1, device="cpu")
    t2 = time.perf_counter()
    del ckpt, plan  # as the daemon's build job ends: the published generation keeps its index, not the plan
    place = None
    try:
        place = place_index(built.index)
        t3 = time.perf_counter()
        publish(built.index, os.path.join(run_dir, "index.json"))
        t4 = time.perf_counter()
        ledger.write(run_dir, built, "load", ledger.build_conditions(checkpoint, None, built.index.shm_dir))
        t5 = time.perf_counter()
    finally:
        if place is not None:
            unlink_segment(place["segment"], built.index.shm_dir)
        built.close()
        shutil.rmtree(run_dir)
    for name, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
        times[name] = b - a
    return times, n_tensors


def fresh_phases(checkpoint: str, warmup: str) -> tuple[dict[str, float], int]:
    """`phases` in a fresh process, as a daemon loads (its heap, and so its garbage collections, as at a start),
    after planning `warmup` there (transformers' modeling code imported: not a cost of either checkpoint)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--phases-of", checkpoint, "--warmup", warmup],
                         check=True, capture_output=True, text=True).stdout
    times, n_tensors = json.loads(out.splitlines()[-1])
    return times, n_tensors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases-of", help=argparse.SUPPRESS)  # one fresh process's measurement (see fresh_phases)
    ap.add_argument("--warmup", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--counts-checkpoint", help="a checkpoint with many tensors (default: generated dsv3-counts)")
    ap.add_argument("--bytes-checkpoint", help="about the same bytes in few tensors (default: generated dsv3-bytes)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.phases_of:
        from expertd.server.load import loader

        loader.prepare(args.warmup)[0].close()
        gc.collect()  # what the imports left young (~270k objects) is collected once in any daemon, whatever it loads
        print(json.dumps(phases(args.phases_of)))
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    counts = args.counts_checkpoint or ensure_preset(args.workdir, "dsv3-counts-163", "dsv3-counts", 163)
    few = args.bytes_checkpoint or ensure_preset(args.workdir, "dsv3-bytes", "dsv3-bytes", 4)
    if os.path.realpath(counts) == os.path.realpath(few):
        raise SystemExit("give two different checkpoints: --counts-checkpoint and --bytes-checkpoint")
    for path in (counts, few):
        warm(path)
    best: dict[str, dict[str, float]] = {counts: {}, few: {}}
    sizes = {}
    for rep in range(args.reps):
        for path in (counts, few) if rep % 2 == 0 else (few, counts):
            times, sizes[path] = fresh_phases(path, few)
            for name, t in times.items():
                best[path][name] = min(t, best[path].get(name, t))
    imports = imports_seconds(args.reps)
    print(machine())
    print(f"\nphases, a fresh process each (best of {args.reps}, alternating); imports: {imports:.2f} s\n")
    print("| checkpoint | tensors | " + " | ".join(PHASES) + " | publish (index + JSON + ledger) | total |")
    print("|---|---:|" + "---:|" * (len(PHASES) + 2))
    total = {}
    for path in (counts, few):
        b = best[path]
        total[path] = sum(b.values())
        publish = b["index"] + b["JSON"] + b["ledger"]
        print(f"| {os.path.basename(path)} | {sizes[path]:,} | " + " | ".join(f"{b[n]:.3f} s" for n in PHASES)
              + f" | {publish:.3f} s | {total[path]:.2f} s |")
    n = sizes[counts]
    print("\nbeyond the bytes, per checkpoint tensor: " + ", ".join(
        f"{n_}: {(best[counts][n_] - best[few][n_]) / n * 1e6:.1f} us" for n_ in PHASES))
    per = (total[counts] - total[few]) / n * 1e6
    publish = sum(best[counts][k] for k in ("index", "JSON", "ledger"))
    print(f"\n**{per:.1f} us** per checkpoint tensor beyond the bytes (goal <= 30); publish at {n:,} tensors "
          f"**{publish:.3f} s** (goal <= 0.2); counts / bytes {total[counts] / total[few]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
