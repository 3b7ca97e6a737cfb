"""A changed expert costs its own bytes (issue 39), measured side by side in one run.

    python benchmarks/bench_expert_ranges.py [--workdir /tmp/expertd-bench-ranges] [--layers 2] [--experts 64]
                                             [--hidden 2048] [--moe-intermediate 1024] [--reps 3]

A Qwen3-MoE bf16 checkpoint (`expertd generate`'s writer; each expert's gate, up and down parts are whole pages), by
default at OLMoE-1B-7B's expert dims (64 experts, hidden 2048, moe_intermediate 1024: a 512 MiB gate/up stack), is
served by two daemons in turn: one with `expert_ranges: true` (a push writes the changed experts only) and one
without (a push writes the whole stack, as before). On each, per rep, pushes through the Python client:
R1  1 expert (its gate/up, a checkpoint name) of one layer's stack: the shm growth (bytes of new segments in
    /dev/shm, index segment included) / that expert's bytes, and the publish time (`update()`, stage to published)
    with ranges / without (a whole layer's stack rewritten);
R2  k experts spread over several layers (k = 1, 4, 16): shm growth and publish time, to show they scale with k;
R3  the reader's side: `refresh()` of a client that maps every served tensor, and its count of mappings
    (/proc/self/maps lines) after the pushes.
Medians of --reps; every ratio is of two figures measured in this run.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import sys
import time
import uuid

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from helpers.daemon import DaemonProcess  # noqa: E402
from run_all import machine  # noqa: E402


def generated(args, name: str, make) -> str:
    """The checkpoint folder `name` under --workdir, made by `make(folder)` unless an earlier run left it there
    (this benchmark's and bench_expert_ranges_counts.py's)."""
    folder = os.path.join(args.workdir, name)
    if not os.path.exists(os.path.join(folder, "config.json")):
        make(folder)
    return folder


def checkpoint(args) -> str:
    from expertd.tools.generate import generate_model_type

    return generated(args, f"qwen3moe-{args.layers}x{args.experts}-{args.hidden}-{args.moe_intermediate}",
                     lambda folder: generate_model_type(
                         folder, "qwen3_moe", fp8=False, max_shard_size="2GB", num_hidden_layers=args.layers,
                         num_local_experts=args.experts, hidden_size=args.hidden,
                         moe_intermediate_size=args.moe_intermediate))


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@contextlib.contextmanager
def ranged_daemon(folder: str, args, ranges: bool, timeout: float, **launch):
    """A fresh daemon on `folder` (`expert_ranges: ranges`, a namespace of its own, under --workdir), once it
    serves; afterwards stopped and whatever of its namespace is left in /dev/shm removed (this benchmark's and
    bench_expert_ranges_counts.py's)."""
    namespace = f"edtbench{uuid.uuid4().hex[:8]}"
    daemon = DaemonProcess.launch(os.path.join(args.workdir, "daemon"), folder, namespace, expert_ranges=ranges,
                                  revoke_after_s=0, **launch)
    try:
        daemon.wait_serving(timeout=timeout)
        yield daemon
    finally:
        daemon.stop()
        for path in glob.glob(f"/dev/shm/{namespace}*"):
            os.unlink(path)


def run(folder: str, args, ranges: bool) -> dict:
    """Pushes on a fresh daemon (`expert_ranges: ranges`): R1 and R2, then R3 around one more push."""
    from expertd.client import ExpertClient

    out = {"one": [], "k": {}}
    with ranged_daemon(folder, args, ranges, timeout=900, max_generations=3) as daemon, \
            ExpertClient(daemon.endpoint, heartbeat=False) as pusher:
        names = pusher.tensors()
        ups = [n for n in names if ".experts." in n and n.endswith("up_proj.weight")]
        expert = next(n for n in ups if ".layers.0." in n)
        out["expert_bytes"] = names[expert].numel() * names[expert].element_size()
        for rep in range(args.reps):
            out["one"].append(push(pusher, daemon, {expert: names[expert] * (-1) ** (rep + 1)}))
        for k in (1, 4, 16):  # spread over every layer's stack; new values each time (a push of what is
            chosen = ups[1:: max(1, len(ups) // k)][:k]  # served changes nothing)
            out["k"][k] = push(pusher, daemon, {n: names[n] * (k + 1) for n in chosen})
        with ExpertClient(daemon.endpoint, heartbeat=False) as reader:
            held = reader.served_tensors()  # a reader mapping every served tensor
            push(pusher, daemon, {expert: names[expert] * 3})
            t0 = time.perf_counter()
            reader.refresh()
            held = reader.served_tensors()
            out["refresh_s"], out["maps"] = time.perf_counter() - t0, mappings()
            del held
    return out


def push(client, daemon, values: dict) -> dict:
    """`update(values)` timed; the bytes of the segments it created (index segment apart)."""
    before = set(glob.glob(f"/dev/shm/{daemon.namespace}.*"))
    t0 = time.perf_counter()
    client.update(values)
    seconds = time.perf_counter() - t0
    index = "/dev/shm" + daemon.status()["index_segment"]
    made = set(glob.glob(f"/dev/shm/{daemon.namespace}.*")) - before - {index}
    client.refresh()
    return {"seconds": seconds, "grown": sum(os.path.getsize(p) for p in made if os.path.exists(p)),
            "index": os.path.getsize(index)}


def options(doc: str, workdir: str, hidden: int, moe_intermediate: int) -> argparse.ArgumentParser:
    """The options this benchmark and bench_expert_ranges_counts.py both take: --workdir, and the experts' dims."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--workdir", default=workdir)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--moe-intermediate", type=int, default=moe_intermediate)
    return parser


def side_by_side(parser: argparse.ArgumentParser, checkpoint, run, title) -> tuple:
    """What this benchmark and bench_expert_ranges_counts.py both do: parse the options, make --workdir and
    `checkpoint(args)` there, print the machine and `title(args)`, then `run(folder, args, ranges)` on a daemon
    without `expert_ranges` and then on one with it. (args, whole's result, ranged's)."""
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    folder = checkpoint(args)
    print(f"# {machine()}")
    print(f"# {title(args)}")
    return args, run(folder, args, ranges=False), run(folder, args, ranges=True)


def main() -> None:
    parser = options(__doc__, "/tmp/expertd-bench-ranges", hidden=2048, moe_intermediate=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args, whole, ranged = side_by_side(
        parser, checkpoint, run, lambda args: f"Qwen3-MoE {args.layers} layers x {args.experts} experts, hidden "
        f"{args.hidden}, moe_intermediate {args.moe_intermediate} (bf16); medians of {args.reps}")
    part = ranged["expert_bytes"]
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    print("| | expert_ranges: true | false (the whole stack) | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| R1 shm growth, 1 expert's part ({part / 2**20:.2f} MiB) | {med(ranged['one'], 'grown') / 2**20:.2f} MiB "
          f"({med(ranged['one'], 'grown') / part:.2f} x the part) | {med(whole['one'], 'grown') / 2**20:.2f} MiB | "
          f"{med(ranged['one'], 'grown') / med(whole['one'], 'grown'):.3f} |")
    print(f"| R1 publish (`update()`) | {med(ranged['one'], 'seconds'):.3f} s | {med(whole['one'], 'seconds'):.3f} s | "
          f"{med(ranged['one'], 'seconds') / med(whole['one'], 'seconds'):.3f} |")
    for k in (1, 4, 16):
        r, w = ranged["k"][k], whole["k"][k]
        print(f"| R2 {k} expert part(s) over layers: growth / publish | {r['grown'] / 2**20:.2f} MiB / "
              f"{r['seconds']:.3f} s | {w['grown'] / 2**20:.2f} MiB / {w['seconds']:.3f} s | "
              f"{r['grown'] / w['grown']:.3f} / {r['seconds'] / w['seconds']:.3f} |")
    print(f"| R3 reader's refresh / its mappings | {ranged['refresh_s']:.3f} s / {ranged['maps']} | "
          f"{whole['refresh_s']:.3f} s / {whole['maps']} | |")
    grown = med(ranged["one"], "grown") + med(ranged["one"], "index")
    goal = grown <= 1.2 * part + med(ranged["one"], "index")
    print(f"GOAL shm growth {grown / 2**20:.2f} MiB (index segment included) <= 1.2x the expert's bytes plus the "
          f"index: {'met' if goal else 'MISSED'}")
    fast = med(ranged["one"], "seconds") <= 0.2 * med(whole["one"], "seconds")
    print(f"GOAL publish <= 0.2x a whole layer's: {'met' if fast else 'MISSED'}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
