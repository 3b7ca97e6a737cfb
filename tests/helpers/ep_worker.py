"""An expert-parallel worker, run under torchrun: attach to this host's daemon ($EXPERTD_ENDPOINT) with
transformers' DistributedConfig, compare its logits with `from_pretrained(REFERENCE, distributed_config=...)`
of the same config, and write what it saw to OUT/rank<R>.json.

    torchrun ... ep_worker.py OUT REFERENCE NAMESPACE [--fsdp N] [--then-refresh REFERENCE2] [--expect-error]

With --then-refresh it waits for a newer generation, refreshes the same model and compares with the
second reference. With --expect-error it records the error `load_model` raises instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.inputs import INPUT_IDS  # noqa: E402
from helpers.worker import shm_ranges  # noqa: E402


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits


def reference(folder: str, distributed_config):
    """transformers' own EP model of a bf16 checkpoint: (its logits, its DTensor placements)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, distributed_config=distributed_config)
    model.eval()
    sharded = placements(model)  # before a forward: FSDP leaves its root's parameters gathered after one
    return logits(model), sharded


def placements(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: [str(p.placements), list(p.to_local().shape)]
            for n, p in model.named_parameters() if isinstance(p, DTensor)}


def in_shm(model, namespace: str, shm_dir: str) -> dict:
    """Per expert block and dense parameter: whether its local shard lies in a mapping of the namespace's segments."""
    from torch.distributed.tensor import DTensor

    ranges = shm_ranges(namespace, shm_dir)
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        ptr = local.data_ptr()
        out[name] = any(lo <= ptr < hi for lo, hi, _ in ranges)
    return out


def main() -> None:
    from transformers.distributed import DistributedConfig

    from expertd.client import ExpertClient

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("reference")
    ap.add_argument("namespace")
    ap.add_argument("--ep", type=int, default=None, help="ep_size (default: the world size)")
    ap.add_argument("--then-refresh", default=None)
    ap.add_argument("--expect-error", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep or world
    config = DistributedConfig(ep_size=ep, fsdp_size=world)
    report: dict = {"rank": rank, "world": world, "endpoint": os.environ.get("EXPERTD_ENDPOINT")}
    client = ExpertClient(timeout=60)
    try:
        if args.expect_error:
            try:
                client.load_model(distributed_config=config)
                report["error"] = None
            except Exception as exc:  # the worker reports what it got: the test decides
                report["error"], report["message"] = type(exc).__name__, str(exc)
            return
        model = client.load_model(distributed_config=config)
        report["generation"] = client.generation
        report["placements"] = placements(model)
        report["shm"] = in_shm(model, args.namespace, client.index().shm_dir)
        served = logits(model)
        dist.barrier()
        expected, report["reference_placements"] = reference(args.reference, config)
        report["equal"] = bool(torch.equal(served, expected))
        report["max_diff"] = float((served.float() - expected.float()).abs().max())
        open(os.path.join(args.out, f"rank{rank}.ready"), "w").close()  # the host may reload its daemon now
        if args.then_refresh:
            deadline = time.monotonic() + 120
            while client.status()["generation"] <= report["generation"]:
                if time.monotonic() > deadline:
                    raise TimeoutError("no newer generation")
                time.sleep(0.05)
            report["rebound"] = client.refresh(model)
            report["refreshed_generation"] = client.generation
            report["refreshed_shm"] = in_shm(model, args.namespace, client.index().shm_dir)
            served = logits(model)
            report["refreshed_equal"] = bool(torch.equal(served, reference(args.then_refresh, config)[0]))
    finally:
        client.close()
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
