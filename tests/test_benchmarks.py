"""The loader and huge-page benchmarks run end to end on small checkpoints (their figures are not checked here:
speed is measured by running them, see BENCHMARKS.md), so a reviewer can point them at checkpoints of their own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
TINY = os.path.join(ROOT, "checkpoints", "tiny")


# what tests running beside this one (pytest -n) make in /dev/shm: their namespaces ("edt" and 10 hex digits, or
# "edtgold", "edt-"; benchmarks' are "bench..." and "edtbench...") and vLLM's queues
OTHERS = re.compile(r"edt([0-9a-f]{10}|gold|-)|psm_")


def run(script: str, *args: str, timeout: int = 600) -> str:
    before = set(os.listdir("/dev/shm"))
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    left = {name for name in set(os.listdir("/dev/shm")) - before if not OTHERS.match(name)}
    assert not left, f"the benchmark left shared memory behind: {sorted(left)}"
    return out.stdout


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]


def test_bench_loader_on_given_checkpoints(tmp_path):
    from expertd.tools.generate import generate

    few, many = str(tmp_path / "few"), str(tmp_path / "many")
    generate(few, preset="tiny", seed=0, shards=1)
    generate(many, preset="tiny", seed=0, shards=5)
    text = run("bench_loader.py", "--workdir", str(tmp_path / "work"), "--threads", "1,2", "--reps", "1",
               "--checkpoint", TINY, "--counts-checkpoint", many, "--bytes-checkpoint", few, "--per-chunk",
               "--python-share")
    assert f"checkpoint {TINY}:" in text
    for threads in ("1", "2"):  # L1 (each run checked equal to the first: the script exits 1 otherwise), then L2
        l1, l2 = table_rows(text, threads)
        assert float(l1[1]) > 0 and float(l1[2]) > 0 and float(l1[3].strip("*")) > 0
        assert float(l1[7]) > 0  # the per-chunk path beside it, its layout checked equal too
        assert all(float(v) > 0 for v in l2[1:])
    assert re.search(r"main thread [0-9]+ ms: at most [0-9.]+ GB/s", text), text
    ratio = re.search(r"L3 ratio \*\*([0-9.]+)\*\*", text)
    assert ratio and float(ratio.group(1)) > 0
    assert "| many | " in text and "| few | " in text


def test_bench_counts_on_given_checkpoints(tmp_path):
    """The phases of a daemon's load, each in a fresh process, for two checkpoints; per tensor and publish."""
    from expertd.tools.generate import generate

    few, many = str(tmp_path / "few"), str(tmp_path / "many")
    generate(few, preset="tiny", seed=0, shards=1)
    generate(many, preset="tiny", seed=1, shards=5)
    text = run("bench_counts.py", "--workdir", str(tmp_path / "work"), "--reps", "1",
               "--counts-checkpoint", many, "--bytes-checkpoint", few)
    for name in ("many", "few"):
        (row,) = table_rows(text, name)
        assert all(float(cell.removesuffix(" s")) >= 0 for cell in row[2:]), row
    assert re.search(r"\*\*-?[0-9.]+ us\*\* per checkpoint tensor beyond the bytes", text), text
    assert re.search(r"publish at [0-9,]+ tensors \*\*[0-9.]+ s\*\*", text), text


def test_bench_loader_refuses_one_checkpoint_as_both_sides_of_l3(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(BENCH, "bench_loader.py"), "--only", "L3", "--reps", "1",
                          "--workdir", str(tmp_path), "--checkpoint", TINY, "--counts-checkpoint", TINY,
                          "--bytes-checkpoint", TINY], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0 and "two different checkpoints" in out.stderr


def test_bench_hugepages_on_a_given_checkpoint():
    if os.geteuid() != 0:
        pytest.skip("bench_hugepages.py mounts two tmpfs: it needs root (CI runs as root)")
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare for a private mount namespace")
    text = run("bench_hugepages.py", "--gib", "0.01", "--reps", "2", "--checkpoint", TINY)
    huge = re.search(r"huge pages: [0-9.]+ GiB in \d+ segments, (\d+) MiB in huge pages", text)
    assert huge and int(huge.group(1)) > 0, text  # the huge mount really gave huge pages
    for row in ("H1 first fill", "H1 fill, the daemon's path", "H1 fill through the mapping",
                "H2 first touch, ms per GB",
                "H3 expert forward, steady state", "H4 loader, first build", "H4 loader, later builds"):
        cells = next(line for line in text.splitlines() if line.startswith(f"| {row}")).strip("|").split("|")
        assert float(cells[1]) >= 0 and float(cells[2]) >= 0 and cells[3].strip().endswith("x"), row


