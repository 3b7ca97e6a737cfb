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

import torch

from .errors import ShmError
from .extents import Extent, mappable, merge

log = logging.getLogger("expertd.client")

PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
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


class _Reservation:
    """An address range of `length` bytes this process owns until it is freed (then unmapped whole)."""

    def __init__(self, length: int):
        self.length = length
        address = _libc.mmap(None, length, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                             -1, 0)
        if address in (None, _FAILED):
            raise ShmError(f"cannot reserve {length} bytes of address space: {os.strerror(ctypes.get_errno())}")
        self.address = address

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
        mapped = _map(segments, pieces, total)
        if mapped is not None:
            return mapped
    return _copy(segments, pieces, total, name)


def _map(segments: dict[str, torch.Tensor], pieces: list[Extent], total: int) -> torch.Tensor | None:
    """The extents' pages mapped into one reserved range, or None where the kernel will not map them so."""
    reservation = _Reservation((total + PAGE - 1) // PAGE * PAGE)
    at = 0
    for e in pieces:
        length = (e.nbytes + PAGE - 1) // PAGE * PAGE
        seg = segments[e.segment]
        if e.offset + length > seg.numel():  # the last page past the segment's mapping: not mappable in place
            return None
        got = _libc.mremap(seg.data_ptr() + e.offset, 0, length, _MREMAP_MAYMOVE | _MREMAP_FIXED,
                           reservation.address + at)
        if got != reservation.address + at:
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.EFAULT):  # a private (copy-on-write) or huge-page mapping
                return None
            raise ShmError(f"cannot map an extent of segment {e.segment}: {os.strerror(code)}")
        at += e.nbytes
    buffer = (ctypes.c_char * total).from_address(reservation.address)
    buffer.reservation = reservation  # unmapped when the last tensor over it goes
    return torch.frombuffer(buffer, dtype=torch.uint8)


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
