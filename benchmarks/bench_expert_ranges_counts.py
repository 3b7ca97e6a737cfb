"""A changed expert costs its own bytes at DeepSeek-V3's counts (issue 39): 16 generations in a row, side by side.

    python benchmarks/bench_expert_ranges_counts.py [--workdir /tmp/expertd-bench-counts] [--generations 16]
                                                    [--hidden 256] [--moe-intermediate 128]

DeepSeek-V3's counts at small dims (`expertd generate`'s dsv3-counts preset: 61 layers, the first 3 dense, 58 MoE
layers of 256 routed experts, FP8 blocks; --hidden and --moe-intermediate make each expert's part whole pages: 64
KiB at 256 x 128) is served by two daemons in turn, one without `expert_ranges` (a push rewrites each changed
stack whole) and one with it. On each, generation after generation, one process pushes one expert's up_proj per MoE
layer (58 parts, a different expert each generation, new values) and a worker (this process: a transformers model
bound to the served tensors) refreshes onto it, and runs one forward. Printed per generation: publish time
(`update()`), the worker's `refresh(model)` and first forward after it, its count of mappings (/proc/self/maps
lines) against `vm.max_map_count`, and the ranges of one stack; then medians with the ratio ranges / whole. Every
generation the worker's view of each changed part must equal what was pushed, and `verify()` must pass at the end.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_expert_ranges import generated, mappings, options, ranged_daemon, side_by_side  # noqa: E402


def checkpoint(args) -> str:
    from expertd.tools.generate import generate

    return generated(args, f"dsv3-counts-{args.hidden}-{args.moe_intermediate}",
                     lambda folder: generate(folder, "dsv3-counts", hidden_size=args.hidden,
                                             moe_intermediate_size=args.moe_intermediate, q_lora_rank=64,
                                             kv_lora_rank=64, num_nextn_predict_layers=0))


def run(folder: str, args, ranges: bool) -> list[dict]:
    """`args.generations` pushes on a fresh daemon (`expert_ranges: ranges`), each followed by the worker's refresh
    and forward; one row per generation."""
    from expertd.client import ExpertClient

    rows, ids = [], torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    generator = torch.Generator().manual_seed(0)
    with (open(os.path.join(args.workdir, f"daemon-{'ranges' if ranges else 'whole'}.log"), "w") as log,
          ranged_daemon(folder, args, ranges, timeout=1800, max_generations=2, stdout=log, stderr=log) as daemon):
        with ExpertClient(daemon.endpoint, heartbeat=False) as pusher, \
                ExpertClient(daemon.endpoint, heartbeat=False) as worker:
            model = worker.load_model()
            model(ids)
            names = pusher.tensors()
            layers = sorted({int(n.split(".")[2]) for n in names if ".mlp.experts." in n})
            stack = f"model.layers.{layers[-1]}.mlp.experts.gate_up_proj"
            for g in range(args.generations):
                expert = (37 * g + 11) % 256
                values = {}
                for layer in layers:
                    name = f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"
                    values[name] = torch.randn(names[name].shape, generator=generator).to(names[name].dtype)
                t0 = time.perf_counter()
                pusher.update(values)
                publish = time.perf_counter() - t0
                pusher.refresh()  # off the old generation, which retires (max_generations 2)
                t0 = time.perf_counter()
                worker.refresh(model)
                refresh = time.perf_counter() - t0
                t0 = time.perf_counter()
                model(ids)
                forward = time.perf_counter() - t0
                now = worker.tensors()
                wrong = [n for n, v in values.items() if not torch.equal(now[n], v)]
                assert not wrong, f"generation {g + 2}: the worker does not read what was pushed: {wrong[:3]}"
                (entry,) = [t for t in worker.index().tensors if t.name == stack]
                rows.append({"publish": publish, "refresh": refresh, "forward": forward, "maps": mappings(),
                             "ranges": len(entry.extents or [0])})
                print(f"  {'ranges' if ranges else 'whole '} generation {g + 2:2d}: publish {publish:.3f} s, refresh "
                      f"{refresh:.3f} s, forward {forward:.3f} s, mappings {rows[-1]['maps']}, ranges of "
                      f"{stack.split('.')[2]}'s gate_up {rows[-1]['ranges']}", flush=True)
            del now
            assert worker.verify() == [], "verify found corrupted tensors"
            del model
    return rows


def main() -> None:
    parser = options(__doc__, "/tmp/expertd-bench-counts", hidden=256, moe_intermediate=128)
    parser.add_argument("--generations", type=int, default=16)
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    args, whole, ranged = side_by_side(
        parser, checkpoint, run, lambda args: f"DeepSeek-V3's counts (58 MoE layers x 256 experts), hidden "
        f"{args.hidden}, moe_intermediate {args.moe_intermediate}; {args.generations} generations, one expert per "
        "layer changed in each")
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    print("| medians over the generations | expert_ranges: true | false (stacks rewritten whole) | ratio |")
    print("| --- | --- | --- | --- |")
    for key, label in (("publish", "publish (`update()`)"), ("refresh", "worker's `refresh(model)`"),
                       ("forward", "worker's first forward after it")):
        print(f"| {label} | {med(ranged, key):.3f} s | {med(whole, key):.3f} s | "
              f"{med(ranged, key) / med(whole, key):.3f} |")
    print(f"| worker's mappings after the last generation | {ranged[-1]['maps']} | {whole[-1]['maps']} | |")
    print(f"| ranges of one gate_up stack after the last | {ranged[-1]['ranges']} | {whole[-1]['ranges']} | |")
    print(f"vm.max_map_count {limit}: the worker's most mappings {max(r['maps'] for r in ranged)} "
          f"({100 * max(r['maps'] for r in ranged) / limit:.1f} % of it)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
