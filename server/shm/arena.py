"""The shared-memory arena: POSIX segments the daemon creates, fills and finally unlinks.

Segment names are `/{namespace}.{pid}.{tag}.{i}.{random}`: `tag` is the generation that created the
segment (`u{n}` for the staging segment of update n, `i{n}` for generation n's packed index, `v{n}` for
generation n's dtype casts, see `derived/tensors`); `random` is 64 fresh random bits per segment, so that no
other uid can plant a file under a name the daemon is about to create (the pid shows in `ls /dev/shm`), and a
name found taken all the same (O_EXCL says EEXIST) is drawn again, a few times at most.
This module builds and parses them; the start-up reaper finds this namespace's segments by their pattern.
The loader gives every served tensor a segment of its own, so a retired generation's bytes are
freed by unlinking whole segments, while workers still holding old views keep valid pages.

Segments are files in the daemon's `shm_dir` (/dev/shm, where shm_open would put them, or a
huge-page tmpfs or hugetlbfs mount; see `shmdir`), sized in that folder's unit. They are created
0600 with O_EXCL, reserved with posix_fallocate before the first write (tmpfs then fails with
ENOSPC instead of killing the writer with SIGBUS, and pre-faulted pages fill several times
faster), and mapped read-write only in the daemon.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import logging
import math
import mmap
import os
import re
import secrets
from dataclasses import dataclass

from expertd.errors import ShmError, ShmSpaceError
from expertd.index import DEFAULT_SHM_DIR, SegmentEntry
from expertd.segments import OPEN_FLAGS, segment_path

from . import hostpaths, shmdir

log = logging.getLogger("expertd.arena")

ALIGN = 4096  # every tensor starts on a page: views are aligned for any dtype and vector width
SHM_DIR = DEFAULT_SHM_DIR
NAME_RANDOM_BYTES = 8  # a segment name's random part: 16 hex digits
CREATE_TRIES = 8  # names drawn for one segment before giving up: each taken one is a file someone planted


@dataclass
class Placement:
    segment: str
    offset: int


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def placed_size(nbytes: int) -> int:
    """The bytes a tensor of `nbytes` takes in a shared segment: whole pages, at least one."""
    return max(align_up(nbytes), ALIGN)


def segment_prefix(namespace: str, pid: int, tag: int | str) -> str:
    """What every segment name of `tag` made by process `pid` starts with."""
    return f"/{namespace}.{pid}.{tag}."


def segment_name(namespace: str, pid: int, tag: int | str, i: int) -> str:
    """A fresh segment name: its last part is random, so that nobody can know it before the daemon creates it."""
    return f"{segment_prefix(namespace, pid, tag)}{i:03d}.{secrets.token_hex(NAME_RANDOM_BYTES)}"


def segment_pattern(namespace: str) -> re.Pattern:
    """Matches a segment's file name in its shm_dir (also one without the random part, as daemons before it
    named them); group 1 is the owner pid, group 2 the tag."""
    random = rf"(?:\.[0-9a-f]{{{2 * NAME_RANDOM_BYTES}}})?"
    return re.compile(rf"^{re.escape(namespace)}\.(\d+)\.(\d+|[uiv]\d+)\.(\d+){random}$")


def unlink_segment(name: str, shm_dir: str = SHM_DIR) -> bool:
    """Remove a segment by name; False if it was already gone, or is another user's file (left alone, one log
    line: a name is no proof that the daemon made it). Live mappings stay valid."""
    return hostpaths.unlink_owned(segment_path(name, shm_dir), "segment")


def mount_size(nbytes: int) -> str:
    """`nbytes` and a tenth more, rounded up to a whole MiB (GiB from 10 GiB on) as tmpfs size= and docker
    --shm-size write it: "11m" for a 9.6 MiB model, "77g" for a 70 GiB one."""
    mib = math.ceil(nbytes * 1.1 / 2**20)
    return f"{math.ceil(mib / 1024)}g" if mib >= 10 * 1024 else f"{max(1, mib)}m"


def check_free(shm: shmdir.ShmDir, shm_dir: str, need: int) -> None:
    """ShmSpaceError (one line: what is free, what is needed, the fix) when `need` bytes do not fit in `shm_dir`."""
    free = shmdir.free_bytes(shm)
    if need > free:
        pages = " (in huge pages)" if shm.huge else ""
        raise ShmSpaceError(f"{shm_dir} has {free / 2**20:.1f} MiB free but the model needs {need / 2**20:.1f} MiB"
                            f"{pages}; " + more_space_hint(shm_dir, need))


def more_space_hint(shm_dir: str, need: int) -> str:
    """How to get room for `need` more bytes in `shm_dir`, the size suggested following from `need`."""
    if shm_dir == DEFAULT_SHM_DIR:
        return (f"give the container more shared memory (docker run --shm-size={mount_size(need)}, "
                f"or shm_size: in docker-compose) or free space in {shm_dir}")
    return f"mount {shm_dir} with a larger size= (at least {mount_size(need)}) or free space in it"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23


def _populate_write(address: int, nbytes: int) -> None:
    """madvise(MADV_POPULATE_WRITE): best effort (an older kernel says EINVAL and nothing changes)."""
    _libc.madvise(address, nbytes, MADV_POPULATE_WRITE)


class Arena:
    """Segments `/{namespace}.{pid}.{tag}.{i}.{random}` of one generation; tensors page-aligned, never spanning
    segments."""

    def __init__(self, namespace: str, tag: int | str, segment_bytes: int = 0, group: str | None = None,
                 shm_dir: str = SHM_DIR):
        self.namespace = namespace
        self.tag = tag
        self.shm = shmdir.unit_of(shm_dir)  # the config checked it; here only its unit matters
        self.shm_dir = shm_dir
        self.gid = grp.getgrnam(group).gr_gid if group else None
        self.segment_bytes = segment_bytes  # 0: every tensor in a segment of its own
        self.segments: list[SegmentEntry] = []
        self._maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, tuple[int, int]] = {}  # unreserved segments: (fd, mapping address), for `reserve`
        self._placed: list[Placement] = []  # what `place` handed out: renamed with their segment (see `_open_new`)

    def _new_segment(self, i: int | None = None) -> SegmentEntry:
        number = len(self.segments) if i is None else i
        seg = SegmentEntry(segment_name(self.namespace, os.getpid(), self.tag, number), 0)
        self.segments.append(seg)
        return seg

    def segment_size(self, nbytes: int) -> int:
        """The size of a segment holding `nbytes`: whole pages of the folder (huge pages on a huge mount)."""
        return align_up(max(nbytes, 1), self.shm.unit)

    def add(self, nbytes: int, i: int | None = None, reserve: bool = True) -> Placement:
        """Create and map a segment of its own for one tensor of `nbytes`, numbered `i` (default: the next).

        With `reserve`, the whole segment is reserved now; without, the caller reserves each range
        with `reserve` before writing it, so that several threads fill one large tensor's pages.
        """
        seg = self._new_segment(i)
        seg.nbytes = self.segment_size(nbytes)
        try:
            self._create_one(seg, reserve=reserve)
        except BaseException:
            self.segments.remove(seg)
            if seg.name in self._maps:  # created, then failed (no space, chown, map): remove it here
                self.unmap_segment(seg.name)
                del self._maps[seg.name]
                unlink_segment(seg.name, self.shm_dir)
            raise
        return Placement(seg.name, 0)

    def write(self, placement: Placement, data: bytes) -> None:
        """Copy raw bytes to a placement (daemon side only)."""
        self._maps[placement.segment][placement.offset : placement.offset + len(data)] = data

    @property
    def writes(self) -> bool:
        """Whether `pwrite` can fill segments: tmpfs can, hugetlbfs has no write() (only its mappings)."""
        return self.shm.fstype != shmdir.HUGETLBFS

    def reserve(self, placement: Placement, offset: int, nbytes: int, populate: bool = True) -> None:
        """Reserve bytes [offset, offset + nbytes) of a placement made with `add(..., reserve=False)`
        (a huge-page folder reserves the whole pages around them); with `populate`, for writes through
        the mapping, also map the pages in (`pwrite` needs no mapping)."""
        if nbytes > 0:
            fd, address = self._fds[placement.segment]
            start = placement.offset + offset
            self._fallocate(fd, placement.segment, start, nbytes)
            if populate:
                # Map the reserved pages into the writable mapping in one call instead of one fault per page
                # (Linux >= 5.14; elsewhere the first writes fault them in as before).
                first = start // ALIGN * ALIGN
                _populate_write(address + first, align_up(start + nbytes) - first)

    def pwrite(self, placement: Placement, offset: int, data: memoryview) -> None:
        """Write `data` at byte `offset` of a placement made with `add(..., reserve=False)`, through the
        segment's file: tmpfs then takes each fresh page without zeroing it first, where a write through
        the mapping has the kernel zero the page and then writes it again."""
        fd = self._fds[placement.segment][0]
        at = placement.offset + offset
        while len(data):
            try:
                done = os.pwrite(fd, data, at)
            except OSError as exc:
                raise self.write_error(placement, at - placement.offset, len(data), exc.errno) from exc
            data, at = data[done:], at + done

    def fd(self, placement: Placement) -> int:
        """The open file of a placement made with `add(..., reserve=False)`, for compiled writes (`pwrite`'s rules)."""
        return self._fds[placement.segment][0]

    def write_error(self, placement: Placement, offset: int, nbytes: int, code: int) -> ShmError:
        """The error for a write of `nbytes` at `offset` of a placement that failed with errno `code`."""
        at = placement.offset + offset
        return self._os_error(OSError(code, os.strerror(code)),
                              f"write {nbytes} bytes at offset {at} of segment {placement.segment}", nbytes)

    def check_space(self, need: int) -> None:
        """Refuse before the first byte when `need` bytes cannot fit: a clear error instead of ENOSPC half-way."""
        check_free(self.shm, self.shm_dir, need)

    def place(self, sizes: list[int]) -> list[Placement]:
        """Assign each size a segment and offset; a tensor never spans segments."""
        placements, used = [], None
        for size in map(placed_size, sizes):
            if used is None or used + size > self.segment_bytes:
                self._new_segment()
                used = 0
            placements.append(Placement(self.segments[-1].name, used))
            self._placed.append(placements[-1])
            used += size
            self.segments[-1].nbytes = self.segment_size(used)
        return placements

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def create(self, private: bool = False) -> None:
        """Create, reserve and map every planned segment; on any failure remove what was made. `private`
        (staging): 0600 even in group mode (`updates.Staging` lets its updater alone write it)."""
        self.check_space(self.nbytes)
        try:
            for seg in self.segments:
                self._create_one(seg, private)
        except BaseException:
            self.unlink()
            raise

    def _open_new(self, seg: SegmentEntry) -> int:
        """Create `seg`'s file (0600, O_EXCL, never through a link). A name already taken is someone else's file:
        left alone, and `seg` (and the placements in it) take a freshly drawn name, up to CREATE_TRIES times."""
        for _ in range(CREATE_TRIES):
            path = segment_path(seg.name, self.shm_dir)
            self._maps[seg.name] = None  # unlink() removes it from here on (an interrupt may come right after open)
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
            except FileExistsError:
                del self._maps[seg.name]  # not ours: never unlink it
                log.warning("a file already has the name of segment %s (%s): left alone, another name drawn",
                            seg.name, path)
                self._rename(seg)
            except OSError as exc:
                del self._maps[seg.name]  # nothing was created
                raise ShmError(f"cannot create shared-memory segment {seg.name} ({path}): {exc.strerror}") from exc
        prefix = segment_prefix(self.namespace, os.getpid(), self.tag)
        raise ShmError(f"cannot create a shared-memory segment named {prefix}*: {CREATE_TRIES} random names in a row "
                       f"were taken in {self.shm_dir}")

    def _rename(self, seg: SegmentEntry) -> None:
        old = seg.name
        seg.name = f"{old.rsplit('.', 1)[0]}.{secrets.token_hex(NAME_RANDOM_BYTES)}"
        for placement in self._placed:
            if placement.segment == old:
                placement.segment = seg.name

    def _create_one(self, seg: SegmentEntry, private: bool = False, reserve: bool = True) -> None:
        fd = self._open_new(seg)
        try:
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
                os.fchmod(fd, 0o600 if private else 0o640)
            if reserve:
                self._fallocate(fd, seg.name, 0, seg.nbytes)
            else:
                os.ftruncate(fd, seg.nbytes)
            try:
                self._maps[seg.name] = mmap.mmap(fd, seg.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:  # hugetlbfs reserves the huge pages of a shared mapping when it is made
                doing = f"map {seg.nbytes / 2**20:.1f} MiB of segment {seg.name}"
                raise self._os_error(exc, doing, seg.nbytes) from exc
            if not reserve:
                address = ctypes.addressof(ctypes.c_char.from_buffer(self._maps[seg.name]))
                self._fds[seg.name], fd = (fd, address), -1  # kept open for `reserve`
        finally:
            if fd >= 0:
                os.close(fd)

    def _fallocate(self, fd: int, name: str, offset: int, nbytes: int) -> None:
        """posix_fallocate: tmpfs then fails with ENOSPC instead of a SIGBUS at the first write past its space."""
        try:
            os.posix_fallocate(fd, offset, nbytes)
        except OSError as exc:
            raise self._os_error(exc, f"reserve {nbytes / 2**20:.1f} MiB for segment {name}", nbytes) from exc

    def _os_error(self, exc: OSError, doing: str, nbytes: int) -> ShmError:
        """The error to raise for an OSError while `doing` something to a segment: out of space or memory (on
        hugetlbfs, out of huge pages) is a ShmSpaceError saying how to get more; anything else a ShmError."""
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            return ShmSpaceError(f"no space to {doing} in {self.shm_dir}; " + more_space_hint(self.shm_dir, nbytes))
        return ShmError(f"cannot {doing} in {self.shm_dir}: {exc.strerror}")

    def tensor(self, placement: Placement, shape: tuple[int, ...], dtype):
        """A writable tensor over a placement's bytes (daemon side only: builds, which have imported torch)."""
        import torch

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
        for name in list(self._maps):
            self.unmap_segment(name)
        self._close_fds()

    def unmap_segment(self, name: str) -> None:
        """`unmap` for one segment whose tensor is complete (a loader thread may call it while others fill)."""
        mapping = self._maps.get(name)
        if mapping is not None:
            self._maps[name] = None
            mapping.close()
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd[0])

    def _close_fds(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def unlink(self) -> None:
        """Remove every segment this arena created. Mappings stay valid until their last user unmaps."""
        for name in list(self._maps):
            unlink_segment(name, self.shm_dir)
        self._close_fds()
        # The daemon's own mappings are dropped with the arena object, never closed under live tensors.
        self._maps.clear()