def test_bench_expert_parallel_on_a_given_checkpoint(tmp_path):
    """E1 (one EP rank vs the whole model), E2 (EP attach), E3 (tcp push under CURVE vs raw pyzmq) end to end."""
    text = run("bench_expert_parallel.py", "--checkpoint", TINY, "--workdir", str(tmp_path / "work"), "--reps", "1",
               "--push-gib", "0.005", "--size", "2")
    e1, e2, e3 = (table_rows(text, k) for k in ("E1", "E2", "E3"))
    assert len(e1) == len(e2) == len(e3) == 1
    ratio = float(re.search(r"served bytes [\d,]+ / [\d,]+ = ([\d.]+)", e1[0][2]).group(1))
    assert 0.5 < ratio < 1  # half the experts, every dense tensor
    assert "goal >= 0.8" in e3[0][2]


def test_bench_formats_on_given_checkpoints(tmp_path):
    """F1 checks each format's dequant against its reference (the script exits otherwise) beside a copy; F2 starts a
    real daemon on a checkpoint of each format and gives each start-to-serving over DeepSeek FP8's."""
    import json

    from expertd.tools.generate import generate_model_type, quantize_saved_checkpoint
    from expertd.tools.requantize import write_mxfp4

    channel, mxfp4 = str(tmp_path / "channel"), str(tmp_path / "mxfp4")
    generate_model_type(channel, "qwen3_moe", fp8=False)
    quantize_saved_checkpoint(channel, torch.bfloat16, scheme="channel")
    generate_model_type(mxfp4, "gpt_oss", fp8=False)
    write_mxfp4(mxfp4)
    text = run("bench_formats.py", "--workdir", str(tmp_path / "work"), "--reps", "1", "--checkpoint", f"fp8={TINY}",
               "--checkpoint", f"ct-channel={channel}", "--checkpoint", f"mxfp4={mxfp4}")
    result = json.loads(text.strip().splitlines()[-1])
    assert {fmt for row in result["F1"].values() for fmt in row} == {
        "copy_gbs", "fp8-block", "ct-channel", "ct-tensor", "ct-block", "mxfp4"}
    assert all(v["ratio"] > 0 for row in result["F1"].values() for k, v in row.items() if k != "copy_gbs")
    assert set(result["F2"]) == {"fp8", "ct-channel", "mxfp4"} and result["F2"]["fp8"]["ratio"] == 1.0
    assert all(row["seconds"] > 0 and row["served_gb"] > 0 for row in result["F2"].values())


def test_bench_ledger_writes_and_reads_a_record_of_the_counts_asked():
    text = run("bench_ledger.py", "--layers", "4", "--dense", "1", "--experts", "8", "--runs", "1")
    # 4 layers x 5 attention tensors + 1 dense layer's 3 MLP weights + 3 MoE layers x (2 fused + 3 shared) = 38;
    # one digest per source: 20 + 3 + 3 x (16 gate/up + 8 down + 3 shared) = 104, two identities each
    assert "38 served tensors, 104 part digests, 208 source identities" in text, text
    assert re.search(r"ledger record write +[\d.]+ ms .*ratio to the index publish [\d.]+", text), text
    assert re.search(r"ledger record read +[\d.]+ ms", text), text


def test_bench_restart_on_a_given_checkpoint(tmp_path):
    """R1 adopts (the script exits unless the successor serves generation 1), after a SIGKILL and a planned
    handover, beside a fresh start; R3 times the control commands; R2 restarts the daemon under a worker doing
    forward passes."""
    import json

    text = run("bench_restart.py", "--workdir", str(tmp_path / "work"), "--checkpoint", TINY, "--reps", "1",
               "--restarts", "2")
    result = json.loads(text.strip().splitlines()[-1])
    assert set(result["R1"]) == {"fresh", "cached", "full", "sizes", "handover"}
    assert result["R1"]["fresh"]["ratio"] == 1.0
    assert all(row["seconds"] > 0 for row in result["R1"].values())
    assert all(result["R3"][k] > 0 for k in ("stop", "status", "version")) and "stop_after_exit" in result["R3"]
    r2 = result["R2"]
    assert r2["restarts"] == 2 and r2["forwards"] > 0 and r2["errors"] == 0 and r2["same_lease"]
