"""What the derived-tensor tests share (`tests/test_derived.py`, `tests/test_derived_limits.py`): their fixtures (a
Qwen3-MoE checkpoint and one daemon per test module, which must exit 0 and leave nothing of its namespace, and a
client per test), the reference gather, and what a refused request must leave as it was.

A test module takes the fixtures by binding them to its own names:
`checkpoint, daemon, client = derived_cases.checkpoint, derived_cases.daemon, derived_cases.client`."""

from __future__ import annotations

import bisect
import glob
import os
import uuid

import pytest
import torch

from expertd import derived
from expertd.client import ExpertClient
from expertd.client.residency import shared_ranges
from expertd.connection import Connection
from expertd.errors import DaemonError, DerivedRejected
from expertd.messages import GatherItem
from expertd.tools.generate import generate_model_type
from helpers.daemon import DaemonProcess

PAD = 64  # -1 entries mixed into the permutation: zeros in the derived block


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("derived") / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False)
    return folder


def _start(folder, checkpoint: str) -> tuple[DaemonProcess, str]:
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    daemon = DaemonProcess.launch(folder, checkpoint, namespace, max_generations=8)
    daemon.wait_serving()
    return daemon, namespace


def _left(namespace: str) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/{namespace}*"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, checkpoint):
    """One daemon for a test module; afterwards it must have exited 0 and left nothing of its namespace."""
    daemon, namespace = _start(tmp_path_factory.mktemp("run"), checkpoint)
    yield daemon
    code = daemon.stop()
    left = _left(namespace)
    for path in left:
        os.unlink(path)
    assert code == 0 and not left, (code, left)


@pytest.fixture
def client(daemon):
    with ExpertClient(daemon.endpoint, timeout=60) as c:
        yield c


def expert_stack(client: ExpertClient, layer: int = 0, which: str = "gate_up_proj") -> tuple[str, torch.Tensor]:
    (name,) = [n for n in client.served_tensors() if n.endswith(f"layers.{layer}.mlp.experts.{which}")]
    return name, client.served_tensors()[name]


def permutation(n: int, seed: int) -> torch.Tensor:
    """A random permutation of a block's n elements with PAD -1 entries mixed in (m = n + PAD)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.cat([torch.randperm(n, generator=g), torch.full((PAD,), -1, dtype=torch.int64)])
    return index[torch.randperm(n + PAD, generator=g)]


def reference(source: torch.Tensor, index: torch.Tensor, shape) -> torch.Tensor:
    """The gather computed here in torch: block j-th element = source block[index[j]], 0 where index[j] == -1."""
    blocks = source.reshape(source.shape[0], -1)
    out = blocks[:, index.clamp(min=0)].clone()
    out[:, index < 0] = 0
    return out.reshape(shape)


def ask(name: str, index: torch.Tensor, shape) -> GatherItem:
    return derived.request(name, derived.encode(index), index.numel(), shape)


def derivation(client: ExpertClient, item: GatherItem) -> str:
    """The derivation's name as the client computes it: a digest of the request and its sources' checksums."""
    served = {t.name: t for t in client.index().tensors}
    sources = [served[n] for n in (item.name, *(item.also or ()))]
    return derived.Gather(item, list(sources[0].shape), "test", [list(s.shape) for s in sources[1:]]).key(sources)


def derived_listed(daemon: DaemonProcess, generation: int) -> list[dict]:
    (gen,) = [g for g in daemon.status()["generations"] if g["generation"] == generation]
    return [v for v in gen["derived"]["tensors"] if "derivation" in v]


def mapping_of(t: torch.Tensor) -> tuple[str, str]:
    """(file, permissions) of this process's mapping that holds the tensor's first byte."""
    lo = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= lo < end:
                return (parts[5].strip() if len(parts) == 6 else ""), parts[1]
    raise AssertionError(f"no mapping holds {lo:#x}")


def in_shared_memory(t: torch.Tensor, shm_dir: str) -> bool:
    """All of the tensor's bytes lie in one read-only shared mapping of a file in `shm_dir`."""
    ranges = shared_ranges(shm_dir)
    k = bisect.bisect_right([lo for lo, _ in ranges], t.data_ptr()) - 1
    return k >= 0 and t.data_ptr() + t.numel() * t.element_size() <= ranges[k][1]


def malformed(daemon: DaemonProcess, client: ExpertClient, item: dict, needle: str) -> None:
    """Send a `gather` of one raw item: refused by the daemon's parser (ProtocolError naming the field) before it
    looks anything up; nothing made."""
    before, listed = _left(daemon.namespace), derived_listed(daemon, client.generation)
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        with pytest.raises(DaemonError, match="ProtocolError") as caught:
            conn.request("gather", client=client.lease, tensors=[item])
    finally:
        conn.close()
    assert needle in str(caught.value), (needle, str(caught.value))
    assert _left(daemon.namespace) == before and derived_listed(daemon, client.generation) == listed


def refused(daemon: DaemonProcess, client: ExpertClient, items: list[GatherItem], *needles: str) -> str:
    """Ask `items`: DerivedRejected whose message holds every needle, and nothing made (no new segment, nothing more
    listed in status)."""
    before, listed = _left(daemon.namespace), derived_listed(daemon, client.generation)
    with pytest.raises(DerivedRejected) as caught:
        client.derived(items)
    message = str(caught.value)
    assert all(needle in message for needle in needles), (needles, message)
    assert _left(daemon.namespace) == before
    assert derived_listed(daemon, client.generation) == listed
    return message


def high_water_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        (line,) = [line for line in f if line.startswith("VmHWM:")]
    return int(line.split()[1]) << 10
