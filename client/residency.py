"""Where a model's tensors live: in a read-only shared mapping of the daemon's segments, or in private memory.

Read from /proc/self/maps, so it answers for any model whatever bound it: a tensor counts as shared only if
all its bytes lie inside one mapping that is shared (`s`), not writable, and of a file in the segments' folder.
"""

from __future__ import annotations

import bisect
import os


def shared_ranges(shm_dir: str) -> list[tuple[int, int]]:
    """Address ranges of this process's read-only shared mappings of files in `shm_dir`, sorted."""
    prefix = os.path.join(shm_dir, "")
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix) and parts[1][1] == "-" and parts[1][3] == "s":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return sorted(ranges)


def model_tensors(model) -> dict:
    """A model's parameters and the buffers its state_dict holds (what `from_pretrained` would load), by name."""
    state = set(model.state_dict().keys())
    out = dict(model.named_parameters())
    out.update((k, v) for k, v in model.named_buffers() if k in state)
    return out


def private_tensors(model, shm_dir: str) -> list[str]:
    """Names of the model's parameters and loaded buffers not lying in a read-only shared mapping of `shm_dir`."""
    ranges = shared_ranges(shm_dir)
    starts = [lo for lo, _ in ranges]
    out = []
    for name, t in model_tensors(model).items():
        if t.numel() == 0:
            continue
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        k = bisect.bisect_right(starts, lo) - 1
        if k < 0 or hi > ranges[k][1]:
            out.append(name)
    return out


def shared_bytes(model, shm_dir: str) -> int:
    """Bytes of the model's parameters and loaded buffers that lie in shared memory (tied tensors counted once)."""
    private = set(private_tensors(model, shm_dir))
    seen, total = set(), 0
    for name, t in model_tensors(model).items():
        key = (t.data_ptr(), t.numel())
        if name not in private and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
