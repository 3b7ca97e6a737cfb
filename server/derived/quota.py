"""What derived tensors may take: bytes in pages and files, per reader and for the whole daemon, and never the room
a push or a reload needs.

A reader is who the transport says sent a request (`reader_of`: the uid on ipc://, the CURVE key on tcp://), never
a process or a connection. Each derived tensor counts against the reader whose request made it, in whole pages of
the shm_dir's unit (a one-element gather takes a page and a file). Limits (config): `max_derived_bytes` (default
the served bytes of every live generation, summed: each generation may derive up to its own, so engines refreshing
onto a new generation while the old one lives get its layouts too) and `max_derived_files` for the daemon,
`max_derived_bytes_per_reader` and `max_derived_files_per_reader` for each reader (default the daemon's). Space is
reserved apart: a derivation is refused when it would leave the shm_dir less free space than the latest generation's
served bytes (what a reload writes, or a push of up to half of them with its staging), so derived tensors never make
a push or a reload fail.
Usage is computed from the live generations' derived tensors (a segment several generations reuse counts once) plus the
work a derivation job has reserved: there is no counter to drift.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from expertd.errors import DerivedLimit

from ..shm import shmdir
from ..shm.arena import align_up


def reader_of(peer) -> str:
    """Who a request's derived tensors count against: its holder (`Peer.holder`: the CURVE key on tcp://, the uid on
    ipc://), "local" for a request no transport names."""
    return peer.holder or "local"


@dataclass
class Usage:
    bytes: int = 0
    files: int = 0
    readers: dict = field(default_factory=dict)  # reader -> [bytes, files]

    def add(self, reader: str, placed: int, files: int = 1) -> None:
        self.bytes += placed
        self.files += files
        mine = self.readers.setdefault(reader, [0, 0])
        mine[0] += placed
        mine[1] += files


class Quota:
    def __init__(self, cfg, gens):
        self.cfg, self.gens = cfg, gens
        self.unit = shmdir.inspect(cfg.shm_dir, strict=False).unit
        self._reserved: dict[int, tuple[str, int, int]] = {}  # job -> (reader, bytes, files) being made
        self._pages_of: dict[int, int] = {}  # generation -> its served bytes in pages (live ones and the latest)

    def reserve(self, job: int, reader: str, nbytes: int, files: int) -> None:
        """Count what derivation job `job` makes for `reader` (`nbytes` placed, in `files`) until it is listed."""
        self._reserved[job] = (reader, nbytes, files)

    def release(self, job: int) -> None:
        """Stop counting job `job`'s reservation: what it made is listed in its generation now, or went."""
        self._reserved.pop(job, None)

    def placed(self, nbytes: int) -> int:
        """The bytes a derived tensor of `nbytes` takes in shm_dir: whole pages (units) of the folder, at least one."""
        return align_up(max(nbytes, 1), self.unit)

    def served(self) -> int:
        """The latest generation's served bytes in pages (limits are read on every cast, gather and metrics refresh:
        a DeepSeek-V3 index has tens of thousands of tensors, so each generation's are summed once)."""
        latest = self.gens.latest
        return 0 if latest is None else self._pages(latest)

    def live_served(self) -> int:
        """The served bytes in pages of every live generation, summed."""
        return sum(self._pages(gen) for gen in self.gens.live.values())

    def _pages(self, gen) -> int:
        """`gen`'s served bytes in pages, summed once (a retired generation's sum is dropped at the next new one)."""
        if gen.number not in self._pages_of:
            for number in set(self._pages_of) - set(self.gens.live):
                del self._pages_of[number]
            self._pages_of[gen.number] = sum(self.placed(t.nbytes) for t in gen.index.tensors)
        return self._pages_of[gen.number]

    def limits(self) -> dict:
        served = self.served()
        most = self.cfg.max_derived_bytes if self.cfg.max_derived_bytes is not None else self.live_served()
        per_bytes, per_files = self.cfg.max_derived_bytes_per_reader, self.cfg.max_derived_files_per_reader
        return {"max_bytes": most, "max_files": self.cfg.max_derived_files,
                "max_bytes_per_reader": most if per_bytes is None else min(per_bytes, most),
                "max_files_per_reader": self.cfg.max_derived_files if per_files is None else per_files,
                "shm_reserve": served}

    def usage(self) -> Usage:
        """What derived tensors take now: those of the live generations, each segment once, and those being made. A
        derived layout of ranges (`derived/extents`) also keeps alive the older layouts' segments its ranges lie in:
        one whose own derived tensor has retired counts against the reader of the derived tensor that keeps it."""
        usage, seen = Usage(), set()
        derived = [v for gen in self.gens.live.values() for v in gen.derived.values() if v.key]
        for v in derived:
            if v.created not in seen:
                seen.add(v.created)
                usage.add(v.owner, v.placed)
        for v in derived:
            for segment, size in (v.sizes or {}).items():
                if segment not in seen:
                    seen.add(segment)
                    usage.add(v.owner, size)
        for reader, nbytes, files in self._reserved.values():
            usage.add(reader, nbytes, files)
        return usage

    def check(self, reader: str, sizes: list[int], generation: int, what: str = "") -> None:
        """Refuse (DerivedLimit, naming the limit) a request of derived tensors of `sizes` placed bytes that would
        take `reader` or the daemon past a limit, or the shm_dir's free space into what pushes and reloads need."""
        if not sizes:
            return
        limits, usage = self.limits(), self.usage()
        mine = usage.readers.get(reader, [0, 0])
        need, files = sum(sizes), len(sizes)
        over = [(f"max_derived_bytes_per_reader={limits['max_bytes_per_reader']}", mine[0] + need,
                 limits["max_bytes_per_reader"]),
                (f"max_derived_files_per_reader={limits['max_files_per_reader']}", mine[1] + files,
                 limits["max_files_per_reader"]),
                (f"max_derived_bytes={limits['max_bytes']}", usage.bytes + need, limits["max_bytes"]),
                (f"max_derived_files={limits['max_files']}", usage.files + files, limits["max_files"])]
        for name, after, most in over:
            if after > most:
                raise DerivedLimit(f"generation {generation}: {files} derived tensor(s) ({what}) of {need} bytes (in "
                                   f"pages) for "
                                   f"{reader} would take it to {after}, past {name} ({reader} holds {mine[0]} bytes "
                                   f"in {mine[1]} file(s); the daemon {usage.bytes} in {usage.files}): nothing made")
        pending = sum(nbytes for _, nbytes, _ in self._reserved.values())
        free = _free(self.cfg.shm_dir) - pending
        if free - need < limits["shm_reserve"]:
            raise DerivedLimit(f"generation {generation}: {need} bytes of derived tensors ({what}) would leave "
                               f"{self.cfg.shm_dir} {max(0, free - need)} bytes free, less than the "
                               f"{limits['shm_reserve']} a reload or a push needs "
                               "(kept apart from derived tensors): nothing made")

    def status(self) -> dict:
        usage = self.usage()
        return {"bytes": usage.bytes, "files": usage.files, **self.limits(),
                "readers": [{"reader": r, "bytes": b, "files": f} for r, (b, f) in sorted(usage.readers.items())]}


def _free(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
