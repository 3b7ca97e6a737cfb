"""What a checkpoint tensor costs the daemon's path to serving, counted in operations, not seconds.

DeepSeek-V3 has ~92k checkpoint tensors; at small dims what they cost is per tensor, not per byte (issue 30:
<= 30 us a tensor). The same checkpoint is loaded with 8 and with 16 experts a layer (the served tensors the
same, the checkpoint tensors ~doubled) through plan, build, index segment, index JSON and ledger record
(written and read back), and what grows between the two is divided by the checkpoint tensors added: Python
calls (every thread), the system calls that belong to a segment or a file (not to a tensor), and the cyclic
collections that planning and reading a record pause.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections import Counter

import pytest

from expertd.server.restart import ledger

from expertd.server.load import loader
from expertd.server.shm.arena import unlink_segment
from expertd.server.load.built import publish
from expertd.server.serving.generations import place_index
from expertd.tools.generate import generate

# Python calls per checkpoint tensor added, by phase (measured: plan 52, most of it transformers' renaming rules and
# the codec's naming; build 20; publish 4, grouping the ledger's source identities; reading the record back 0).
# Before issue 30: plan 62 (the codec asked per expert weight), publish 6 (every fused tensor's source names
# scanned once more per number in them, three times), ledger read 18 (each identity rebuilt element by element).
CALLS_PER_TENSOR = {"plan": 58, "build": 24, "publish": 5, "ledger read": 2}

# System calls that go with a segment, a shard or a file written (the served tensors and shards are the same at
# 8 and 16 experts): none more for the doubled checkpoint
PER_SEGMENT_CALLS = ("open", "close", "posix_fallocate", "ftruncate", "pwrite", "fsync", "fstat", "stat", "unlink",
                     "replace")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """DeepSeek-V3's kinds of tensors at tiny dims, 3 MoE layers of 8 and of 16 experts (no MTP layer: its experts,
    unused by the model, are served one segment each, which would grow the segments with the experts)."""
    out = {}
    for experts in (8, 16):
        folder = str(tmp_path_factory.mktemp("counts") / f"e{experts}")
        generate(folder, preset="dsv3-counts", seed=0, shards=2, num_hidden_layers=4, first_k_dense_replace=1,
                 n_routed_experts=experts, num_nextn_predict_layers=0)
        out[experts] = folder
    return out


class Counting:
    """Python calls (`call` and `c_call` profile events, on every thread started meanwhile), system calls
    by name, and cyclic collections by phase."""

    def __init__(self):
        self.calls: Counter = Counter()  # by phase
        self.syscalls: Counter = Counter()
        self.collections: Counter = Counter()
        self.phase = ""

    def profile(self, frame, event, arg):
        if event == "call":
            self.calls[self.phase] += 1
        elif event == "c_call":
            self.calls[self.phase] += 1
            if getattr(arg, "__module__", None) == "posix":
                self.syscalls[arg.__name__] += 1

    def collected(self, what, info):
        if what == "start":
            self.collections[self.phase] += 1

    def __enter__(self):
        gc.callbacks.append(self.collected)
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)
        gc.callbacks.remove(self.collected)


def serve(checkpoint: str, namespace: str, run_dir: str) -> tuple[Counting, int]:
    """Count one load of `checkpoint` to serving, as the daemon does it (and its ledger record read back)."""
    place = built = None
    with Counting() as counted:
        try:
            counted.phase = "plan"
            ckpt, plan = loader.prepare(checkpoint)
            counted.phase = "build"
            built = loader.build(ckpt, plan, namespace=namespace, generation=1, device="cpu", threads=2)
            counted.phase = "publish"
            place = place_index(built.index)
            publish(built.index, os.path.join(run_dir, "index.json"))
            ledger.write(run_dir, built, "load", ledger.build_conditions(checkpoint, None, built.index.shm_dir))
            counted.phase = "ledger read"
            ledger.read(run_dir, namespace, 1)
            counted.phase = ""
        finally:
            if place is not None:
                unlink_segment(place["segment"], built.index.shm_dir)
            if built is not None:
                built.close()
    return counted, len(ckpt.tensors)


@pytest.fixture(scope="module")
def counted(checkpoints, tmp_path_factory):
    """(counts, checkpoint tensors) at 8 and 16 experts; one load of each first, uncounted (first imports)."""
    out = {}
    for i, experts in enumerate([8, 8, 16]):
        run_dir = str(tmp_path_factory.mktemp("run"))
        out[experts] = serve(checkpoints[experts], f"edtcost{os.getpid()}x{i}", run_dir)
    return out


def test_python_calls_grow_by_a_few_per_checkpoint_tensor(counted):
    (small, n_small), (large, n_large) = counted[8], counted[16]
    assert n_large - n_small >= 140  # the experts' weights and scales added
    per_tensor = {phase: (large.calls[phase] - small.calls[phase]) / (n_large - n_small) for phase in CALLS_PER_TENSOR}
    assert all(per_tensor[phase] <= bound for phase, bound in CALLS_PER_TENSOR.items()), (
        f"Python calls per checkpoint tensor added: {per_tensor}, bounds {CALLS_PER_TENSOR}")


def test_segment_and_file_calls_do_not_grow_per_tensor(counted):
    (small, _), (large, _) = counted[8], counted[16]
    for name in PER_SEGMENT_CALLS:
        assert large.syscalls[name] <= small.syscalls[name], (
            f"os.{name}: {small.syscalls[name]} calls at 8 experts, {large.syscalls[name]} at 16")


def test_reads_go_by_span_not_by_tensor(counted):
    (small, n_small), (large, n_large) = counted[8], counted[16]
    added = large.syscalls["preadv"] - small.syscalls["preadv"]
    assert added <= (n_large - n_small) / 16, f"{added} more preadv calls for {n_large - n_small} more tensors"


def test_planning_and_reading_a_record_start_no_more_collections_for_more_tensors(counted):
    (small, _), (large, _) = counted[8], counted[16]
    for phase in ("plan", "ledger read"):  # one when the paused collector resumes, whatever the count
        assert large.collections[phase] <= max(1, small.collections[phase]), (dict(small.collections),
                                                                             dict(large.collections))
