"""The loader's scaling with threads, against the fill limit measured beside it in the same run.

    python benchmarks/bench_loader.py [--workdir /tmp/expertd-bench] [--threads 1,2,...] [--reps 3]
        [--checkpoint DIR] [--counts-checkpoint DIR --bytes-checkpoint DIR] [--only L1|L2|L3 ...]

The checkpoints are generated into --workdir on first use; --checkpoint (L1, L2) and the L3 pair
measure checkpoints of your own instead (any the daemon serves).

L1  at each thread count t: loader GB/s (bf16 out: `build` of the ~1 GB DeepSeek-V3-shaped FP8 checkpoint,
    page cache warm) / fill GB/s (t threads posix_fallocate + copy the same bytes into fresh shared-memory
    segments, one per served tensor, as the loader makes them). Goal >= 0.8 at every t.
L3  start-to-serving (`expertd start` until status says serving: process start, imports, validation,
    load, index) of DeepSeek-V3's real tensor counts at tiny dims (`--preset dsv3-counts --shards 163`:
    61 layers, 256 routed experts, first 3 dense, MTP layer 61; ~92k checkpoint tensors) / the same of
    about the same bytes in ~70 tensors (`--preset dsv3-bytes`). Goal <= 2. Also printed: the extra per
    checkpoint tensor (issue 30: <= 30 us); `bench_counts.py` breaks it down by phase (plan, build, publish).
--python-share: a single-threaded build's Python CPU seconds (loader thread outside the compiled calls, main thread):
    many threads take turns on the GIL for it, so bytes / those seconds bound the loader at any thread count.
L2  reading every checkpoint tensor (hash only, t threads): page faults through the shard mappings vs
    madvise(MADV_POPULATE_READ) first vs os.preadv into a reused buffer: GB/s read each.

Each loader run is checked bit-exact against the single-threaded run's index (same checksums, same
segment numbering). Torch's own intra-op threads are set to 1: every thread counted is one the
benchmark asked for.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_generations import ensure_big  # noqa: E402
from helpers.daemon import DaemonProcess, expertd_cmd  # noqa: E402
from run_all import machine  # noqa: E402

CHUNK = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
MADV_POPULATE_READ = 22


def warm(folder: str) -> None:
    """Read every file of a checkpoint folder once: the page cache then holds it."""
    for name in sorted(os.listdir(folder)):
        if not os.path.isfile(os.path.join(folder, name)):
            continue
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(1 << 24):
                pass


def run_threads(threads: int, work: list, fn) -> float:
    """Seconds for `threads` threads to take items of `work` in order and run fn on each."""
    lock, items = threading.Lock(), iter(work)

    def loop() -> None:
        while True:
            with lock:
                item = next(items, None)
            if item is None:
                return
            fn(item)

    pool = [threading.Thread(target=loop) for _ in range(threads)]
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return time.perf_counter() - t0


def fill_once(plan, threads: int, src: torch.Tensor, how: str = "map") -> float:
    """Seconds to place the plan's bytes in fresh shared memory with t threads: the segments created (one per
    served tensor, as the loader makes them), each part posix_fallocate'd and copied in, through the mapping
    (`how="map"`) or with pwrite from memory (`"pwrite"`, as the loader writes on tmpfs), the threads taking
    turns among as many tensors as the loader's do, the writable mappings dropped: the loader's work without
    reading, dequantizing or hashing."""
    from expertd.server.shm.arena import Arena
    from expertd.server.load.building import TURNS_PER_THREAD, interleave

    arena = Arena(f"benchfill{os.getpid()}", 1)
    try:
        t0 = time.perf_counter()
        streams = []
        for slot, planned in enumerate(plan.tensors):
            where = arena.add(planned.nbytes, slot, reserve=False)
            base = arena._fds[where.segment][1]
            n = max(1, len(planned.sources))
            step = planned.nbytes // n
            streams.append([(where, k * step, step, base) for k in range(n)])

        def one(item) -> None:
            where, offset, nbytes, base = item
            arena.reserve(where, offset, nbytes, populate=False)
            for b0 in range(0, nbytes, CHUNK):
                at, size = src.data_ptr() + (offset + b0) % (src.numel() - CHUNK), min(CHUNK, nbytes - b0)
                if how == "map":
                    ctypes.memmove(base + offset + b0, at, size)
                else:
                    arena.pwrite(where, offset + b0, memoryview((ctypes.c_char * size).from_address(at)).cast("B"))

        run_threads(threads, list(interleave(streams, threads * TURNS_PER_THREAD)), one)
        arena.unmap()
        return time.perf_counter() - t0
    finally:
        arena.unmap()
        arena.unlink()


def load_once(checkpoint: str, threads: int, device: str = "cpu", per_chunk: bool = False) -> tuple[float, list]:
    """Seconds to build the checkpoint on `device` with `threads` threads (`per_chunk`: the Python path chunk by
    chunk that whole-task compiled calls replaced, for comparison), and the layout it made."""
    from expertd.server.load import gpu_parts, native_parts
    from expertd.server.load.loader import build, prepare

    ckpt, plan = prepare(checkpoint)
    usable = native_parts.usable, gpu_parts.usable
    if per_chunk:
        native_parts.usable = gpu_parts.usable = lambda device: False
    try:
        t0 = time.perf_counter()
        built = build(ckpt, plan, namespace=f"benchload{os.getpid()}", generation=1, threads=threads, device=device)
        elapsed = time.perf_counter() - t0
    finally:
        native_parts.usable, gpu_parts.usable = usable
    built.close()
    return elapsed, [(t.segment.split(".")[3], t.checksum) for t in built.index.tensors]  # K of NS.PID.GEN.K.RANDOM


def python_seconds(checkpoint: str, reps: int) -> tuple[float, float]:
    """CPU seconds of Python per single-threaded build (medians of `reps`): on the loader's thread outside the compiled
    calls, and on the main thread. What many threads take turns on (the GIL): bytes / their sum bounds any count."""
    from expertd.kernels import native
    from expertd.server.load import building
    from expertd.server.load.loader import build, prepare

    spent = {"task": 0.0, "compiled": 0.0}
    fill, fill_batch = building.fill, native.fill_batch

    def timed(key, fn):
        def run(*args):
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[key] += time.thread_time() - t0
        return run

    building.fill, native.fill_batch = timed("task", fill), timed("compiled", fill_batch)
    worker, main = [], []
    try:
        for _ in range(reps):
            spent.update(task=0.0, compiled=0.0)
            ckpt, plan = prepare(checkpoint)
            t0 = time.thread_time()
            built = build(ckpt, plan, namespace=f"benchpy{os.getpid()}", generation=1, threads=1, device="cpu")
            main.append(time.thread_time() - t0)
            built.close()
            worker.append(spent["task"] - spent["compiled"])
    finally:
        building.fill, native.fill_batch = fill, fill_batch
    return sorted(worker)[len(worker) // 2], sorted(main)[len(main) // 2]


def read_once(opened, threads: int, mode: str) -> float:
    """t threads hash every FP8 source: through page faults, after MADV_POPULATE_READ, or via preadv."""
    from expertd.index import checksum, tensor_bytes
    from expertd.server.load.checkpoint import Checkpoint

    ckpt = Checkpoint(opened.folder, opened.config, opened.tensors)  # fresh mappings each run
    sources = [info for info in opened.tensors.values()]
    local = threading.local()
    fds: dict[str, int] = {}
    if mode == "preadv":
        for info in sources:
            if info.file not in fds:
                fds[info.file] = os.open(info.file, os.O_RDONLY)

    def one(info) -> None:
        if mode == "preadv":
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(CHUNK)
            view = memoryview(buf)
            for b0 in range(0, info.nbytes, CHUNK):
                n = os.preadv(fds[info.file], [view[: min(CHUNK, info.nbytes - b0)]], info.offset + b0)
                checksum(view[:n])
            return
        data = ckpt.view(info)
        if mode == "populate" and data.numel():
            addr = data.data_ptr() & ~4095
            _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(data.data_ptr() + info.nbytes - addr),
                          MADV_POPULATE_READ)
        checksum(tensor_bytes(data))

    try:
        return run_threads(threads, sources, one)
    finally:
        for fd in fds.values():
            os.close(fd)
        ckpt.close()


def ensure_preset(workdir: str, name: str, preset: str, shards: int) -> str:
    path = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        print(f"generating {name} (once) ...", flush=True)
        subprocess.run(expertd_cmd("generate", path, "--preset", preset, "--shards", str(shards)), check=True,
                       stdout=subprocess.DEVNULL)
    return path


def start_to_serving(workdir: str, checkpoint: str, tag: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    daemon = DaemonProcess.launch(os.path.join(workdir, f"start-{tag}"), checkpoint, f"benchstart{tag}{os.getpid()}",
                                  stdout=subprocess.DEVNULL)
    try:
        status = daemon.wait_serving(timeout=900)
        return time.perf_counter() - t0, status
    finally:
        daemon.stop()


def l3_counts(workdir: str, reps: int, counts: str | None = None, few: str | None = None) -> None:
    from expertd.server.load.loader import prepare

    counts = counts or ensure_preset(workdir, "dsv3-counts-163", "dsv3-counts", 163)
    few = few or ensure_preset(workdir, "dsv3-bytes", "dsv3-bytes", 4)
    sizes = {}
    for path in (counts, few):
        warm(path)
        ckpt, plan = prepare(path)
        sizes[path] = (plan.nbytes, len(ckpt.tensors), len(plan.tensors), len(os.listdir(path)))
        ckpt.close()
    if counts == few:
        raise SystemExit("L3 compares two different checkpoints: give --counts-checkpoint and --bytes-checkpoint apart")
    times = {counts: [], few: []}
    for rep in range(reps):
        for path in ((counts, few) if rep % 2 == 0 else (few, counts)):
            times[path].append(start_to_serving(workdir, path, "c" if path == counts else "f")[0])
    t_counts, t_few = min(times[counts]), min(times[few])
    print("\nstart-to-serving, real daemon (best of %d, alternating):\n" % reps)
    print("| checkpoint | bf16 bytes | checkpoint tensors | served tensors | files | start-to-serving |")
    print("|---|---|---|---|---|---|")
    for path, t in ((counts, t_counts), (few, t_few)):
        nbytes, n_ckpt, n_served, files = sizes[path]
        print(f"| {os.path.basename(path)} | {nbytes / 1e6:.1f} MB | {n_ckpt:,} | {n_served:,} | {files} | {t:.2f} s |")
    per = (t_counts - t_few) / max(1, sizes[counts][1] - sizes[few][1]) * 1e6
    print(f"\nL3 ratio **{t_counts / t_few:.2f}** (goal <= 2); extra per checkpoint tensor {per:.0f} us", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1..cores)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=("L1", "L2", "L3"), action="append", help="run only these (default: all)")
    ap.add_argument("--checkpoint", help="L1 and L2 on this checkpoint (default: the generated ~1 GB one)")
    ap.add_argument("--per-chunk", action="store_true",
                    help="L1: also the per-chunk Python path the whole-task compiled calls replaced (before / after)")
    ap.add_argument("--cuda", action="store_true", help="L1: also `device: cuda` builds (same layout and checksums)")
    ap.add_argument("--python-share", action="store_true",
                    help="the Python CPU time of a build and the GB/s it bounds any thread count to")
    ap.add_argument("--counts-checkpoint", help="L3: a checkpoint with many tensors (default: generated dsv3-counts)")
    ap.add_argument("--bytes-checkpoint",
                    help="L3: about the same bytes in few tensors (default: generated dsv3-bytes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from expertd.procfs import default_threads
    from expertd.server.load.loader import prepare

    cores = default_threads()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else list(range(1, cores + 1))
    os.makedirs(args.workdir, exist_ok=True)
    checkpoint = args.checkpoint or ensure_big(args.workdir)
    warm(checkpoint)
    ckpt, plan = prepare(checkpoint)
    src = torch.empty(plan.nbytes // 2 + CHUNK * 2, dtype=torch.uint8).fill_(7)
    fp8 = sum(info.nbytes for info in ckpt.tensors.values())
    print(machine())
    print(f"checkpoint {checkpoint}: {plan.nbytes / 1e9:.2f} GB bf16 out, {fp8 / 1e9:.2f} GB read "
          f"(every checkpoint tensor), {len(plan.tensors)} served tensors\n")
    only = set(args.only or ("L1", "L2", "L3"))
    if "L3" in only:
        l3_counts(args.workdir, args.reps, args.counts_checkpoint, args.bytes_checkpoint)
    reference = None
    if "L1" in only:
        extra = [name for name, on in (("per-chunk path", args.per_chunk), ("device: cuda", args.cuda)) if on]
        print("\n| threads | fill GB/s (fallocate + copy through the mapping) | loader GB/s | loader / fill | goal "
              "| fill by pwrite GB/s | loader / that |" + "".join(f" {e} GB/s | {e} / fill |" for e in extra))
        print("|---|---|---|---|---|---|---|" + "---|---|" * len(extra))
    for t in counts if "L1" in only else ():
        kinds = ("map", "pwrite", "load") + (("chunk",) if args.per_chunk else ()) + (("cuda",) if args.cuda else ())
        runs: dict[str, list] = {k: [] for k in kinds}
        for rep in range(args.reps):  # in turn first, second, third: a run after one that freed pages is faster
            for what in [kinds[(rep + k) % len(kinds)] for k in range(len(kinds))]:
                if what in ("map", "pwrite"):
                    runs[what].append(fill_once(plan, t, src, what))
                    continue
                elapsed, layout = load_once(checkpoint, t, "cuda" if what == "cuda" else "cpu", what == "chunk")
                runs[what].append(elapsed)
                if reference is None:
                    reference = layout
                elif layout != reference:
                    raise SystemExit(f"{what} loader output at {t} threads differs from the first run: not "
                                     "deterministic")
        gbps = {k: plan.nbytes / min(runs[k]) / 1e9 for k in kinds}
        fill_gbps, pw_gbps, load_gbps = gbps["map"], gbps["pwrite"], gbps["load"]
        print(f"| {t} | {fill_gbps:.2f} | {load_gbps:.2f} | **{load_gbps / fill_gbps:.2f}** | >= 0.8 | {pw_gbps:.2f} | "
              f"{load_gbps / pw_gbps:.2f} |" + "".join(f" {gbps[k]:.2f} | {gbps[k] / fill_gbps:.2f} |"
                                                        for k in kinds[3:]), flush=True)
    if args.python_share:
        worker, main = python_seconds(checkpoint, max(3, args.reps))
        print(f"\nPython per build (CPU s, 1 thread, median; system calls included): loader thread outside the "
              f"compiled calls {worker * 1e3:.0f} ms, main thread {main * 1e3:.0f} ms: at most "
              f"{plan.nbytes / (worker + main) / 1e9:.1f} GB/s at any thread count while the GIL is the one lock they "
              "share", flush=True)
    if "L2" in only:
        print("\nreading every checkpoint tensor, hash only (GB/s read):\n")
        print("| threads | page faults | MADV_POPULATE_READ | preadv |")
        print("|---|---|---|---|")
    for t in counts if "L2" in only else ():
        best = {m: min(read_once(ckpt, t, m) for _ in range(args.reps)) for m in ("fault", "populate", "preadv")}
        print(f"| {t} | " + " | ".join(f"{fp8 / best[m] / 1e9:.2f}" for m in ("fault", "populate", "preadv")) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
