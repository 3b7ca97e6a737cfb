"""The lease table: who reads which generation, and when a lease ends.

A lease is a worker's claim on one generation: its id is 128 random bits (a bearer secret, shown to nobody but
its holder), counted against its holder (`server.peers.Peer.holder`, as the transport vouches: a uid on ipc://,
a CURVE key on tcp://); a heartbeat, refresh or release acts only for that holder (anyone else is told, as for an
unknown id, `LeaseExpired`). A lease ends on `release`, after `lease_timeout_s` without a heartbeat, as soon as
its process is gone when the worker runs in the daemon's pid namespace (`watchable`), or when its generation is
revoked to make room for a push (`revoke`: its holder is then told `LeaseRevoked`).

Ending a lease frees a name, not the pages: a process that mapped the generation keeps them. So a lease that
ended without a release (revoked, or silent while its process lives) leaves a `Retained` record: the generation
counts against its holder's `max_leases_per_client` until the holder releases that id or the process is gone
(without a process to watch, for one lease timeout). The table only records: which generations may then retire
is the generations' lifecycle (`server.generations`), told by the caller.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from expertd import procfs
from expertd.errors import LeaseExpired, LeaseLimit, LeaseRevoked, MappedLimit
from expertd.protocol import clip

log = logging.getLogger("expertd.generations")

WATCH_EVERY_S = 0.25  # how often a watched lease's process is looked up in /proc (at most)
RECORDED_LEASES = 1024  # the manifest records at most this many leases (the oldest): its size stays bounded


def lease_tag(client: str) -> str:
    """What status and logs show of a lease id: 8 hex digits of its SHA-256. The id itself is a bearer secret
    (whoever knows it holds the lease), so it is shown in full to nobody but its holder."""
    return hashlib.sha256(client.encode()).hexdigest()[:8]


def holder_of(owner: str) -> str:
    """The holder a recorded owner names: "uid U pid P" (a predecessor counted per process) is "uid U"."""
    words = owner.split()
    return " ".join(words[:2]) if len(words) == 4 and words[0] == "uid" and words[2] == "pid" else owner


@dataclass
class Lease:
    client: str
    pid: int  # the sender's pid as the kernel names it on ipc:// (SO_PEERCRED); elsewhere the pid it claimed
    created: float
    seen: float
    generation: int | None  # None while the first generation is still loading
    # set when the worker runs in the daemon's pid namespace: its process (pid and start time) is watched,
    # and the lease goes as soon as the process does; None: only the heartbeat timeout ends it
    start_time: int | None = None
    checked: float = 0.0  # when the process was last looked up
    owner: str = ""  # its holder (Peer.holder): `max_leases_per_client` counts per holder; "" until claimed
    # the process that took it as the daemon's /proc shows it (ipc://: SO_PEERCRED pid, its start time): what may
    # still map the generation once the lease ends without a release
    process: tuple[int, int] | None = None
    account: str = ""  # whom it counts against when not its holder: "anonymous" for every unlisted CURVE key

    @property
    def counted(self) -> str:
        """Whom `max_leases_per_client` counts it against: its account, else its holder."""
        return self.account or self.owner

    @property
    def watched(self) -> bool:
        return self.start_time is not None

    def where(self) -> str:
        """Who holds it, in words: the kernel's pid on ipc://, else its holder and the pid it claimed."""
        if self.owner.startswith("uid "):
            return f"pid {self.pid} ({self.owner})"
        return f"{clip(self.owner, 24) or 'a client'} (claims pid {self.pid})"


@dataclass
class Retained:
    """A generation a holder's process may still map although its lease ended without a release."""

    owner: str
    generation: int
    process: tuple[int, int] | None  # watched until gone; None: counted until `until`
    until: float
    revoked: bool  # ended by `revoke` (its holder is told LeaseRevoked), else silent too long
    ids: set = field(default_factory=set)  # the ended leases' ids: a release by the holder ends the record
    counted: str = ""  # whom it counts against (the lease's `counted`)


