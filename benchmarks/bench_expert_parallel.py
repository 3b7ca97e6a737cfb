"""Expert parallelism: what a host serving one EP rank's share costs, against the whole model, in one run.

    python benchmarks/bench_expert_parallel.py [--workdir /tmp/expertd-bench] [--checkpoint DIR] [--size 4]
        [--reps 2] [--push-gib 1.0] [--only E1 E2 E3]

E1  per host with `expert_parallel: {size: S, ranks: [r]}` vs the whole model (real `expertd start`, the
    same checkpoint, page cache warm, runs alternated, best of --reps): served bytes ratio (goal <= dense/total
    + 1/S + 1 %), start-to-serving ratio (goal <= 0.35 for S = 4) and the build's part of it (the daemon's
    own `job.seconds`: start-to-serving also holds ~4 s of imports and planning that no partition shrinks),
    checkpoint bytes read ratio.
E2  attach: `load_model(distributed_config=DistributedConfig(ep_size=2, fsdp_size=2))` in each of two torchrun
    ranks on a daemon serving both ranks' experts, vs plain `load_model()` in one process on the whole model
    (goal <= 1.5x). Both measured after a first attach in the same process (imports paid).
E3  cross-host `update()` (`push_all`) over tcp://127.0.0.1 with CURVE on (bytes in ZeroMQ frames) of about
    --push-gib GiB of bf16 tensors: GB/s of sending the bytes (the `update` and `stage` requests, checksums
    included, until the daemon holds the last byte) / GB/s of a raw pyzmq tcp send of the same bytes in
    frames of the same size on the same loopback, with CURVE as the push has it (goal >= 0.8) and in clear;
    then the seconds from the last byte to publication (checksums verified, the new generation's segments
    written, published) and the whole call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_loader import warm  # noqa: E402
from helpers.daemon import DaemonProcess  # noqa: E402
from run_all import ensure_checkpoints, machine  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(workdir: str, name: str, checkpoint: str, **extra) -> tuple[DaemonProcess, float, dict]:
    """A real daemon; (it, seconds from process start to serving, its status)."""
    t0 = time.perf_counter()
    d = DaemonProcess.launch(os.path.join(workdir, name), checkpoint, f"benchep{name}{os.getpid()}",
                             stdout=subprocess.DEVNULL, **extra)
    status = d.wait_serving(timeout=900)
    return d, time.perf_counter() - t0, status


def e1_share(workdir: str, checkpoint: str, size: int, reps: int) -> dict:
    """Whole model vs one rank of `size`: start-to-serving, served bytes, bytes read."""
    runs = {"whole": [], "share": []}
    for rep in range(reps):
        for kind in (("whole", "share") if rep % 2 == 0 else ("share", "whole")):
            extra = {} if kind == "whole" else {"expert_parallel": {"size": size, "ranks": [0]}}
            d, seconds, status = start(workdir, f"e1{kind}{rep}", checkpoint, **extra)
            d.stop()
            runs[kind].append((seconds, status["bytes"]["total"], status["job"]["bytes_read"],
                               status["job"]["seconds"]))
    whole, share = min(runs["whole"]), min(runs["share"])
    from expertd.server.load.loader import prepare

    ckpt, plan = prepare(checkpoint)
    ckpt.close()
    dense = sum(t.nbytes for t in plan.tensors if ".experts." not in t.name)
    return {"size": size, "start_whole_s": whole[0], "start_share_s": share[0], "start_ratio": share[0] / whole[0],
            "bytes_whole": whole[1], "bytes_share": share[1], "bytes_ratio": share[1] / whole[1],
            "bytes_goal": dense / plan.nbytes + 1 / size + 0.01, "dense_fraction": dense / plan.nbytes,
            "read_whole": whole[2], "read_share": share[2], "read_ratio": share[2] / whole[2],
            "build_whole_s": min(r[3] for r in runs["whole"]), "build_share_s": min(r[3] for r in runs["share"])}


EP_ATTACH = r"""
import json, os, sys, time, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from expertd.client import ExpertClient
dist.init_process_group("gloo")
config = DistributedConfig(ep_size=dist.get_world_size(), fsdp_size=dist.get_world_size())
out, reps, bf16 = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
times, loads = [], []
for _ in range(reps + 1):  # the first of each is dropped: imports and first-use costs
    dist.barrier()
    t0 = time.perf_counter()
    with ExpertClient(heartbeat=False) as client:
        model = client.load_model(distributed_config=config)
    times.append(time.perf_counter() - t0)
    del model
    if bf16:
        dist.barrier()
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, distributed_config=config)
        loads.append(time.perf_counter() - t0)
        del model
