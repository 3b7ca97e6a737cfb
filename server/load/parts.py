"""A served tensor's parts and where their results go: the types the loader's filling and its small-parts path share.

A part is one checkpoint tensor's share of a served tensor (an expert's weight in a fused block, or the whole
tensor); `Output` takes each result while it is in cache to its place in the segment. `filling` fills parts one
by one, `small_parts` many small FP8 parts at once; both build on this module.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ..shm.arena import Arena, Placement
from .layout import Source

CHUNK_BYTES = 1 << 20  # output bytes dequantized and hashed at a time: source and result stay in cache
BATCH_BYTES = 8 << 20  # output bytes per pool task: small parts go in batches, a large part alone
HASH_BYTES = 256 << 10  # a small part's result is hashed in pieces of this size, each while it is in L2


def memory_at(address: int, nbytes: int) -> memoryview:
    """The bytes at `address` as a writable buffer (no tensor made)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def part_digest(weight: str, scale: str | None) -> str:
    """A source part's digest as builds record and compare it: the weight's checksum, joined with its scale's."""
    return weight if scale is None else f"{weight}+{scale}"


_local = threading.local()


def _grown(nbytes: int, which: str) -> torch.Tensor:
    """This thread's buffer `which`, made or grown to at least `nbytes`."""
    buf = getattr(_local, which, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8)
        setattr(_local, which, buf)
    return buf


def buffer(nbytes: int, which: str = "read") -> torch.Tensor:
    """This thread's reusable buffer `which` ("read": sources, "out": results on their way to `pwrite`),
    at least `nbytes` long: it stays in cache from read to dequant to write."""
    return _grown(nbytes, which)[:nbytes]


def buffer_at(nbytes: int, which: str) -> int:
    """The address of `buffer(nbytes, which)` (no view made: a compiled call needs only where it starts)."""
    return _grown(nbytes, which).data_ptr()


class Output:
    """Where one batch's results go, by address.

    On tmpfs each result is made in this thread's buffer while it is in cache and leaves with `pwrite`:
    the kernel then takes each fresh page without zeroing it first, where a write through the mapping
    has it zero the page and then writes it again (placing bytes this way ran ~1.5x faster here).
    Back-to-back results of one segment leave in one call. On hugetlbfs (no write()) and for the GPU
    path (results copied back by torch) results are written straight through the daemon's mapping
    instead (`direct`)."""

    def __init__(self, arena: Arena, direct: bool):
        self.arena, self.direct = arena, direct
        self.where: Placement | None = None
        self.start = self.used = 0  # pending bytes [start, start + used) of `where`, at the buffer's head
        self.buf = None if direct else buffer(CHUNK_BYTES, "out")
        self.before_flush = None  # called before pending bytes leave: whoever writes them late finishes first

    def at(self, part: Part, offset: int, nbytes: int) -> int:
        """The address to write bytes [offset, offset + nbytes) of `part`'s result to (valid until the next call)."""
        if self.direct:
            return part.out.data_ptr() + offset
        pos = part.offset + offset
        if self.where is not part.where or pos != self.start + self.used or self.used + nbytes > self.buf.numel():
            self.flush()
            if nbytes > self.buf.numel():
                self.buf = buffer(nbytes, "out")
            self.where, self.start = part.where, pos
        address = self.buf.data_ptr() + self.used
        self.used += nbytes
        return address

    def tensor(self, part: Part, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """`at` as a tensor, for torch to write into."""
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(memory_at(self.at(part, offset, nbytes), nbytes), dtype=dtype).view(shape)

    def copy(self, part: Part, data: memoryview) -> None:
        """`part`'s whole result, already made elsewhere (an older generation's bytes)."""
        if self.direct:
            memory_at(part.out.data_ptr(), len(data))[:] = data
        else:
            self.flush()
            self.arena.pwrite(part.where, part.offset, data)

    def flush(self) -> None:
        if self.before_flush is not None:
            self.before_flush()
        if self.used:
            self.arena.pwrite(self.where, self.start, memory_at(self.buf.data_ptr(), self.used))
        self.where, self.used = None, 0


class Part:
    """Part k of a served tensor: its `nbytes` at byte `offset` of `where`, filled from `src`, or from `old`
    bytes. `out`, its place in the daemon's writable mapping, is made only where it is written through."""

    __slots__ = ("src", "block", "k", "where", "offset", "nbytes", "old", "digest")

    def __init__(self, src: Source, block: torch.Tensor, k: int, where: Placement, offset: int, nbytes: int):
        self.src, self.block, self.k, self.where, self.offset, self.nbytes = src, block, k, where, offset, nbytes
        self.old: torch.Tensor | None = None  # an older generation's bytes of this part (its source did not change)
        self.digest: str | None = None  # the source digest, when already known

    @property
    def out(self) -> torch.Tensor:
        return self.block[self.k]
