"""Segments on 4 KiB pages vs huge pages: a tmpfs mounted huge=never vs one mounted huge=always.

    sudo python benchmarks/bench_hugepages.py [--gib 1.0] [--reps 3]

Runs as root: it re-executes itself inside a private mount namespace (`unshare -m`) with two fresh
tmpfs mounts, so nothing is mounted on the host and both go when it ends. For each mount, in the
same run, on the same ~1 GB of MoE expert weights (bf16 gate_up [2I, H] and down [H, I] per expert,
each tensor a segment of its own, as the daemon places them):

H1  fill, --reps times each, alternating: the daemon's path on tmpfs (Arena.add, posix_fallocate, the bytes
    written with pwrite, as the loader writes them) and through the mapping (Arena.add with its
    posix_fallocate and a copy into the writable mapping, as on hugetlbfs and for the GPU path). The
    first fill of each fresh mount is reported apart: its pages are ones the mount never had.
H2  first touch: a worker's fresh read-only mappings, one byte read per 4 KiB (the page faults it pays)
H3  expert forward: x[16, H] @ gate_up.T, SiLU-and-mul, @ down.T for every expert; the first pass over
    fresh (cold) mappings, and the steady state (median of --reps further passes)
H4  the loader: `build` of the ~1 GB DeepSeek-V3-shaped FP8 checkpoint (page cache warm, every core) into
    each mount, --reps times, alternating; the first build into each mount reported apart. --no-loader
    skips it; --workdir is where the checkpoint is generated on first use (as bench_loader.py does);
    --checkpoint DIR loads one of your own instead.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

HIDDEN, INTER, TOKENS = 2048, 512, 16
INSIDE = "EXPERTD_BENCH_HUGEPAGES_INSIDE"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) / 2**20
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, kernel {platform.release()}; "
            f"Python {platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads)")


def meminfo(key: str) -> int:
    return int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith(key + ":")))


def expert_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
    down = (torch.randn(HIDDEN, INTER, generator=gen) * 0.02).to(torch.bfloat16)
    return gate_up, down


def fill(shm_dir: str, experts: int, how: str) -> tuple[object, float, int]:
    """H1: every expert's two tensors into fresh segments, `how` = "pwrite" (the daemon's path on tmpfs)
    or "map" (a copy through the writable mapping); returns the arena, seconds and huge-page kB used."""
    from expertd.server.shm.arena import Arena

    weights = [(w, memoryview(w.view(torch.uint8).reshape(-1).numpy())) for w in expert_weights()]
    arena = Arena(f"bench{uuid.uuid4().hex[:8]}", 1, shm_dir=shm_dir)
    huge_before = meminfo("ShmemHugePages")
    try:
        started = time.perf_counter()
        for _ in range(experts):
            for src, data in weights:
                if how == "pwrite":
                    where = arena.add(src.nbytes, reserve=False)
                    arena.reserve(where, 0, src.nbytes, populate=False)
                    arena.pwrite(where, 0, data)
                else:
                    arena.tensor(arena.add(src.nbytes), tuple(src.shape), src.dtype).copy_(src)
        seconds = time.perf_counter() - started
        arena.unmap()
    except BaseException:
        arena.unlink()
        raise
    return arena, seconds, meminfo("ShmemHugePages") - huge_before


def map_all(arena) -> list:
    from expertd.segments import map_segment

    return [map_segment(s.name, s.nbytes, shm_dir=arena.shm_dir) for s in arena.segments]


def first_touch(arena) -> float:
    """H2: fresh read-only mappings of every segment, one byte read per 4 KiB page."""
    started = time.perf_counter()
    maps = map_all(arena)
    total = 0
    for m in maps:
        total += int(np.frombuffer(m, dtype=np.uint8)[::4096].sum())
    seconds = time.perf_counter() - started
    for m in maps:
        m.close()
    return seconds


def expert_pass(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> float:
    started = time.perf_counter()
    out = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)
    for gate_up, down in weights:
        h = x @ gate_up.T
        out += (torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]) @ down.T
    return time.perf_counter() - started


def forward(arena, reps: int) -> tuple[float, float]:
    """H3: the first pass over fresh mappings (page faults included), then the steady state."""
    from expertd.shm import segment_bytes

    maps = map_all(arena)
    views = [segment_bytes(m) for m in maps]
    weights = []
    for i in range(0, len(views), 2):
        gate_up = views[i][: 2 * INTER * HIDDEN * 2].view(torch.bfloat16).view(2 * INTER, HIDDEN)
        down = views[i + 1][: HIDDEN * INTER * 2].view(torch.bfloat16).view(HIDDEN, INTER)
        weights.append((gate_up, down))
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        first = expert_pass(weights, x)
        steady = statistics.median(expert_pass(weights, x) for _ in range(reps))
    return first, steady


def fills(shm_dir: str, experts: int, reps: int) -> tuple[dict, object, int]:
    """H1, --reps times each way, alternating, the daemon's path first: the very first fill of the fresh
    mount is reported apart (it takes pages this mount never had), the rest as medians. The last fill is
    kept for H2 and H3."""
    seconds = {"pwrite": [], "map": []}
    for rep in range(reps):
        for how in ("pwrite", "map"):
            arena, took, huge_kb = fill(shm_dir, experts, how)
            seconds[how].append(took)
            if how == "map" and rep == reps - 1:
                first, later = seconds["pwrite"][0], seconds["pwrite"][1:] or seconds["pwrite"]
                fill_s = {"first": first, "pwrite": statistics.median(later), "map": statistics.median(seconds["map"])}
                return fill_s, arena, huge_kb
            arena.unlink()
    raise ValueError("reps must be >= 1")


def measure(label: str, shm_dir: str, experts: int, reps: int) -> dict:
    fill_s, arena, huge_kb = fills(shm_dir, experts, reps)
    try:
        nbytes = arena.nbytes
        touch = statistics.median(first_touch(arena) for _ in range(reps))
        first, steady = forward(arena, reps)
    finally:
        arena.unlink()
    gb = nbytes / 1e9
    print(f"  {label}: {nbytes / 2**30:.2f} GiB in {len(arena.segments)} segments, "
          f"{huge_kb / 2**10:.0f} MiB in huge pages", flush=True)
    return {"gb": gb, "fill_first": gb / fill_s["first"], "fill": gb / fill_s["pwrite"], "fill_map": gb / fill_s["map"],
            "touch_ms": touch * 1e3, "touch_per_gb": touch * 1e3 / gb,
            "first_ms": first * 1e3, "steady_ms": steady * 1e3}


def loader(checkpoint: str, dirs: dict[str, str], reps: int) -> dict[str, dict]:
    """H4: the loader's build of `checkpoint` into each folder, alternating; GB/s of bf16 placed."""
    from bench_loader import warm

    from expertd.server.load.loader import build, prepare

    ckpt, plan = prepare(checkpoint)
    warm(checkpoint)  # page cache warm
    seconds: dict[str, list[float]] = {label: [] for label in dirs}
    try:
        for _ in range(reps):
            for label, shm_dir in dirs.items():
                started = time.perf_counter()
                built = build(ckpt, plan, namespace=f"bench{uuid.uuid4().hex[:8]}", generation=1, device="cpu",
                              shm_dir=shm_dir)
                seconds[label].append(time.perf_counter() - started)
                built.close()
    finally:
        ckpt.close()
    gb = plan.nbytes / 1e9
    return {label: {"first": gb / took[0], "later": gb / statistics.median(took[1:] or took)}
            for label, took in seconds.items()}