if dist.get_rank() == 0:
    json.dump({"attach": times[1:], "from_pretrained": loads[1:]}, open(out, "w"))
dist.destroy_process_group()
"""


def e2_attach(workdir: str, checkpoint: str, reps: int, bf16: str | None) -> dict:
    from expertd.client import ExpertClient

    ep, _, _ = start(workdir, "e2ep", checkpoint, expert_parallel={"size": 2})
    whole, _, _ = start(workdir, "e2whole", checkpoint)
    try:
        script, out = os.path.join(workdir, "ep_attach.py"), os.path.join(workdir, "ep_attach.json")
        with open(script, "w") as f:
            f.write(EP_ATTACH)
        single = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            with ExpertClient(whole.endpoint, heartbeat=False) as client:
                client.load_model()
            if rep:
                single.append(time.perf_counter() - t0)
        # TMPDIR: torchrun's own torchelastic_* folders go into the work folder, not into /tmp
        env = {**os.environ, "EXPERTD_ENDPOINT": ep.endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": workdir}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", str(free_port()), script, out, str(reps),
                        *([bf16] if bf16 else [])],
                       env=env, check=True, capture_output=True)
        with open(out) as f:
            ranked = json.load(f)
    finally:
        ep.stop()
        whole.stop()
    ep_s = min(ranked["attach"])
    return {"single_ms": min(single) * 1e3, "ep_ms": ep_s * 1e3, "ratio": ep_s / min(single),
            "from_pretrained_ms": min(ranked["from_pretrained"]) * 1e3 if ranked["from_pretrained"] else None}


def raw_send(frames: list[memoryview], nbytes: int, curve: bool = False) -> float:
    """Seconds to send `frames` over loopback tcp with pyzmq (no copy) and have them all received."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        pull.curve_secretkey, pull.curve_publickey, pull.curve_server = server_secret, server_public, True
        push.curve_serverkey = server_public
        push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    got = []

    def receive():
        total = 0
        while total < nbytes:
            total += len(pull.recv(copy=False))
        got.append(total)

    t = threading.Thread(target=receive)
    t.start()
    t0 = time.perf_counter()
    for frame in frames:
        push.send(frame, copy=False)
    t.join()
    seconds = time.perf_counter() - t0
    push.close(0), pull.close(0)
    ctx.term()
    return seconds


def e3_push(workdir: str, checkpoint: str, gib: float, reps: int) -> dict:
    from expertd.client import ExpertClient
    from expertd.protocol import STAGE_FRAME_BYTES
    from expertd.security import create_keys

    keys = os.path.join(workdir, f"e3keys{os.getpid()}")
    daemon_key = create_keys(keys, "daemon")
    trainer_key = create_keys(os.path.join(keys, "push"), "trainer")
    d = DaemonProcess.launch(os.path.join(workdir, "e3"), checkpoint, f"benchepe3{os.getpid()}",
                             stdout=subprocess.DEVNULL,
                             endpoint=f"tcp://127.0.0.1:{free_port()}", max_generations=2 + reps,
                             curve_secret_key=daemon_key[1], curve_push_keys=os.path.join(keys, "push"))
    credentials = {"server_key": daemon_key[0], "client_key": trainer_key[1]}
    try:
        subprocess.run([sys.executable, "-m", "expertd.server.cli", "status", "--config", d.config, "--wait", "900"],
                       check=True, capture_output=True)
        with ExpertClient(d.endpoint, heartbeat=False, **credentials) as client:
            served = client.served_tensors()
            tensors, total = {}, 0
            for name, t in sorted(served.items(), key=lambda kv: -kv[1].nbytes):
                if total >= gib * 2**30:
                    break
                tensors[name] = t.clone().add_(1) if t.is_floating_point() else t.clone()
                total += t.nbytes
        flat = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()]
        frames = [f[k: k + STAGE_FRAME_BYTES] for f in flat for k in range(0, len(f), STAGE_FRAME_BYTES)]
        sends, raws, curves, tails, totals = [], [], [], [], []
        for _ in range(reps):
            raws.append(raw_send(frames, total))
            curves.append(raw_send(frames, total, curve=True))
            send, publish, whole = timed_push(d.endpoint, tensors, credentials)
            sends.append(send), tails.append(publish), totals.append(whole)
            for t in tensors.values():
                if t.is_floating_point():
                    t.add_(1)
    finally:
        d.stop()
        shutil.rmtree(keys, ignore_errors=True)
    send_s, raw_s, curve_s = min(sends), min(raws), min(curves)
    return {"bytes": total, "push_gbps": total / send_s / 1e9, "raw_gbps": total / raw_s / 1e9,
            "curve_gbps": total / curve_s / 1e9, "ratio": raw_s / send_s, "ratio_curve": curve_s / send_s,
            "publish_after_last_byte_s": min(tails), "whole_s": min(totals)}


