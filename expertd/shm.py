"""Read-only mappings of the daemon's segments and tensor views over them (no copies).

Workers map what they serve from; the daemon maps an older generation's segments the same way
when it copies unchanged parts into a new one.

A mapping stays valid after the daemon unlinks its segment, until the last process unmaps it;
every view keeps its mapping alive, so no mapping is ever closed under a live tensor. Views are
read-only at the page level: a worker that writes into one dies with SIGSEGV instead of
changing what other workers see.

A segment is a file in the daemon's `shm_dir` (the index names it): `/dev/shm` by default, where
POSIX shm_open puts it too, or a huge-page tmpfs or hugetlbfs mount. `segment_path` is the one
rule from a segment's name to its file.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import warnings

import torch

from expertd.errors import ShmError
from expertd.dtypes import BY_NAME as DTYPES
from expertd.index import DEFAULT_SHM_DIR, TensorEntry
from expertd.trust import check_owner

OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC  # what shm_open uses: a segment is never a symlink


def to_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ShmError(f"index names unknown dtype {name!r}") from None


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
            raise ShmError(f"cannot map shared-memory segment {name} ({path}, {nbytes} bytes): {exc.strerror}{hint}") from exc
    finally:
        os.close(fd)


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
    seg = segments.get(entry.segment)
    if seg is None or entry.offset < 0 or entry.offset + entry.nbytes > seg.numel():
        raise ShmError(f"index entry {entry.name} lies outside segment {entry.segment}")
    if count == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return seg[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)