def table(small: dict, huge: dict) -> str:
    rows = [
        ("H1 first fill of the fresh mount, the daemon's path (fallocate + pwrite), GB/s", "fill_first", "{:.2f}",
         False),
        ("H1 fill, the daemon's path, later fills (median), GB/s", "fill", "{:.2f}", False),
        ("H1 fill through the mapping (fallocate + copy; hugetlbfs, GPU path), median, GB/s", "fill_map", "{:.2f}",
         False),
        ("H2 first touch, ms per GB", "touch_per_gb", "{:.1f}", True),
        ("H2 first touch, ms total", "touch_ms", "{:.1f}", True),
        ("H3 expert forward, first pass (cold mappings), ms", "first_ms", "{:.0f}", True),
        ("H3 expert forward, steady state, ms", "steady_ms", "{:.0f}", True),
        ("H4 loader, first build into the fresh mount, GB/s of bf16", "load_first", "{:.2f}", False),
        ("H4 loader, later builds (median), GB/s of bf16", "load", "{:.2f}", False),
    ]
    lines = ["| | 4 KiB pages (huge=never) | huge pages (huge=always) | gain |", "|---|---:|---:|---:|"]
    for name, key, fmt, lower_is_better in rows:
        if key not in small:
            continue
        ratio = small[key] / huge[key] if lower_is_better else huge[key] / small[key]
        lines.append(f"| {name} | {fmt.format(small[key])} | {fmt.format(huge[key])} | {ratio:.2f}x |")
    return "\n".join(lines)


