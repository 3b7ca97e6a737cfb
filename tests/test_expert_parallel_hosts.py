"""Expert parallelism across two hosts simulated on one machine (a tmpfs mount and IPC namespace each): each
daemon serves half the experts, and torchrun workers refresh after a reload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from expertd.partition import ExpertParallel
from expertd.server.load.loader import prepare
from helpers.checkpoints import edit_checkpoint
from helpers.daemon import write_config
from helpers.ep import EXPERT, HELPERS, experts_of, free_port, reports
from helpers.reference import write_reference_bf16


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="simulating hosts needs root (unshare --ipc --mount and a tmpfs mount)")


def changed_experts(folder: str, dst: str) -> str:
    """A copy of an FP8 checkpoint with one expert changed in each half of layer 1 (its FP8 rows reversed)."""
    total = experts_of(folder)
    names = [f"{EXPERT}{e}.{part}.weight" for e in (1, total - 2) for part in ("gate_proj", "down_proj")]
    return edit_checkpoint(folder, dst, replace={name: reversed_rows(folder, name) for name in names})


def reversed_rows(folder: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(folder, shard), framework="pt") as f:
        codes = f.get_tensor(name)
    return codes.view(torch.uint8).flip(0).view(codes.dtype)


@needs_root
def test_two_hosts_each_serve_half_and_workers_refresh_after_a_reload(dsv3, tmp_path):
    """Two `unshare --ipc --mount` hosts, each with a private /dev/shm and its own daemon (ranks [0] / [1]),
    `torchrun --nnodes 2` over loopback: logits equal transformers' EP; each host serves the dense tensors and
    its half of the experts and reads about its share of the expert bytes; a reload onto a checkpoint with
    experts changed in both halves reaches both hosts' workers through refresh()."""
    folder, reference = dsv3
    changed = changed_experts(folder, str(tmp_path / "changed"))
    changed_reference = write_reference_bf16(changed, str(tmp_path / "changed-bf16"))
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    hosts = []
    for node in (0, 1):
        ns = f"ep{node}{os.getpid()}"
        config = write_config(tmp_path / f"host{node}", folder, ns, expert_parallel={"size": 2, "ranks": [node]},
                              load_threads=1)
        cmd = ["unshare", "--ipc", "--mount", "--fork", sys.executable, os.path.join(HELPERS, "ep_host.py"), config,
               str(node), "2", "1", str(port), str(out), reference, ns, "--reload", changed, changed_reference]
        hosts.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "PYTHONPATH": os.path.dirname(HELPERS)}))
    logs = [h.communicate(timeout=900)[0] for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], logs
    host = [json.load(open(out / f"host{n}.json")) for n in (0, 1)]
    for n, h in enumerate(host):
        assert h["torchrun"][0] == 0, h["torchrun"][1]
        assert h["reload"][0] == 0, h["reload"]
        assert h["daemon_exit"] == 0 and h["left_in_shm"] == [], h
    _, whole = prepare(folder)
    dense = sum(t.nbytes for t in whole.tensors if ".experts." not in t.name)
    experts = whole.nbytes - dense
    for n, h in enumerate(host):
        served = h["loaded"]["bytes"]["total"]
        assert served == dense + experts // 2, (n, served, dense, experts)
        assert h["loaded"]["expert_parallel"]["ranks"] == [n]
    # bytes read from the checkpoint per host: its plan's sources (scales twice: checked, then used), plus what
    # span reads of small neighbouring tensors take in between (at most 16 KiB per tensor)
    for n, h in enumerate(host):
        _, share = prepare(folder, ExpertParallel(2, (n,)))
        sources = [s for t in share.tensors for s in t.sources]
        expected = sum(s.info.nbytes + 2 * (s.scale.nbytes if s.scale else 0) for s in sources)
        read = h["loaded"]["job"]["bytes_read"]
        assert expected <= read <= expected + (16 << 10) * len(sources), (n, read, expected)
        assert read < 0.8 * sum(s.info.nbytes for t in whole.tensors for s in t.sources)
    for report in reports(out, (0, 1)):
        assert report["equal"] and report["refreshed_equal"], report
        assert report["placements"] == report["reference_placements"]
        assert report["refreshed_generation"] == report["generation"] + 1
        assert all(report["shm"].values()) and all(report["refreshed_shm"].values())
        assert any(".experts." in n for n in report["rebound"])  # this rank's changed expert block was rebound
