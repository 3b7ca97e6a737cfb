"""What derived tensors may take: bytes in pages and files, per reader and for the whole daemon, and never the room
a push or a reload needs.

A reader is who the transport says sent a request (`reader_of`: the uid on ipc://, the listed CURVE key on tcp://,
"anonymous" for every unlisted key), never a process or a connection. A derived tensor counts against every reader
holding it (`derived/holds`: a live lease that asked for it), in whole pages of the shm_dir's unit (a one-element
gather takes a page and a file), and against the daemon while it is listed, held or not. Limits (config):
`max_derived_bytes` (default four times the served bytes of every live generation, summed) and `max_derived_files`
for the daemon; `max_derived_bytes_per_reader` and `max_derived_files_per_reader` for each reader, by default a
quarter of the daemon's: a reader may derive a whole model (say, cast it to float16), and no reader can take what
the others need. Space is reserved apart: a derivation is refused when it would leave the shm_dir less free space than
the latest generation's served bytes (what a reload writes, or a push of up to half of them with its staging), so
derived tensors never make a push or a reload fail.
Usage is computed from the live generations' derived tensors (a segment several generations reuse counts once) and
the leases holding them, plus the work a derivation job has reserved: there is no counter to drift.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from expertd.errors import DerivedLimit

from ..shm import shmdir
from ..shm.arena import align_up


def reader_of(peer) -> str:
    """Who a request's derived tensors count against: its account (`Peer.account`: the uid on ipc://, the listed CURVE
    key on tcp://, "anonymous" for every unlisted one), "local" for a request no transport names."""
    return peer.account or "local"


@dataclass
class Usage:
    bytes: int = 0
    files: int = 0
    readers: dict = field(default_factory=dict)  # reader -> [bytes, files]
    unheld: list = field(default_factory=list)  # derived segments no live lease holds, oldest listed first
    held: dict = field(default_factory=dict)  # reader -> the segments counted against it

    def add(self, readers, placed: int, files: int = 1, segment: str = "") -> None:
        """`placed` bytes in `files` listed (counted for the daemon once), held by each of `readers`."""
        self.bytes += placed
        self.files += files
        for reader in readers:
            mine = self.readers.setdefault(reader, [0, 0])
            mine[0] += placed
            mine[1] += files
            if segment:
                self.held.setdefault(reader, set()).add(segment)


