"""The shared-memory arena: POSIX segments the daemon creates, fills and finally unlinks.

Segment names are `/{namespace}.{pid}.{tag}.{i}`: `tag` is the generation that created the
segment (or `u{n}` for the staging segment of update n). This module builds and parses them.
The loader gives every served tensor a segment of its own, so a retired generation's bytes are
freed by unlinking whole segments, while workers still holding old views keep valid pages.

Segments are created 0600 with O_EXCL, reserved with posix_fallocate before the first write
(tmpfs then fails with ENOSPC instead of killing the writer with SIGBUS, and pre-faulted pages
fill several times faster), and mapped read-write only in the daemon.
"""

from __future__ import annotations

import errno
import grp
import math
import mmap
import os
import re
from dataclasses import dataclass

import posix_ipc
import torch

from expertd.errors import ShmError, ShmSpaceError
from expertd.index import SegmentEntry

ALIGN = 4096  # every tensor starts on a page: views are aligned for any dtype and vector width
SHM_DIR = "/dev/shm"


@dataclass
class Placement:
    segment: str
    offset: int


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def segment_name(namespace: str, pid: int, tag: int | str, i: int) -> str:
    return f"/{namespace}.{pid}.{tag}.{i:03d}"


def segment_pattern(namespace: str) -> re.Pattern:
    """Matches a segment's file name in SHM_DIR; group 1 is the owner pid."""
    return re.compile(rf"^{re.escape(namespace)}\.(\d+)\.(\d+|u\d+)\.(\d+)$")


def unlink_segment(name: str) -> bool:
    """Remove a segment by name; False if it was already gone. Live mappings stay valid."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class Arena:
    """Segments `/{namespace}.{pid}.{tag}.{i}` of one generation; tensors page-aligned, never spanning segments."""

    def __init__(self, namespace: str, tag: int | str, segment_bytes: int = 0, group: str | None = None):
        self.namespace = namespace
        self.tag = tag
        self.gid = grp.getgrnam(group).gr_gid if group else None
        self.segment_bytes = segment_bytes  # 0: every tensor in a segment of its own
        self.segments: list[SegmentEntry] = []
        self._maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, int] = {}  # segments created unreserved: reserved range by range, by `reserve`

    def _new_segment(self, i: int | None = None) -> SegmentEntry:
        number = len(self.segments) if i is None else i
        seg = SegmentEntry(segment_name(self.namespace, os.getpid(), self.tag, number), 0)
        self.segments.append(seg)
        return seg

    def add(self, nbytes: int, i: int | None = None, reserve: bool = True) -> Placement:
        """Create and map a segment of its own for one tensor of `nbytes`, numbered `i` (default: the next).

        With `reserve`, the whole segment is reserved now; without, the caller reserves each range
        with `reserve` before writing it, so that several threads fill one large tensor's pages.
        """
        seg = self._new_segment(i)
        seg.nbytes = max(align_up(nbytes), ALIGN)
        try:
            self._create_one(seg, reserve=reserve)
        except BaseException:
            self.segments.remove(seg)
            raise
        return Placement(seg.name, 0)

    def reserve(self, placement: Placement, offset: int, nbytes: int) -> None:
        """Reserve bytes [offset, offset + nbytes) of a placement made with `add(..., reserve=False)`."""
        if nbytes > 0:
            self._fallocate(self._fds[placement.segment], placement.segment, placement.offset + offset, nbytes)

    def check_space(self, need: int, shm_dir: str = SHM_DIR) -> None:
        """Refuse before the first byte when `need` bytes cannot fit: a clear error instead of ENOSPC half-way."""
        free = shm_free_bytes(shm_dir)
        if need > free:
            raise ShmSpaceError(
                f"{shm_dir} has {free / 2**20:.1f} MiB free but the model needs {need / 2**20:.1f} MiB; "
                f"give the container more shared memory (docker run --shm-size={math.ceil(need * 1.1 / 2**30)}g, "
                f"or shm_size: in docker-compose) or free space in {shm_dir}"
            )

    def place(self, sizes: list[int]) -> list[Placement]:
        """Assign each size a segment and offset; a tensor never spans segments."""
        placements, used = [], None
        for size in sizes:
            size = max(align_up(size), ALIGN)
            if used is None or used + size > self.segment_bytes:
                self._new_segment()
                used = 0
            placements.append(Placement(self.segments[-1].name, used))
            used += size
            self.segments[-1].nbytes = used
        return placements

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def create(self, shm_dir: str = SHM_DIR, writable_by_group: bool = False) -> None:
        """Create, reserve and map every planned segment; on any failure remove what was made."""
        self.check_space(self.nbytes, shm_dir)
        try:
            for seg in self.segments:
                self._create_one(seg, writable_by_group)
        except BaseException:
            self.unlink()
            raise

    def _create_one(self, seg: SegmentEntry, writable_by_group: bool = False, reserve: bool = True) -> None:
        try:
            shm = posix_ipc.SharedMemory(seg.name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError as exc:
            raise ShmError(f"shared-memory segment {seg.name} already exists") from exc
        try:
            self._maps[seg.name] = None  # created: unlink() must remove it from here on
            if self.gid is not None:
                os.fchown(shm.fd, -1, self.gid)
                os.fchmod(shm.fd, 0o660 if writable_by_group else 0o640)
            if reserve:
                self._fallocate(shm.fd, seg.name, 0, seg.nbytes)
            else:
                os.ftruncate(shm.fd, seg.nbytes)
            self._maps[seg.name] = mmap.mmap(shm.fd, seg.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if not reserve:
                self._fds[seg.name] = os.dup(shm.fd)
        finally:
            shm.close_fd()

    @staticmethod
    def _fallocate(fd: int, name: str, offset: int, nbytes: int) -> None:
        """posix_fallocate: tmpfs then fails with ENOSPC instead of a SIGBUS at the first write past its space."""
        try:
            os.posix_fallocate(fd, offset, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                raise ShmSpaceError(
                    f"no space to reserve {nbytes / 2**20:.1f} MiB for segment {name} in {SHM_DIR}; "
                    "give the container more shared memory (--shm-size / shm_size)"
                ) from exc
            raise ShmError(f"reserving segment {name}: {exc}") from exc

    def tensor(self, placement: Placement, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A writable tensor over a placement's bytes (daemon side only)."""
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        buf = self._maps[placement.segment]
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=placement.offset).view(shape)

    def unmap(self) -> None:
        """Drop the daemon's own writable mappings once loading is done.

        Workers then hold the only mappings (so each of N workers accounts for 1/N of the pages),
        and no stray write of the daemon can reach served bytes. The caller must hold no tensor
        over these mappings any more: closing under a live tensor would leave it dangling.
        """
        for name, mapping in self._maps.items():
            if mapping is not None:
                mapping.close()
            self._maps[name] = None
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def unlink(self) -> None:
        """Remove every segment this arena created. Mappings stay valid until their last user unmaps."""
        for name in list(self._maps):
            unlink_segment(name)
        self._close_fds()
        # The daemon's own mappings are dropped with the arena object, never closed under live tensors.
        self._maps.clear()
