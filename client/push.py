"""Push tensors to the daemon as a new generation: names and shapes over the socket, bytes through shared memory."""

from __future__ import annotations

import time

import torch

from expertd.errors import DaemonError, DaemonTimeout, UpdateRejected
from expertd.index import DEFAULT_SHM_DIR, tensor_checksum
from expertd.shm import map_segment, segment_bytes

POLL_S = 0.01


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _write_staged(staging: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy the pushed bytes into the staging segment the daemon handed out; their checksums, in its order."""
    mapping = map_segment(staging["segment"], staging["nbytes"], shared_write=True,
                          shm_dir=staging.get("shm_dir", DEFAULT_SHM_DIR))
    try:
        data = segment_bytes(mapping)
        sums = []
        for slot in staging["tensors"]:
            raw = _raw(tensors[slot["name"]])
            if raw.numel() != slot["nbytes"]:
                raise UpdateRejected(f"tensor {slot['name']!r}: {raw.numel()} bytes, the daemon staged {slot['nbytes']}")
            data[slot["offset"]: slot["offset"] + slot["nbytes"]].copy_(raw)
            sums.append(tensor_checksum(raw))
        del data
        return sums
    finally:
        mapping.close()


def push(conn, lease: str, tensors: dict[str, torch.Tensor], timeout: float) -> int:
    """Stage `tensors`, commit them and wait until the daemon publishes them; returns the generation."""
    if not isinstance(tensors, dict) or not tensors:
        raise UpdateRejected("update() needs a non-empty dict of name -> tensor")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise UpdateRejected(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    spec = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in tensors.items()]
    staging = conn.request("update", client=lease, tensors=spec)
    try:
        sums = _write_staged(staging, tensors)
    except BaseException:
        try:  # the daemon drops the staged segment at once instead of when this lease ends
            conn.request("abort", client=lease, update=staging["update"])
        except Exception:  # the first failure is the one to report
            pass
        raise
    job = conn.request("commit", client=lease, update=staging["update"], checksums=sums)
    deadline = time.monotonic() + max(timeout, 1.0)
    while job["state"] in ("building", "built"):
        if time.monotonic() > deadline:
            raise DaemonTimeout(f"the daemon did not publish update {staging['update']} within {timeout:.0f}s")
        time.sleep(POLL_S)
        job = conn.request("job", job=job["job"])
    if job["state"] != "published":
        cls = UpdateRejected if job.get("error") == "UpdateRejected" else DaemonError
        raise cls(f"the update failed: {job.get('error')}: {job.get('message')}", job.get("error"))
    return job["generation"]
