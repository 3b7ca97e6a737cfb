"""Where a model's tensors live: in a read-only shared mapping of the daemon's segments, or in private memory.

Read from /proc/self/maps, so it answers for any model whatever bound it: a tensor counts as shared only if
all its bytes lie inside one mapping that is shared (`s`), not writable, and of a file in the segments' folder.
"""

from __future__ import annotations

import bisect
import os


def shared_ranges(shm_dir: str) -> list[tuple[int, int]]:
    """Address ranges of this process's read-only shared mappings of files in `shm_dir`, sorted, adjacent ones
    joined."""
    prefix = os.path.join(shm_dir, "")
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix) and parts[1][1] == "-" and parts[1][3] == "s":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):  # adjacent ones are one range: a tensor mapped range by range (its extents)
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def residency(model, shm_dir: str) -> list[tuple[str, object, bool]]:
    """(name, tensor, whether it lies in a read-only shared mapping of `shm_dir`) for every tensor `from_pretrained`
    would load into the model (`hf_dtypes.loaded_tensors`)."""
    from expertd.hf_dtypes import loaded_tensors

    ranges = shared_ranges(shm_dir)
    starts = [lo for lo, _ in ranges]
    out = []
    for name, t in loaded_tensors(model).items():
        lo = t.data_ptr()
        k = bisect.bisect_right(starts, lo) - 1
        out.append((name, t, t.numel() == 0 or (k >= 0 and lo + t.numel() * t.element_size() <= ranges[k][1])))
    return out


def private_tensors(model, shm_dir: str) -> list[str]:
    """Names of the model's parameters and loaded buffers not lying in a read-only shared mapping of `shm_dir`."""
    return [name for name, _, shared in residency(model, shm_dir) if not shared]


def shared_bytes(model, shm_dir: str) -> int:
    """Bytes of the model's parameters and loaded buffers that lie in shared memory (tied tensors counted once)."""
    seen = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for _, t, shared in residency(model, shm_dir)
            if shared}
    return sum(seen.values())
