"""One contiguous read-only view of a tensor whose bytes lie in several segments (its extents), without a copy.

A range of the view's size is reserved (PROT_NONE, no memory), then each extent's pages are mapped into their place
in it by `mremap(source, 0, ...)`, which maps the same pages of the same file again at a fixed address: the view is
the daemon's shared pages, read-only like the segment mappings it comes from (a write is SIGSEGV), and it stays
valid when those mappings or the segments' files go, until the view itself is freed. Linux only.

Where the pages cannot be mapped so (a copy-on-write client's private mappings, a huge-page mapping whose extents
are not whole huge pages), the view is a private copy of the bytes instead, said once per process.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import weakref

import torch

from .errors import ShmError
from .extents import Extent, mappable, merge

log = logging.getLogger("expertd.client")

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # ranges that are whole 2 MiB pages (a huge-page tmpfs's) get a view starting on one too
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_FAILED = ctypes.c_void_p(-1).value
_copies_said = False
_last: dict[str, tuple] = {}  # tensor name -> (extents, weak reference to the reservation) of its last view


class _Reservation:
    """An address range of `length` bytes this process owns until it is freed (then unmapped whole), starting on a
    multiple of `align` (a huge page: ranges of a huge-page tmpfs mapped there can be mapped by huge pages)."""

    def __init__(self, length: int, align: int = PAGE):
        self.length = length
        extra = align - PAGE if align > PAGE else 0
        address = _libc.mmap(None, length + extra, _PROT_NONE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if address in (None, _FAILED):
            raise ShmError(f"cannot reserve {length} bytes of address space: {os.strerror(ctypes.get_errno())}")
        start = (address + align - 1) // align * align if extra else address
        if start > address:  # the parts of the larger range around the aligned one given back
            _libc.munmap(address, start - address)
        if extra and address + extra > start:
            _libc.munmap(start + length, address + extra - start)
        self.address = start

    def __del__(self):
        if getattr(self, "address", None) is not None:
            _libc.munmap(self.address, self.length)
            self.address = None


def composed(segments: dict[str, torch.Tensor], extents: list[Extent], name: str) -> torch.Tensor:
    """The bytes `extents` make, as one uint8 tensor: the segments' pages mapped in order (`segments`: name -> a
    segment's mapping as one uint8 tensor), or a private copy where they cannot be (see the module's docstring)."""
    pieces = merge(extents)
    total = sum(e.nbytes for e in pieces)
    for e in pieces:
        seg = segments.get(e.segment)
        if seg is None or e.offset + e.nbytes > seg.numel():
            raise ShmError(f"index entry {name}: its extent ({e.segment}, {e.offset}, {e.nbytes}) lies outside the "
                           f"segment")
    if len(pieces) == 1:
        e = pieces[0]
        return segments[e.segment][e.offset: e.offset + e.nbytes]
    if mappable(pieces, PAGE):
        mapped = _map(segments, pieces, total, name)
        if mapped is not None:
            return mapped
    return _copy(segments, pieces, total, name)


def _map(segments: dict[str, torch.Tensor], pieces: list[Extent], total: int, name: str) -> torch.Tensor | None:
    """The extents' pages mapped into one reserved range, or None where the kernel will not map them so. Where the
    last view composed of tensor `name` is alive and has some of these ranges at the same places (a newer generation
    of the stack: its unchanged experts), their page tables move to the new view (`MREMAP_DONTUNMAP`: the old view
    stays valid and refaults if read), so a forward does not fault the unchanged experts' pages in again."""
    huge = total >= HUGE_PAGE and mappable(pieces, HUGE_PAGE)
    reservation = _Reservation((total + PAGE - 1) // PAGE * PAGE, HUGE_PAGE if huge else PAGE)
    before = _last.get(name)
    old = before[1]() if before is not None else None
    kept = _same_places(before[0], pieces) if old is not None and old.length == reservation.length else []
    at = 0
    for e in pieces:
        for lo, hi, same in _runs(at, e, kept):
            length = min(reservation.length - lo, (hi - lo + PAGE - 1) // PAGE * PAGE)
            target = reservation.address + lo
            if same and _libc.mremap(old.address + lo, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED |
                                     _MREMAP_DONTUNMAP, target) == target:
                continue
            seg, src = segments[e.segment], e.offset + lo - at
            if src + length > seg.numel():  # the last page past the segment's mapping: not mappable in place
                return None
            if _libc.mremap(seg.data_ptr() + src, 0, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, target) != target:
                code = ctypes.get_errno()
                if code in (errno.EINVAL, errno.EFAULT):  # a private (copy-on-write) or huge-page mapping
                    return None
                raise ShmError(f"cannot map an extent of segment {e.segment}: {os.strerror(code)}")
        at += e.nbytes
    _last[name] = (pieces, weakref.ref(reservation))
    buffer = (ctypes.c_char * total).from_address(reservation.address)
    buffer.reservation = reservation  # unmapped when the last tensor over it goes
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _same_places(old: list[Extent], new: list[Extent]) -> list[tuple[int, int]]:
    """The byte ranges [lo, hi) of the tensor where the old and the new extents are the same bytes of the same
    segment (page multiples: every extent but the last is whole pages)."""
    def runs(pieces):
        at = 0
        for e in pieces:
            yield at, at + e.nbytes, e.segment, e.offset - at
            at += e.nbytes

    out, theirs = [], list(runs(old))
    for lo, hi, segment, shift in runs(new):
        out.extend((max(lo, a), min(hi, b)) for a, b, s, d in theirs
                   if s == segment and d == shift and max(lo, a) < min(hi, b))
    return out


def _runs(at: int, e: Extent, kept: list[tuple[int, int]]):
    """The extent at byte `at` of the tensor split into (lo, hi, kept) runs: kept where `kept` covers them."""
    lo, hi = at, at + e.nbytes
    for a, b in sorted(r for r in kept if r[0] < hi and r[1] > lo):
        if lo < a:
            yield lo, a, False
        yield a, b, True
        lo = b
    if lo < hi:
        yield lo, hi, False


def _copy(segments: dict[str, torch.Tensor], pieces: list[Extent], total: int, name: str) -> torch.Tensor:
    global _copies_said
    if not _copies_said:
        _copies_said = True
        log.info("%s lies in %d ranges that cannot be mapped as one here (private or huge-page mappings): a private "
                 "copy of it, and of any such tensor", name, len(pieces))
    out = torch.empty(total, dtype=torch.uint8)
    at = 0
    for e in pieces:
        out[at: at + e.nbytes].copy_(segments[e.segment][e.offset: e.offset + e.nbytes])
        at += e.nbytes
    return out
