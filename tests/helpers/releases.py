"""Running `release_worker.py` under other transformers releases, and what its report must say."""

from __future__ import annotations

import json
import os
import subprocess

from helpers.inputs import INPUT_IDS

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release_worker.py")

# model types a 4.57 worker cannot run on this machine whatever expertd does (4.57's own from_pretrained fails too)
CANNOT_RUN_4_57 = {"jamba": "transformers 4.57's Jamba forward needs the CUDA mamba kernels"}


def with_released_keys(folder: str) -> None:
    """Make a generated config.json name its experts as the family's released configs do: transformers 5.24's
    save_pretrained writes Qwen3-MoE's `num_local_experts` where releases (and 4.57) say `num_experts`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("model_type") == "qwen3_moe" and "num_experts" not in config:
        config["num_experts"] = config["num_local_experts"]
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


def run_workers(pythons: list[str], endpoint: str, reference: str, cwd) -> list[dict]:
    """Run release_worker.py under each python at once (all attached together); their JSON reports."""
    procs = [subprocess.Popen([python, WORKER, endpoint, reference, json.dumps(INPUT_IDS)], cwd=str(cwd),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for python in pythons]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def check_report(report: dict, release: str) -> None:
    """Logits equal to the worker's own from_pretrained, its dtypes, and nothing outside the daemon's shared memory."""
    assert report["transformers"].startswith(release), report["transformers"]
    assert report["equal"], f"logits differ from transformers {release}'s own from_pretrained"
    assert report["dtypes"] == report["ref_dtypes"]
    assert report["private"] == []  # every parameter and loaded buffer: the daemon's read-only shared memory
    assert report["tensors"] > 0
