"""What a build hands back, and publishing it: the part of building the daemon's control plane needs.

A daemon that adopts its predecessor's generations serves them (a `Built` each, published) before it
imports torch or transformers; the builds themselves (`loader`, `building`, `updates`) import them in
their job. So this module, and everything the request loop and adoption use, stays on the standard
library, pyzmq, msgpack and xxhash (tests/test_control_plane.py checks it in a fresh interpreter).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from expertd.index import TensorIndex, write_json_atomic

from ..shm.arena import Arena


class Cancelled(Exception):
    """Building was interrupted by a stop request or a signal."""


@dataclass
class Built:
    """A generation's tensors in shared memory and its index; `parts` holds, per served tensor,
    the digest of each source part, which the next build compares against."""

    arena: Arena  # the segments this build created (older ones belong to the generations that made them)
    index: TensorIndex
    parts: dict[str, list[str]]
    known: dict[tuple, str] = field(default_factory=dict)  # source identity -> digest, to skip re-reading
    bytes_written: int = 0
    tensors_written: int = 0
    seconds: float = 0.0
    bytes_read: int = 0  # checkpoint bytes this build read
    # per served tensor whose checksum is combined of its parts: each part's checksum, so that a push changing k
    # experts of a stack hashes those k (`expert_ranges`); checked against the entry's checksum before use
    sums: dict[str, list[str]] = field(default_factory=dict)

    def close(self) -> None:
        """Remove the segments this build created (a build that is not published, or a daemon that exits)."""
        self.arena.unlink()


def publish(index: TensorIndex, index_path: str | None) -> None:
    """Write a built generation's index JSON (temp + rename): readers see the old index or the new, whole."""
    if index_path is not None:
        os.makedirs(os.path.dirname(index_path) or ".", exist_ok=True)
        write_json_atomic(index_path, index.to_dict(), indent=None)  # compact: ~0.5 MB at DeepSeek-V3 counts
