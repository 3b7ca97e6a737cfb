"""Segment files: the one rule from a segment's name to its file, and mapping one (the standard library only).

A segment is a file in the daemon's `shm_dir` (the index names it): `/dev/shm` by default, where POSIX
shm_open puts it too, or a huge-page tmpfs or hugetlbfs mount. The daemon's control plane (adoption, the
run state, the index segment) and the clients both open segments through here; tensor views over them are
`expertd.shm`'s. `Placed` hashes index entries where they lie (verify and adoption alike).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from .errors import ShmError
from .extents import Extent, extents_of, split
from .index import DEFAULT_SHM_DIR, checksum_parts, checksum_text, combined_checksum
from .trust import check_owner

OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC  # what shm_open uses: a segment is never a symlink


def segment_path(name: str, shm_dir: str = DEFAULT_SHM_DIR) -> str:
    """The file of segment `name` ("/{namespace}.{pid}.{tag}.{i}") in `shm_dir`. A name is one file name:
    one that would leave `shm_dir` (a '/' inside, '.', '..', empty) is refused."""
    base = name.lstrip("/")
    if not base or "/" in base or base in (".", ".."):
        raise ShmError(f"segment name {name!r} is not a file name in {shm_dir} (an index that names it is corrupt)")
    return os.path.join(shm_dir, base)


def map_segment(name: str, nbytes: int, writable: bool = False, shared_write: bool = False,
                shm_dir: str = DEFAULT_SHM_DIR) -> mmap.mmap:
    """Map a segment read-only, copy-on-write private (`writable`), or shared read-write
    (`shared_write`: only for the staging segment an updater fills)."""
    path = segment_path(name, shm_dir)
    try:
        fd = os.open(path, (os.O_RDWR if shared_write else os.O_RDONLY) | OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise ShmError(f"shared-memory segment {name} ({path}) does not exist (daemon gone or restarted?)") from exc
    except PermissionError as exc:
        raise ShmError(f"no permission to open shared-memory segment {name} ({path}); run the worker as the "
                       "daemon's user, or set group: in the daemon's config and add the worker's user to it") from exc
    except OSError as exc:
        raise ShmError(f"cannot open shared-memory segment {name} ({path}): {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        check_owner(path, st)  # a segment of someone this process does not trust is never mapped
        size = st.st_size
        if size < nbytes:
            raise ShmError(f"segment {name} ({path}) has {size} bytes, index says {nbytes}")
        try:
            if shared_write:
                return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if writable:
                return mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            hint = ""
            if writable and exc.errno == errno.ENOMEM:  # hugetlbfs reserves a private mapping's pages up front
                hint = ("; a copy-on-write map of a hugetlbfs segment needs free huge pages for its whole size: "
                        "attach without copy_on_write, or serve from a huge tmpfs")
            raise ShmError(f"cannot map shared-memory segment {name} ({path}, {nbytes} bytes): "
                           f"{exc.strerror}{hint}") from exc
    finally:
        os.close(fd)


def extents_checksum(read, extents: list[Extent], parts: int) -> str:
    """The index's checksum of the bytes `extents` make (`read(extent)`: that range's bytes as a buffer), combined
    from `parts` equal parts as `expertd.index.tensor_checksum` does, hashed range by range (nothing concatenated)."""
    return combined_checksum(extents_sums(read, extents, parts))


def extents_sums(read, extents: list[Extent], parts: int) -> list[str]:
    """The checksum of each of `parts` equal parts of the bytes `extents` make (`extents_checksum` combines them)."""
    import xxhash

    sums = []
    for part in split(extents, max(parts, 1)):
        h = xxhash.xxh3_64()
        for piece in part:
            data = read(piece)
            try:
                h.update(data)
            finally:
                if isinstance(data, memoryview):
                    data.release()
        sums.append(checksum_text(h.intdigest()))
    return sums


class Placed:
    """Index entries' bytes where they lie: their one range or their extents, each segment mapped read-only once by
    `open_segment(name)` (a client's owner-checked `map_segment`, the daemon's own open), all closed together.
    Threads may share one."""

    def __init__(self, open_segment):
        self.open_segment = open_segment
        self.maps: dict[str, mmap.mmap] = {}
        self.lock = threading.Lock()

    def read(self, extent: Extent) -> memoryview:
        with self.lock:
            if extent.segment not in self.maps:
                self.maps[extent.segment] = self.open_segment(extent.segment)
            mapping = self.maps[extent.segment]
        return memoryview(mapping)[extent.offset: extent.offset + extent.nbytes]

    def checksum(self, entry) -> str:
        """The checksum of `entry`'s bytes as the index records it (its number of parts), hashed range by range."""
        return extents_checksum(self.read, extents_of(entry), checksum_parts(entry.checksum))

    def part_sums(self, entry) -> list[str]:
        """The checksum of each of the parts `entry`'s recorded checksum is combined of (`combined_checksum`)."""
        return extents_sums(self.read, extents_of(entry), checksum_parts(entry.checksum))

    def close(self) -> None:
        for mapping in self.maps.values():
            mapping.close()
        self.maps.clear()

    def __enter__(self) -> Placed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
