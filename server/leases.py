"""The lease table: who reads which generation, and when a lease ends.

A lease is a worker's claim on one generation: its id is 128 random bits (a bearer secret: knowing it is holding
it), counted against its owner (who took it, as the transport vouches: `server.peers.Peer.owner`). It ends on
`release`, after `lease_timeout_s` without a heartbeat, or as soon as its process is gone when the worker runs in
the daemon's pid namespace (`watchable`). The table only records: which generations may then retire is the
generations' lifecycle (`server.generations`), told by the caller.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass

from expertd import procfs
from expertd.errors import LeaseExpired, LeaseLimit
from expertd.protocol import clip

log = logging.getLogger("expertd.generations")

WATCH_EVERY_S = 0.25  # how often a watched lease's process is looked up in /proc (at most)


def lease_tag(client: str) -> str:
    """What status and logs show of a lease id: 8 hex digits of its SHA-256. The id itself is a bearer secret
    (whoever knows it holds the lease), so it is shown in full to nobody but its holder."""
    return hashlib.sha256(client.encode()).hexdigest()[:8]


@dataclass
class Lease:
    client: str
    pid: int
    created: float
    seen: float
    generation: int | None  # None while the first generation is still loading
    # set when the worker runs in the daemon's pid namespace: its process (pid and start time) is watched,
    # and the lease goes as soon as the process does; None: only the heartbeat timeout ends it
    start_time: int | None = None
    checked: float = 0.0  # when the process was last looked up
    owner: str = ""  # who took it (Peer.owner): `max_leases_per_client` counts per owner

    @property
    def watched(self) -> bool:
        return self.start_time is not None


def watchable(pid: int, pid_ns: int | None, start_time: int | None) -> int | None:
    """The start time to watch a worker's process by: the one it sent, when it runs in this process's pid
    namespace and /proc agrees (its pid names it here); None otherwise (another pid namespace, a client too
    old to send these, or a /proc that shows another namespace's pids: the timeout rule only)."""
    if pid_ns is None or start_time is None or pid <= 0 or pid_ns != procfs.pid_namespace():
        return None
    return start_time if procfs.process_start_time(pid) == start_time else None


class LeaseTable:
    """The live leases, by id."""

    def __init__(self, max_leases_per_client: int = 64):
        self.max_leases_per_client = max_leases_per_client
        self.leases: dict[str, Lease] = {}

    def take(self, pid: int, generation: int | None, start_time: int | None = None, owner: str = "") -> Lease:
        """A new lease on `generation` (None while the first one loads); with `start_time` (see `watchable`) its
        process is watched by `expire`. LeaseLimit when `owner` already holds `max_leases_per_client`."""
        held = sum(1 for lease in self.leases.values() if lease.owner == owner)
        if held >= self.max_leases_per_client:
            raise LeaseLimit(f"this client ({owner or 'unknown'}) already holds {held} leases, the daemon's "
                             f"max_leases_per_client; release some (ExpertClient.close()) before taking more")
        now = time.monotonic()
        lease = Lease(secrets.token_hex(16), pid, now, now, generation, start_time, now, owner)
        self.leases[lease.client] = lease
        return lease

    def restore(self, leases: list[dict], live) -> None:
        """Grant again the leases a predecessor recorded on generations in `live` (the daemon restarted under its
        workers), as if each had just beaten (each counted against the owner it was recorded with)."""
        now = time.monotonic()
        for item in leases:
            client, pid, generation = item.get("client"), item.get("pid"), item.get("generation")
            if isinstance(client, str) and isinstance(pid, int) and generation in live:
                # watched again only where /proc here still shows that process (a successor in another pid namespace
                # cannot tell: the timeout rule then)
                start_time = item.get("start_time")
                if not isinstance(start_time, int) or procfs.process_start_time(pid) != start_time:
                    start_time = None
                owner = item.get("owner") if isinstance(item.get("owner"), str) else ""
                self.leases[client] = Lease(client, pid, now, now, generation, start_time, now, owner)

    def recorded(self) -> list[dict]:
        """The leases as the manifest records them for a successor."""
        return [{"client": lease.client, "pid": lease.pid, "generation": lease.generation,
                 "start_time": lease.start_time, "owner": lease.owner}
                for lease in self.leases.values() if lease.generation is not None and lease.pid > 0]

    def get(self, client: str) -> Lease:
        """The lease `client` names; its id is what proves a request comes from its holder."""
        lease = self.leases.get(client)
        if lease is None:
            raise LeaseExpired(f"no lease {clip(client)!r} (expired or released)")
        return lease

    def beat(self, client: str) -> Lease:
        """A heartbeat: the lease lives another `lease_timeout_s`."""
        lease = self.get(client)
        lease.seen = time.monotonic()
        return lease

    def release(self, client: str) -> bool:
        """End a lease; whether there was one."""
        return self.leases.pop(client, None) is not None

    def expire(self, timeout_s: float) -> list[Lease]:
        """Drop leases silent for over `timeout_s`, and watched leases whose process is gone (one /proc read per
        watched lease every `WATCH_EVERY_S` at most); the leases that ended."""
        now = time.monotonic()
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
            del self.leases[lease.client]
        if gone:  # one line per sweep, however many went
            shown = ", ".join(f"{lease_tag(lease.client)} (pid {lease.pid})" for lease in gone[:5])
            log.info("%d lease(s) ended: %d without heartbeat for over %.1fs, %d whose process is gone: %s%s",
                     len(gone), len(silent), timeout_s, len(exited), shown, ", ..." if len(gone) > 5 else "")
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