def inside(args) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    per_expert = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    experts = max(1, int(args.gib * 2**30 / per_expert))
    print(f"machine: {machine()}")
    print(f"weights: {experts} experts x (gate_up [{2 * INTER}, {HIDDEN}] + down [{HIDDEN}, {INTER}]) bf16, "
          f"x [{TOKENS}, {HIDDEN}]; {args.reps} reps (medians)", flush=True)
    small = measure("4 KiB pages", args.small_dir, experts, args.reps)
    huge = measure("huge pages", args.huge_dir, experts, args.reps)
    if args.checkpoint:
        loads = loader(args.checkpoint, {"small": args.small_dir, "huge": args.huge_dir}, args.reps)
        for result, label in ((small, "small"), (huge, "huge")):
            result["load_first"], result["load"] = loads[label]["first"], loads[label]["later"]
        print(f"  H4 checkpoint: {args.checkpoint} (FP8), {torch.get_num_threads()} load threads")
    print()
    print(table(small, huge))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the expert weights (default 1 GiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/expertd-bench", help="where H4's checkpoint is generated (once)")
    ap.add_argument("--no-loader", action="store_true", help="skip H4 (the loader into each mount)")
    ap.add_argument("--checkpoint", help="H4 loads this checkpoint (default: the generated ~1 GB one)")
    ap.add_argument("--small-dir", help=argparse.SUPPRESS)
    ap.add_argument("--huge-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.environ.get(INSIDE):
        inside(args)
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        sys.exit("bench_hugepages.py needs root and util-linux unshare (it mounts two tmpfs in a private mount "
                 "namespace)")
    checkpoint, mib = None, int(args.gib * 1.5 * 1024) + 256
    if not args.no_loader:
        if args.checkpoint:
            checkpoint = os.path.abspath(args.checkpoint)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from bench_generations import ensure_big

            checkpoint = ensure_big(args.workdir)
        fp8 = sum(os.path.getsize(os.path.join(checkpoint, n)) for n in os.listdir(checkpoint)
                  if os.path.isfile(os.path.join(checkpoint, n)))
        mib = max(mib, int(fp8 * 2.5 / 2**20) + 256)  # bf16 out, small tensors rounded up to huge pages
    work = tempfile.mkdtemp(prefix="expertd-bench-hugepages-")
    small, huge = os.path.join(work, "small"), os.path.join(work, "huge")
    os.mkdir(small)
    os.mkdir(huge)
    size = f"{mib}m"
    script = (f"mount -t tmpfs -o size={size},huge=never expertd-bench {small} && "
              f"mount -t tmpfs -o size={size},huge=always expertd-bench {huge} && "
              f'exec "$@"')
    cmd = [sys.executable, os.path.abspath(__file__), "--gib", str(args.gib), "--reps", str(args.reps),
           "--small-dir", small, "--huge-dir", huge] + (["--checkpoint", checkpoint] if checkpoint else [])
    try:
        rc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *cmd],
                            env={**os.environ, INSIDE: "1"}).returncode
    finally:
        os.rmdir(small)
        os.rmdir(huge)
        os.rmdir(work)
    sys.exit(rc)


if __name__ == "__main__":
    main()