class Quota:
    def __init__(self, cfg, gens, holds):
        self.cfg, self.gens, self.holds = cfg, gens, holds
        self.unit = shmdir.inspect(cfg.shm_dir, strict=False).unit
        self._reserved: dict[int, tuple[str, int, int]] = {}  # job -> (reader, bytes, files) being made
        self._pages_of: dict[int, int] = {}  # generation -> its served bytes in pages (live ones and the latest)
        self._usage: tuple | None = None  # (what it was computed from, Usage)

    def warn_unshared(self, log) -> None:
        """Say at start when one reader may take every derived byte or file while several can read (group mode, or
        CURVE without curve_client_keys): a reader could then shut the others out of derived tensors."""
        cfg = self.cfg
        shared = cfg.group is not None or (cfg.curve_secret_key is not None and cfg.curve_client_keys is None)
        per_bytes, most = cfg.max_derived_bytes_per_reader, cfg.max_derived_bytes
        whole_bytes = per_bytes is not None and (most is None or per_bytes >= most)
        whole_files = (cfg.max_derived_files_per_reader or 0) >= cfg.max_derived_files
        if shared and (whole_bytes or whole_files):
            log.warning("max_derived_%s_per_reader lets one reader take every derived %s of the daemon while other "
                        "users may read (%s): one reader can then shut the others out of casts and gathers; leave it "
                        "out (a quarter of the daemon's) or set it lower", "bytes" if whole_bytes else "files",
                        "byte" if whole_bytes else "file", "group mode" if cfg.group is not None else
                        "CURVE without curve_client_keys")

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
        most = self.cfg.max_derived_bytes if self.cfg.max_derived_bytes is not None else 4 * self.live_served()
        per_bytes, per_files = self.cfg.max_derived_bytes_per_reader, self.cfg.max_derived_files_per_reader
        return {"max_bytes": most, "max_files": self.cfg.max_derived_files,
                "max_bytes_per_reader": most // 4 if per_bytes is None else min(per_bytes, most),
                "max_files_per_reader": max(1, self.cfg.max_derived_files // 4) if per_files is None else per_files,
                "shm_reserve": served}

    def usage(self) -> Usage:
        """What derived tensors take now (see `_usage`), computed again only when a live generation's derived tensors,
        the leases, the holds or the reservations changed: it is read on every cast and gather, and a host's daemon
        lists thousands of derived tensors."""
        key = (tuple((n, g.derived_changes) for n, g in self.gens.live.items()), self.holds.leases.changes,
               self.holds.changes, tuple(self._reserved.items()))
        if self._usage is None or self._usage[0] != key:
            self._usage = (key, self._usage_now())
        return self._usage[1]

    def _usage_now(self) -> Usage:
        """What derived tensors take now: those of the live generations, each segment once (for the readers whose
        live leases hold it: `holds`), and those being made. A derived layout of ranges (`derived/extents`) also keeps
        alive the older layouts' segments its ranges lie in: those count against the readers holding the derived tensor
        that keeps them too (and are not reclaimable while it is held)."""
        usage, listed = Usage(), {}
        for gen in self.gens.live.values():
            for v in gen.derived.values():
                if v.key:
                    listed.setdefault(v.created, v)
        self.holds.prune(listed)
        held = {segment: self.holds.accounts(segment) for segment in listed}
        keeps: dict[str, set] = {}  # a segment a derived tensor keeps blocks in -> the readers holding that tensor
        sizes: dict[str, int] = {}
        for segment, v in listed.items():
            for kept, size in (v.sizes or {}).items():
                if kept != segment:
                    keeps.setdefault(kept, set()).update(held[segment])
                    sizes[kept] = size
        for segment, v in listed.items():
            who = held[segment] | keeps.get(segment, set())
            usage.add(who, v.placed, segment=segment)
            if not who:
                usage.unheld.append(segment)
        for kept, who in keeps.items():
            if kept not in listed:
                usage.add(who, sizes[kept], segment=kept)
        for reader, nbytes, files in self._reserved.values():
            usage.add([reader], nbytes, files)
        return usage

    def check(self, reader: str, sizes: list[int], generation: int, what: str = "", reused=()) -> None:
        """Refuse (DerivedLimit, naming the limit) a request of derived tensors of `sizes` placed bytes that would
        take `reader` or the daemon past a limit, or the shm_dir's free space into what pushes and reloads need.
        `reused`: the existing derived tensors the request will hold too (they count against `reader` once it does)."""
        limits, usage = self.limits(), self.usage()
        mine = list(usage.readers.get(reader, [0, 0]))
        theirs = usage.held.get(reader, set())
        more = {v.created: v.placed for v in reused if v.created not in theirs}
        if not sizes and not more:
            return
        mine[0] += sum(more.values())
        mine[1] += len(more)
        need, files = sum(sizes), len(sizes)
        over = [(f"max_derived_bytes_per_reader={limits['max_bytes_per_reader']}", mine[0] + need,
                 limits["max_bytes_per_reader"]),
                (f"max_derived_files_per_reader={limits['max_files_per_reader']}", mine[1] + files,
                 limits["max_files_per_reader"]),
                (f"max_derived_bytes={limits['max_bytes']}", usage.bytes + need, limits["max_bytes"]),
                (f"max_derived_files={limits['max_files']}", usage.files + files, limits["max_files"])]
        for i, (name, after, most) in enumerate(over):
            if after > most:
                raise _limit(i >= 2, f"generation {generation}: {files} derived tensor(s) ({what}) of {need} bytes (in "
                                   f"pages) for "
                                   f"{reader} would take it to {after}, past {name} ({reader} holds {mine[0]} bytes "
                                   f"in {mine[1]} file(s); the daemon {usage.bytes} in {usage.files}): nothing made")
        pending = sum(nbytes for _, nbytes, _ in self._reserved.values())
        free = _free(self.cfg.shm_dir) - pending
        if need and free - need < limits["shm_reserve"]:
            raise _limit(True, f"generation {generation}: {need} bytes of derived tensors ({what}) would leave "
                               f"{self.cfg.shm_dir} {max(0, free - need)} bytes free, less than the "
                               f"{limits['shm_reserve']} a reload or a push needs "
                               "(kept apart from derived tensors): nothing made")

    def status(self) -> dict:
        usage = self.usage()
        return {"bytes": usage.bytes, "files": usage.files, "unheld_files": len(usage.unheld), **self.limits(),
                "readers": [{"reader": r, "bytes": b, "files": f} for r, (b, f) in sorted(usage.readers.items())]}


def _limit(daemon_wide: bool, words: str) -> DerivedLimit:
    """DerivedLimit, marked when a daemon-wide limit refused it (reclaiming unheld derived tensors may make room)."""
    exc = DerivedLimit(words)
    exc.daemon_wide = daemon_wide
    return exc


def _free(folder: str) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