def timed_push(endpoint: str, tensors: dict, credentials: dict) -> tuple[float, float, float]:
    """One `push_all` to one daemon, timed by phase: (the bytes sent: `update` + `stage` requests with the
    checksums, until the daemon has the last byte; from the last byte to publication; the whole call)."""
    from expertd.client import push as pushing

    phases = {}
    stage = pushing._stage

    def timed_stage(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return stage(*args, **kwargs)
        finally:
            phases["staged"] = time.perf_counter()
            phases["send"] = phases["staged"] - t0

    pushing._stage = timed_stage
    try:
        t0 = time.perf_counter()
        pushing.push_all([endpoint], tensors, **credentials)
        end = time.perf_counter()
    finally:
        pushing._stage = stage
    return phases["send"], end - phases["staged"], end - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--checkpoint", help="a checkpoint of your own (default: the ~1 GB bench checkpoint)")
    ap.add_argument("--size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--push-gib", type=float, default=1.0)
    ap.add_argument("--only", nargs="*", default=["E1", "E2", "E3"])
    args = ap.parse_args()
    if args.checkpoint:
        checkpoint, bf16 = os.path.abspath(args.checkpoint), None
    else:
        paths = ensure_checkpoints(args.workdir)
        checkpoint, bf16 = paths["big"], paths["big_bf16"]
    warm(checkpoint)
    print(f"machine: {machine()}\ncheckpoint: {checkpoint}\n")
    if "E1" in args.only:
        r = e1_share(args.workdir, checkpoint, args.size, args.reps)
        print(f"| E1 | size {r['size']}, rank 0 vs whole | served bytes {r['bytes_share']:,} / {r['bytes_whole']:,} = "
              f"{r['bytes_ratio']:.3f} (goal <= {r['bytes_goal']:.3f}: dense {r['dense_fraction']:.3f} + "
              f"1/{r['size']} + 0.01) | start-to-serving {r['start_share_s']:.2f}s / {r['start_whole_s']:.2f}s = "
              f"{r['start_ratio']:.2f} (goal <= 0.35), "
              f"of which the build {r['build_share_s']:.2f}s / {r['build_whole_s']:.2f}s = "
              f"{r['build_share_s'] / r['build_whole_s']:.2f} | "
              f"bytes read {r['read_share']:,} / {r['read_whole']:,} = {r['read_ratio']:.3f} |", flush=True)
    if "E2" in args.only:
        r = e2_attach(args.workdir, checkpoint, args.reps, bf16)
        versus = "" if r["from_pretrained_ms"] is None else \
            (f" | from_pretrained(bf16, same DistributedConfig) {r['from_pretrained_ms']:.0f} ms = "
             f"{r['from_pretrained_ms'] / r['ep_ms']:.0f}x the EP attach")
        print(f"| E2 | attach | EP rank (ep_size 2, torchrun) {r['ep_ms']:.1f} ms / single process "
              f"{r['single_ms']:.1f} ms "
              f"= {r['ratio']:.2f} (goal <= 1.5){versus} |", flush=True)
    if "E3" in args.only:
        r = e3_push(args.workdir, checkpoint, args.push_gib, args.reps)
        cells = ["E3", f"tcp update (CURVE) of {r['bytes'] / 2**30:.2f} GiB",
                 f"bytes sent at {r['push_gbps']:.2f} GB/s / raw pyzmq with CURVE {r['curve_gbps']:.2f} GB/s = "
                 f"{r['ratio_curve']:.2f} (goal >= 0.8); / raw pyzmq in clear {r['raw_gbps']:.2f} GB/s = "
                 f"{r['ratio']:.2f}",
                 f"publish after the last byte {r['publish_after_last_byte_s']:.2f}s",
                 f"whole push {r['whole_s']:.2f}s"]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
