"""The ledger's cost at DeepSeek-V3's counts: writing (at every publish) and reading (at adoption) one record.

    python benchmarks/bench_ledger.py [--layers 61] [--dense 3] [--experts 256] [--runs 3]

A record holds the generation's index, the part digests an incremental build compares against (one per
checkpoint weight of a fused tensor) and the source identities (one per weight and scale). Built here
synthetically with DeepSeek-V3's tensor counts and name shapes (no shared memory, no checkpoint), then
written and read with `expertd.server.restart.ledger` side by side with publishing the index JSON alone (what
every publish wrote before the ledger existed). Prints the best of RUNS and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expertd.index import SegmentEntry, TensorEntry, TensorIndex  # noqa: E402
from expertd.server.restart import ledger  # noqa: E402
from expertd.server.load.built import Built, publish  # noqa: E402

HIDDEN, MOE_INTER, INTER = 7168, 2048, 18432


class _Arena:  # what ledger.write reads of a Built: nothing of its segments
    pass


def synthetic(layers: int, dense: int, experts: int) -> Built:
    digest = "xxh3_64:0123456789abcdef"
    tensors, parts, known = [], {}, {}
    offset = 0

    def add(name, shape, sources):
        nonlocal offset
        nbytes = 2
        for d in shape:
            nbytes *= d
        tensors.append(TensorEntry(name, "/bench.1.1.000", offset, nbytes, list(shape), "torch.bfloat16", sources,
                                   checksum=f"xxh3_64x{max(1, len(sources))}:0123456789abcdef"))
        offset += nbytes
        parts[name] = [f"{digest}+{digest}"] * max(1, len(sources))
        for k, src in enumerate(sources or [name]):
            for j in range(2):  # the weight and its scale
                known[(2049, 1000 + k, 5_000_000_000, 1_700_000_000_000_000_000, offset + k * 64 + j, 1 << 20,
                       "torch.float8_e4m3fn", (MOE_INTER, HIDDEN))] = digest

    for layer in range(layers):
        p = f"model.layers.{layer}"
        for name, shape in (("self_attn.q_a_proj.weight", (1536, HIDDEN)), ("self_attn.q_b_proj.weight", (24576, 1536)),
                            ("self_attn.kv_a_proj_with_mqa.weight", (576, HIDDEN)),
                            ("self_attn.kv_b_proj.weight", (32768, 512)), ("self_attn.o_proj.weight", (HIDDEN, 16384))):
            add(f"{p}.{name}", shape, [f"{p}.{name}"])
        if layer < dense:
            for name, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                                ("down_proj", (HIDDEN, INTER))):
                add(f"{p}.mlp.{name}.weight", shape, [f"{p}.mlp.{name}.weight"])
            continue
        add(f"{p}.mlp.experts.gate_up_proj", (experts, 2 * MOE_INTER, HIDDEN),
            [f"{p}.mlp.experts.{e}.{w}.weight" for e in range(experts) for w in ("gate_proj", "up_proj")])
        add(f"{p}.mlp.experts.down_proj", (experts, HIDDEN, MOE_INTER),
            [f"{p}.mlp.experts.{e}.down_proj.weight" for e in range(experts)])
        for w in ("gate_proj", "up_proj", "down_proj"):
            add(f"{p}.mlp.shared_experts.{w}.weight", (MOE_INTER, HIDDEN), [f"{p}.mlp.shared_experts.{w}.weight"])
    index = TensorIndex(1, "bench", "deepseek_v3", "transformers-fused", {"model_type": "deepseek_v3"},
                        [SegmentEntry("/bench.1.1.000", offset)], tensors, None)
    return Built(_Arena(), index, parts, known)


def best(fn, runs: int) -> float:
    """The fastest of `runs` timed calls of `fn` (run_all's figures time with it too)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--dense", type=int, default=3)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    built = synthetic(args.layers, args.dense, args.experts)
    folder = tempfile.mkdtemp(prefix="expertd-bench-ledger-")
    try:
        conditions = ledger.build_conditions("/models/deepseek-v3", None, "/dev/shm")
        index_path = os.path.join(folder, "bench.index.json")
        t_index = best(lambda: publish(built.index, index_path), args.runs)
        t_write = best(lambda: ledger.write(folder, built, "load", conditions), args.runs)
        t_read = best(lambda: ledger.read(folder, "bench", 1), args.runs)
        size = os.path.getsize(ledger.record_path(folder, "bench", 1))
        print(f"{args.layers} layers ({args.dense} dense), {args.experts} experts: {len(built.index.tensors)} served "
              f"tensors, {sum(len(p) for p in built.parts.values())} part digests, {len(built.known)} source "
              "identities")
        print(f"  index JSON publish   {t_index * 1000:8.1f} ms ({os.path.getsize(index_path) / 1e6:.1f} MB)")
        print(f"  ledger record write  {t_write * 1000:8.1f} ms ({size / 1e6:.1f} MB)   ratio to the index publish "
              f"{t_write / t_index:.1f}")
        print(f"  ledger record read   {t_read * 1000:8.1f} ms (a successor adopting it)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
