"""The folder segments live in (`shm_dir:`): a tmpfs such as /dev/shm, a tmpfs mounted with huge
pages, or a hugetlbfs mount.

The daemon inspects it once per arena and sizes every segment in the folder's `unit`. A hugetlbfs
file holds whole huge pages only (its f_bsize), and a tmpfs mounted huge=always gives a file whole
huge pages even for its last few bytes (a 4 KiB file takes 2 MiB of the mount's size), so rounding
segments up to the unit costs no space there, keeps the space check honest, and lets the kernel
map every segment with huge pages to its end.
"""

from __future__ import annotations

import os
import time
import re
from dataclasses import dataclass

from expertd.errors import ConfigError

TMPFS, HUGETLBFS = "tmpfs", "hugetlbfs"
SMALL_PAGE = 4096
THP = "/sys/kernel/mm/transparent_hugepage"
MOUNT = "mount -t tmpfs -o size=SIZE,huge=always expertd {path}"  # SIZE: the served bytes and room for a push


def mount_hint(path: str) -> str:
    """How to give `path` a tmpfs: mounted there when it is an empty folder of its own, else on a new folder
    (a mount over a folder that holds files hides them)."""
    try:
        empty = os.path.isdir(path) and not os.listdir(path)
    except OSError:
        empty = False
    target = path if empty or not os.path.exists(path) else "/mnt/expertd"
    make = "" if empty else f"mkdir -p {target} && "
    where = "" if target == path else f", then shm_dir: {target} ({path} holds files a mount would hide)"
    return (f"as root: {make}{MOUNT.format(path=target)}, SIZE the bytes the daemon serves plus room for one push "
            f"(e.g. 1.1x the checkpoint's bf16 size; `expertd inspect` says it){where}")


@dataclass(frozen=True)
class ShmDir:
    path: str
    fstype: str  # "tmpfs" or "hugetlbfs"
    mountpoint: str
    options: tuple[str, ...]
    unit: int  # segment sizes are multiples of this: the huge page size where the kernel uses huge pages

    @property
    def huge(self) -> bool:
        return self.unit > SMALL_PAGE


def _unescape(field: str) -> str:
    """/proc/self/mounts writes space, tab, newline and backslash in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str) -> tuple[str, str, tuple[str, ...]]:
    """(mount point, filesystem type, options) of the mount `path` lies in: the last mounted one wins."""
    real = os.path.realpath(path)
    best = ("/", "", ())
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 4:
                continue
            point = _unescape(parts[1])
            if real == point or real.startswith(point.rstrip("/") + "/"):
                if len(point) >= len(best[0]):
                    best = (point, parts[2], tuple(parts[3].split(",")))
    return best


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def thp_size() -> int:
    """The PMD huge page size transparent huge pages use (2 MiB on x86-64)."""
    value = _read(os.path.join(THP, "hpage_pmd_size"))
    return int(value) if value and value.isdigit() else 2 << 20


def tmpfs_huge(options: tuple[str, ...]) -> bool:
    """Whether the kernel gives files of this tmpfs huge pages without madvise."""
    enabled = _read(os.path.join(THP, "shmem_enabled")) or ""
    if "[force]" in enabled:
        return True
    if "[deny]" in enabled:
        return False
    return any(o in ("huge=always", "huge=within_size") for o in options)


def inspect(path: str, where: str = "shm_dir", strict: bool = True) -> ShmDir:
    """Check that `path` is a folder on tmpfs or hugetlbfs the daemon can create files in.

    `strict=False` only works out the segment unit: an arena on a folder the config did not
    check (the /dev/shm default) behaves as it always did, whatever that folder is.
    """
    if not strict:
        point, fstype, options = mount_of(path)
        return ShmDir(path, fstype, point, options, _unit(path, fstype, options))
    if not os.path.isabs(path):
        raise ConfigError(f"{where}: {path!r} must be an absolute path")
    if not os.path.exists(path):
        raise ConfigError(f"{where}: {path} does not exist; mount a tmpfs for it ({mount_hint(path)}), or leave "
                          "shm_dir out for /dev/shm")
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: {path} is not a directory")
    point, fstype, options = mount_of(path)
    if fstype not in (TMPFS, HUGETLBFS):
        raise ConfigError(
            f"{where}: {path} is on {fstype or 'an unknown filesystem'} (mounted at {point}), not tmpfs or hugetlbfs: "
            f"segments there would not stay in memory; mount a tmpfs ({mount_hint(path)})"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {path} is not writable by this user (uid {os.getuid()})")
    return ShmDir(path, fstype, point, options, _unit(path, fstype, options))


_UNITS: dict[str, tuple[float, ShmDir]] = {}  # folder -> (when read, what `inspect(strict=False)` found)
UNIT_TTL_S = 5.0


def unit_of(path: str) -> ShmDir:
    """`inspect(path, strict=False)`, read again at most every UNIT_TTL_S: every derived tensor makes an arena, and
    reading /proc/self/mounts each time cost the request loop a tenth of its time under a flood of casts."""
    now = time.monotonic()
    seen = _UNITS.get(path)
    if seen is None or now - seen[0] > UNIT_TTL_S:
        seen = _UNITS[path] = (now, inspect(path, strict=False))
    return seen[1]


def _unit(path: str, fstype: str, options: tuple[str, ...]) -> int:
    if fstype == HUGETLBFS:
        return max(os.statvfs(path).f_bsize, SMALL_PAGE)
    if fstype == TMPFS and tmpfs_huge(options):
        return thp_size()
    return SMALL_PAGE


def free_bytes(shm: ShmDir) -> int:
    """Bytes a new segment can still take there: hugetlbfs is bounded by its size= and by the free huge pages."""
    st = os.statvfs(shm.path)
    if shm.fstype != HUGETLBFS:
        return st.f_bavail * st.f_frsize
    pool = os.path.join("/sys/kernel/mm/hugepages", f"hugepages-{shm.unit // 1024}kB")
    free, reserved = _read(os.path.join(pool, "free_hugepages")), _read(os.path.join(pool, "resv_hugepages"))
    pages = int(free or 0) - int(reserved or 0)
    if st.f_blocks > 0:  # mounted with size=: that limit too
        pages = min(pages, st.f_bavail)
    return max(pages, 0) * shm.unit
