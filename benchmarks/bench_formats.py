"""Checkpoint formats: what serving compressed-tensors FP8 and MXFP4 costs next to DeepSeek FP8, in one run.

    python benchmarks/bench_formats.py [--workdir /tmp/expertd-bench] [--reps 3] [--only F1 F2]
        [--checkpoint fp8=DIR --checkpoint ct-channel=DIR ...]   # F2 on checkpoints of your own

F1  CPU dequant GB/s of bf16 output per format, each against `dst.copy_(src)` of the same output bytes measured
    side by side (benchmarks/bench_dequant.py's cases): the FP8 formats (DeepSeek 128x128 blocks with float32
    scales; compressed-tensors per channel, per tensor, per block with bf16 scales) at DeepSeek-V3's expert
    shapes (7168x2048, 2048x7168), MXFP4 at gpt-oss-120b's (2880x5760 gate_up, 2880x2880 down). Goal >= 0.5
    on the compiled path.
F2  start-to-serving (`expertd start` until status says serving, page cache warm, runs alternated, median of
    --reps) of a ~1 GB checkpoint of each format / the same of the ~1 GB DeepSeek FP8 checkpoint (`bench-1g`).
    compressed-tensors: bench-1g's own weights re-quantized per channel and per 128x128 block (the same model,
    the same served bytes). MXFP4 is gpt-oss's format, so its checkpoint is a gpt-oss model of about the
    same served bytes; its ratio is also given per served GB. Goal <= 1.2.
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
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_dequant import measure_formats  # noqa: E402
from bench_loader import warm  # noqa: E402
from helpers.daemon import DaemonProcess  # noqa: E402
from run_all import ensure_checkpoints, machine  # noqa: E402

# shape -> the formats measured at it: FP8 at DeepSeek-V3's expert shapes, MXFP4 at gpt-oss-120b's
SHAPES = {(7168, 2048): ("fp8-block", "ct-channel", "ct-tensor", "ct-block"),
          (2048, 7168): ("fp8-block", "ct-channel", "ct-tensor", "ct-block"),
          (2880, 5760): ("mxfp4",), (2880, 2880): ("mxfp4",)}
# a gpt-oss of about bench-1g's served bytes: 6 layers of 32 experts at 1024 x 1024
GPT_OSS = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=6, num_local_experts=32,
               num_attention_heads=8, num_key_value_heads=8, head_dim=64, vocab_size=8192)


def f1_dequant(reps: int) -> dict:
    out = {}
    for (m, n), formats in SHAPES.items():
        t = measure_formats(m, n, formats, reps)
        nbytes = m * n * 2
        out[f"{m}x{n}"] = {"copy_gbs": round(nbytes / t["copy"] / 1e9, 2), **{
            fmt: {"gbs": round(nbytes / t[fmt] / 1e9, 2), "ratio": round(t["copy"] / t[fmt], 2)} for fmt in formats}}
    return out


def ensure_formats(workdir: str) -> dict[str, str]:
    """bench-1g (DeepSeek FP8), its weights in compressed-tensors FP8 per channel and per block, a gpt-oss MXFP4."""
    from expertd.tools.generate import generate_model_type, quantize_saved_checkpoint
    from expertd.tools.requantize import write_mxfp4

    paths = ensure_checkpoints(workdir)
    out = {"fp8": paths["big"]}
    for scheme in ("channel", "block"):
        folder = out[f"ct-{scheme}"] = os.path.join(workdir, f"bench-1g-ct-{scheme}")
        if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
            print(f"writing bench-1g as compressed-tensors FP8 per {scheme} (once) ...", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(paths["big_bf16"], folder)
            quantize_saved_checkpoint(folder, torch.bfloat16, scheme=scheme)
    folder = out["mxfp4"] = os.path.join(workdir, "gpt-oss-mxfp4")
    if not os.path.exists(os.path.join(folder, "config.json")):
        print("writing a ~1 GB gpt-oss MXFP4 checkpoint (once) ...", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        generate_model_type(folder, "gpt_oss", fp8=False, max_shard_size="500MB", **GPT_OSS)
        write_mxfp4(folder)
    return out


def start_to_serving(workdir: str, name: str, checkpoint: str) -> tuple[float, int]:
    """(seconds from `expertd start` to serving, bytes served) of one real daemon, then stopped."""
    t0 = time.perf_counter()
    d = DaemonProcess.launch(os.path.join(workdir, f"run-{name}-{os.getpid()}"), checkpoint,
                             f"benchfmt{name[:6]}{os.getpid()}", stdout=subprocess.DEVNULL)
    try:
        status = d.wait_serving(timeout=900)
        seconds = time.perf_counter() - t0
    finally:
        d.stop()
        shutil.rmtree(os.path.join(workdir, f"run-{name}-{os.getpid()}"), ignore_errors=True)
    return seconds, status["bytes"]["total"]


def f2_start(workdir: str, reps: int, given: dict[str, str]) -> dict:
    folders = given or ensure_formats(workdir)
    if "fp8" not in folders:
        raise SystemExit("F2 needs a DeepSeek FP8 checkpoint to compare with: --checkpoint fp8=DIR")
    for folder in folders.values():
        warm(folder)
    times: dict[str, list[float]] = {k: [] for k in folders}
    served = {}
    for _ in range(reps):
        for name, folder in folders.items():  # alternated: a neighbour's load hits every format alike
            seconds, served[name] = start_to_serving(workdir, name, folder)
            times[name].append(seconds)
    base = statistics.median(times["fp8"])
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"seconds": round(med, 2), "served_gb": round(served[name] / 1e9, 3),
                     "ratio": round(med / base, 2),
                     "ratio_per_served_gb": round(med / served[name] / (base / served["fp8"]), 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/expertd-bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=["F1", "F2"])
    ap.add_argument("--checkpoint", action="append", default=[], metavar="FORMAT=DIR",
                    help="F2 on this checkpoint as FORMAT (fp8, ct-channel, ct-block, mxfp4, ...) instead of the "
                         "generated ones")
    args = ap.parse_args()
    given = dict(item.split("=", 1) for item in args.checkpoint)
    print(machine(), flush=True)
    result = {}
    if "F1" in args.only:
        result["F1"] = f1_dequant(max(15, 5 * args.reps))
        for shape, row in result["F1"].items():
            print(f"F1 {shape}: copy_ {row['copy_gbs']} GB/s; " + "; ".join(
                f"{fmt} {v['gbs']} GB/s ({v['ratio']})" for fmt, v in row.items() if fmt != "copy_gbs"), flush=True)
    if "F2" in args.only:
        result["F2"] = f2_start(args.workdir, args.reps, given)
        for name, row in result["F2"].items():
            print(f"F2 {name}: start-to-serving {row['seconds']} s for {row['served_gb']} GB served; "
                  f"/ DeepSeek FP8 {row['ratio']} (per served GB {row['ratio_per_served_gb']})", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