def watchable(pid: int, pid_ns: int | None, start_time: int | None) -> int | None:
    """The start time to watch a worker's process by: the one it sent, when it runs in this process's pid
    namespace and /proc agrees (its pid names it here); None otherwise (another pid namespace, a client too
    old to send these, or a /proc that shows another namespace's pids: the timeout rule only)."""
    if pid_ns is None or start_time is None or pid <= 0 or pid_ns != procfs.pid_namespace():
        return None
    return start_time if procfs.process_start_time(pid) == start_time else None


def process_of(pid: int | None) -> tuple[int, int] | None:
    """(pid, start time) of a process this daemon's /proc shows (an ipc:// sender's SO_PEERCRED pid), else None."""
    start = procfs.process_start_time(pid) if pid else None
    return (pid, start) if start is not None else None


class LeaseTable:
    """The live leases, by id, and what ended leases' holders may still map."""

    def __init__(self, max_leases_per_client: int = 1024, max_leases: int = 4096, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_leases_per_process: int = 16):
        """`clock` is what every heartbeat, timeout and pacing in the table reads (seconds, only ever compared): the
        daemon's is time.monotonic; a test passes one it moves by hand."""
        self.max_leases_per_client = max_leases_per_client
        # one process's share of its holder's (ipc://: the kernel names the process): a process that takes leases
        # without end shuts out itself, not the other processes of its uid
        self.max_leases_per_process = max_leases_per_process
        self._per_process: Counter = Counter()  # (pid, start time) -> its live leases
        self.max_leases = max_leases  # daemon-wide: live leases and retained records together
        self.timeout_s = timeout_s
        self.leases: dict[str, Lease] = {}
        self.retained: dict[tuple, Retained] = {}  # (owner, generation, process) -> record
        self._ended: dict[str, tuple] = {}  # an ended lease's id -> its record's key
        self._held: Counter = Counter()  # whom leases count against (`Lease.counted`) -> live leases
        self._mapped: Counter = Counter()  # the same -> retained records (a generation one of its processes may map)
        self.clock = clock
        self._swept = float("-inf")  # when `expire` last swept the retained records: never yet
        self.changes = 0  # counts every lease taken, ended, claimed or moved: what reads the table may cache by it

    def take(self, pid: int, generation: int | None, start_time: int | None = None, owner: str = "",
             process: tuple[int, int] | None = None, account: str = "") -> Lease:
        """A new lease on `generation` (None while the first one loads); with `start_time` (see `watchable`) its
        process is watched by `expire`. LeaseLimit when `owner` (or `account`, which it counts against when given:
        every unlisted CURVE key is "anonymous") holds `max_leases_per_client` leases (MappedLimit when generations it
        may still map count towards them), or the daemon `max_leases`."""
        counted = account or owner
        held, mapped = self._held[counted], self._mapped[counted]
        if held + mapped >= self.max_leases_per_client:
            who = counted or "an unknown client"
            if mapped:
                raise MappedLimit(
                    f"{who} holds {held} lease(s) and {mapped} generation(s) its processes may still map (leases that "
                    "ended without a release: revoked, or silent while the process lives), together "
                    f"max_leases_per_client={self.max_leases_per_client}; release those (ExpertClient.refresh() or "
                    "close()) or end their processes")
            raise LeaseLimit(f"{who} already holds {held} leases, the daemon's max_leases_per_client; release some "
                             "(ExpertClient.close()) before taking more")
        if process is not None and self._per_process[process] >= self.max_leases_per_process:
            raise LeaseLimit(f"process {process[0]} ({owner or 'an unknown client'}) already holds "
                             f"{self._per_process[process]} leases, the daemon's max_leases_per_process; release some "
                             "(ExpertClient.close()) before taking more: other processes of its user are not held back")
        if len(self.leases) + len(self.retained) >= self.max_leases:
            raise LeaseLimit(f"the daemon holds {len(self.leases)} leases and {len(self.retained)} ended ones still "
                             f"mapped: its max_leases={self.max_leases}, for every client together; retry later")
        now = self.clock()
        lease = Lease(secrets.token_hex(16), pid, now, now, generation, start_time, now, owner, process,
                      account if account != owner else "")
        self.leases[lease.client] = lease
        self.changes += 1
        self._held[counted] += 1
        if process is not None:
            self._per_process[process] += 1
        return lease

    def restore(self, leases: list[dict], live) -> None:
        """Grant again the leases a predecessor recorded on generations in `live` (the daemon restarted under its
        workers), as if each had just beaten (each counted against the holder it was recorded with)."""
        now = self.clock()
        for item in leases[:self.max_leases]:
            client, pid, generation = item.get("client"), item.get("pid"), item.get("generation")
            if isinstance(client, str) and isinstance(pid, int) and generation in live:
                # watched again only where /proc here still shows that process (a successor in another pid namespace
                # cannot tell: the timeout rule then)
                start_time = item.get("start_time")
                if not isinstance(start_time, int) or procfs.process_start_time(pid) != start_time:
                    start_time = None
                owner = holder_of(item["owner"]) if isinstance(item.get("owner"), str) else ""
                account = item["account"] if isinstance(item.get("account"), str) else ""
                process = (pid, start_time) if start_time is not None else None
                lease = Lease(client, pid, now, now, generation, start_time, now, owner, process, account)
                self.leases[client] = lease
                self.changes += 1
                self._held[lease.counted] += 1
                if process is not None:
                    self._per_process[process] += 1

    def recorded(self) -> list[dict]:
        """The leases as the manifest records them for a successor (the oldest RECORDED_LEASES at most)."""
        out = []
        for lease in self.leases.values():
            if lease.generation is not None and lease.pid > 0:
                out.append({"client": lease.client, "pid": lease.pid, "generation": lease.generation,
                            "start_time": lease.start_time, "owner": lease.owner,
                            **({"account": lease.account} if lease.account else {})})
                if len(out) == RECORDED_LEASES:
                    break
        return out

    def get(self, client: str, owner: str | None = None) -> Lease:
        """The lease `client` names, when `owner` holds it (None: whoever names it). Anyone else is answered as for
        an unknown id (LeaseExpired: no reply tells a lease exists); its holder, LeaseRevoked once it is revoked. A
        lease re-granted from a manifest that named no holder is claimed by the first holder that names it."""
        lease = self.leases.get(client)
        if lease is not None and (owner is None or lease.owner == owner or not lease.owner):
            if owner and not lease.owner:
                self.changes += 1
                self._held[lease.counted] -= 1
                lease.owner = owner
                self._held[lease.counted] += 1
            return lease
        record = self.retained.get(self._ended.get(client, ()))
        if lease is None and record is not None and record.revoked and owner in (None, record.owner):
            raise LeaseRevoked(f"lease {lease_tag(client)} was revoked: its generation {record.generation} made room "
                               "for a push (max_generations, revoke_after_s); take a lease on the latest generation "
                               "and release this one")
        raise LeaseExpired(f"no lease {clip(client)!r} (expired or released)")

    def beat(self, client: str, owner: str | None = None) -> Lease:
        """A heartbeat from `owner`: the lease lives another `lease_timeout_s`."""
        lease = self.get(client, owner)
        lease.seen = self.clock()
        return lease

    def release(self, client: str, owner: str | None = None) -> bool:
        """End a lease `owner` holds; whether there was one. The release of an ended one (revoked, or silent) by its
        holder ends what it counted: the holder no longer maps that generation."""
        lease = self.leases.get(client)
        if lease is not None and owner is not None and lease.owner and lease.owner != owner:
            return False
        if lease is not None:
            self._drop(lease)
            return True
        key = self._ended.pop(client, None)
        record = self.retained.get(key) if key is not None else None
        if record is not None and owner in (None, record.owner):
            record.ids.discard(client)
            if not record.ids:
                self._forget(key)
        return False

    def revoke(self, generation: int) -> list[Lease]:
        """End every lease on `generation` (a push needs its room); each one's process may still map it."""
        gone = [lease for lease in self.leases.values() if lease.generation == generation]
        for lease in gone:
            self._drop(lease)
            self._retain(lease, revoked=True)
        return gone

    def move(self, lease: Lease, generation: int) -> None:
        """`lease` reads `generation` now (a refresh; a lease taken while loading, at the first publish)."""
        lease.generation = generation
        self.changes += 1

    def _drop(self, lease: Lease) -> None:
        del self.leases[lease.client]
        self.changes += 1
        self._held[lease.counted] -= 1
        if self._held[lease.counted] <= 0:
            del self._held[lease.counted]
        if lease.process is not None:
            self._per_process[lease.process] -= 1
            if self._per_process[lease.process] <= 0:
                del self._per_process[lease.process]

    def _retain(self, lease: Lease, revoked: bool) -> None:
        """Count `lease`'s generation against its holder until released or its process is gone."""
        if lease.generation is None:
            return
        key = (lease.owner, lease.generation, lease.process)
        record = self.retained.get(key)
        if record is None:
            record = self.retained[key] = Retained(lease.owner, lease.generation, lease.process,
                                                   self.clock() + self.timeout_s, revoked, counted=lease.counted)
            self._mapped[lease.counted] += 1
        record.revoked = record.revoked or revoked
        record.ids.add(lease.client)
        self._ended[lease.client] = key
        while len(self._ended) > 2 * self.max_leases:  # the oldest ids are forgotten: a record ends with its process
            self._ended.pop(next(iter(self._ended)))

    def _forget(self, key: tuple) -> None:
        record = self.retained.pop(key)
        self._mapped[record.counted] -= 1
        if self._mapped[record.counted] <= 0:
            del self._mapped[record.counted]
        for client in record.ids:
            self._ended.pop(client, None)

    def expire(self, timeout_s: float) -> list[Lease]:
        """Drop leases silent for over `timeout_s`, and watched leases whose process is gone (one /proc read per
        watched lease every `WATCH_EVERY_S` at most); the leases that ended. A silent lease's process may still map
        its generation: it counts against its holder until then."""
        now = self.clock()
        silent, exited = [], []
        for lease in self.leases.values():
            if now - lease.seen > timeout_s:
                silent.append(lease)
            elif lease.start_time is not None and now - lease.checked >= WATCH_EVERY_S:
                lease.checked = now
                if not procfs.process_alive(lease.pid, lease.start_time):
                    exited.append(lease)
        gone = silent + exited
        for lease in gone:
            self._drop(lease)
        for lease in silent:
            if lease.process is None or procfs.process_alive(*lease.process):
                self._retain(lease, revoked=False)
        if gone:  # one line per sweep, however many went
            shown = ", ".join(f"{lease_tag(lease.client)} (pid {lease.pid})" for lease in gone[:5])
            log.info("%d lease(s) ended: %d without heartbeat for over %.1fs, %d whose process is gone: %s%s",
                     len(gone), len(silent), timeout_s, len(exited), shown, ", ..." if len(gone) > 5 else "")
        if now - self._swept >= WATCH_EVERY_S:
            self._swept = now
            for key in [k for k, r in self.retained.items()
                        if (now > r.until if r.process is None else not procfs.process_alive(*r.process))]:
                self._forget(key)
        return gone

    def pinned(self) -> dict[int, list[Lease]]:
        """The leases on each generation."""
        out: dict[int, list[Lease]] = {}
        for lease in self.leases.values():
            if lease.generation is not None:
                out.setdefault(lease.generation, []).append(lease)
        return out

    def status(self, now: float) -> list[dict]:
        """One row per lease, as `status` shows it (never its id)."""
        return [{"client": lease_tag(lease.client), "pid": lease.pid, "generation": lease.generation,
                 "age_s": round(now - lease.created, 3), "idle_s": round(now - lease.seen, 3), "watched": lease.watched}
                for lease in self.leases.values()]
