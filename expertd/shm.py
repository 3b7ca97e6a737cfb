"""Read-only mappings of the daemon's segments and tensor views over them (no copies).

Workers map what they serve from; the daemon maps an older generation's segments the same way
when it copies unchanged parts into a new one.

A mapping stays valid after the daemon unlinks its segment, until the last process unmaps it;
every view keeps its mapping alive, so no mapping is ever closed under a live tensor. Views are
read-only at the page level: a worker that writes into one dies with SIGSEGV instead of
changing what other workers see.

Segment files themselves (their path, opening and mapping one) are `expertd.segments`'s.
"""

from __future__ import annotations

import math
import mmap
import warnings

import torch

from expertd.errors import ShmError
from expertd.dtypes import BY_NAME as DTYPES
from expertd.index import DEFAULT_SHM_DIR, TensorEntry
from expertd.segments import map_segment


def to_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ShmError(f"index names unknown dtype {name!r}") from None


def segment_bytes(mapping: mmap.mmap) -> torch.Tensor:
    """The whole mapping as one uint8 tensor: every view of a segment shares this one storage."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": intended
        return torch.frombuffer(mapping, dtype=torch.uint8)


def map_segments(entries, writable: bool = False, shm_dir: str = DEFAULT_SHM_DIR) -> dict[str, torch.Tensor]:
    """Map every segment of an index (name -> its bytes as one uint8 tensor); one warnings guard for all."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": intended
        for s in entries:
            mapping = map_segment(s.name, s.nbytes, writable=writable, shm_dir=shm_dir)
            out[s.name] = torch.frombuffer(mapping, dtype=torch.uint8)
    return out


def view(segments: dict[str, torch.Tensor], entry: TensorEntry) -> torch.Tensor:
    """A tensor over an index entry's bytes, sharing its segment's storage."""
    dtype = to_dtype(entry.dtype)
    count = math.prod(entry.shape)
    if count * dtype.itemsize != entry.nbytes:
        raise ShmError(f"index entry {entry.name}: {entry.shape} {entry.dtype} is not {entry.nbytes} bytes")
    if entry.extents:  # in several segments (generations that share unchanged experts): mapped as one
        from expertd.compose import composed

        return composed(segments, entry.extents, entry.name).view(dtype).view(entry.shape)
    seg = segments.get(entry.segment)
    if seg is None or entry.offset < 0 or entry.offset + entry.nbytes > seg.numel():
        raise ShmError(f"index entry {entry.name} lies outside segment {entry.segment}")
    if count == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return seg[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold the same bytes (same shape and dtype): compared as 8-byte words where they allow it
    (several times faster than comparing bf16 values, and exact where values are not: -0 and +0, NaNs)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    a, b = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    if a.numel() % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(a, b)
