"""Generations: what the daemon serves, who holds what, and when bytes can go.

A `Generation` is one published set of served tensors: its index, the segments its build
created, its index packed into a read-only segment of its own (named in lease replies, see
`expertd.index_segment`; unlinked when the generation retires) and the leases on it. Generation N+1 shares every unchanged
tensor's bytes with N (its index points into N's segments). A generation older than the latest
is retired when no lease holds it; its segments that no live generation references are then
unlinked. Workers that still map them keep valid, unchanged pages until they drop their views:
an unlinked segment lives until its last mapping goes.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import secrets
import time
from dataclasses import dataclass

from expertd import index_segment, procfs
from expertd.errors import GenerationGone, GenerationLimit, LeaseExpired, LeaseLimit
from expertd.index import TensorIndex
from expertd.protocol import clip, pack

from .arena import Arena, unlink_segment
from .built import Built

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
    owner: str = ""  # who took it (the daemon's words, see Daemon.owner): `max_leases_per_client` counts per owner

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


def place_index(index: TensorIndex, group: str | None = None) -> dict:
    """Pack an index into a segment of its own (`/{namespace}.{pid}.i{generation}.000`, same owner and mode
    rules as the tensors' segments); returns the descriptor lease replies carry."""
    blob, desc = index_segment.pack(index)
    arena = Arena(index.namespace, f"i{index.generation}", group=group, shm_dir=index.shm_dir)
    placement = arena.add(len(blob))
    try:
        arena.write(placement, blob)
    except BaseException:
        arena.unlink()
        raise
    arena.unmap()  # the daemon keeps no writable mapping: the bytes stay as handed out
    return {"segment": placement.segment, **desc}


class Generation:
    def __init__(self, built: Built, index_place: dict):
        self.built = built
        self.index = built.index
        self.number = built.index.generation
        self.index_place = index_place  # the index segment's descriptor, as lease replies carry it
        self._reply: tuple[int, bytes] | None = None
        self.variants: dict[tuple[str, str], object] = {}  # (served name, dtype) -> variants.Variant
        self._variant_numbers = itertools.count()

    def next_variant(self) -> int:
        """The number of this generation's next variant segment (`/{namespace}.{pid}.v{N}.{k}`)."""
        return next(self._variant_numbers)

    def drop_variant(self, variant) -> None:
        """Unlink a variant's segment that no request got (its request failed after it was cast)."""
        unlink_segment(variant.entry.segment, self.index.shm_dir)

    def index_reply(self, latest: int) -> bytes:
        """The packed reply of the `index` op (the index inline, for tools that ask over the socket), built once
        per (generation, latest)."""
        if self._reply is None or self._reply[0] != latest:
            self._reply = (latest, pack({"ok": True, "index": self.index.to_dict(), "latest": latest}))
        return self._reply[1]

    def segments(self) -> set[str]:
        """Every segment this generation uses: its tensors' and its dtype variants'."""
        return {s.name for s in self.index.segments} | {v.entry.segment for v in self.variants.values()}

    def drop_index(self) -> None:
        """Unlink the index segment (the generation retires); workers that mapped it have decoded it already."""
        unlink_segment(self.index_place["segment"], self.index.shm_dir)

    def places(self) -> set[tuple[str, int]]:
        return {(t.segment, t.offset) for t in self.index.tensors}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.index.tensors)


class Generations:
    """The live generations and the leases on them."""

    def __init__(self, max_generations: int = 3, on_retire=None, max_leases_per_client: int = 64):
        self.max_generations = max_generations
        self.max_leases_per_client = max_leases_per_client
        self.live: dict[int, Generation] = {}
        self.latest: Generation | None = None
        self.leases: dict[str, Lease] = {}
        self.holds: dict[int, float] = {}  # adopted generation -> since when it is held for workers re-taking leases
        self.on_retire = on_retire  # called with each retired generation's number (its ledger record goes)

    # --- leases ----------------------------------------------------------------------------

    def lease(self, pid: int, start_time: int | None = None, generation: int | None = None, owner: str = "") -> Lease:
        """A new lease on the latest generation, or on live `generation` (a worker resuming what it reads after
        the daemon restarted: GenerationGone when that one is not live); with `start_time` (see `watchable`)
        its process is watched by `expire`. Its id is 128 random bits (unguessable: knowing it is holding it);
        LeaseLimit when `owner` already holds `max_leases_per_client`."""
        if generation is not None and generation not in self.live:
            raise GenerationGone(f"generation {generation} is not served any more (live: "
                                 f"{sorted(self.live) or 'none'}); reconnect() or refresh() to read the latest")
        held = sum(1 for l in self.leases.values() if l.owner == owner)
        if held >= self.max_leases_per_client:
            raise LeaseLimit(f"this client ({owner or 'unknown'}) already holds {held} leases, the daemon's "
                             f"max_leases_per_client; release some (ExpertClient.close()) before taking more")
        now = time.monotonic()
        number = generation if generation is not None else self.latest.number if self.latest else None
        lease = Lease(secrets.token_hex(16), pid, now, now, number, start_time, now, owner)
        self.leases[lease.client] = lease
        return lease

    def hold(self, generation: int) -> None:
        """Keep an adopted generation live for one lease timeout (no lease of anyone's, no client in status): a
        worker whose lease the predecessor had not yet recorded re-takes it on this generation meanwhile."""
        self.holds[generation] = time.monotonic()

    def restore(self, leases: list[dict]) -> None:
        """Grant again the leases a predecessor recorded (the daemon restarted under its workers), as if each had
        just beaten (each counted against the owner it was recorded with)."""
        now = time.monotonic()
        for item in leases:
            client, pid, generation = item.get("client"), item.get("pid"), item.get("generation")
            if isinstance(client, str) and isinstance(pid, int) and generation in self.live:
                # watched again only where /proc here still shows that process (a successor in another pid namespace
                # cannot tell: the timeout rule then)
                start_time = item.get("start_time")
                if not isinstance(start_time, int) or procfs.process_start_time(pid) != start_time:
                    start_time = None
                owner = item.get("owner") if isinstance(item.get("owner"), str) else ""
                self.leases[client] = Lease(client, pid, now, now, generation, start_time, now, owner)

    def recorded(self) -> list[dict]:
        """The leases as the manifest records them for a successor."""
        return [{"client": l.client, "pid": l.pid, "generation": l.generation, "start_time": l.start_time,
                 "owner": l.owner}
                for l in self.leases.values() if l.generation is not None and l.pid > 0]

    def get(self, client: str) -> Lease:
        """The lease `client` names; its id is what proves a request comes from its holder."""
        lease = self.leases.get(client)
        if lease is None:
            raise LeaseExpired(f"no lease {clip(client)!r} (expired or released)")
        return lease

    def generation_of(self, lease: Lease | None) -> Generation | None:
        """The generation a lease reads; a lease taken while loading binds to the first one published."""
        if lease is None:
            return self.latest
        if lease.generation is None and self.latest is not None:
            lease.generation = self.latest.number
        return self.live.get(lease.generation) if lease.generation is not None else None

    def refresh(self, client: str) -> Lease:
        """Move a lease to the latest generation; the one it leaves may retire."""
        lease = self.get(client)
        lease.seen = time.monotonic()
        if self.latest is not None:
            lease.generation = self.latest.number
        self.retire()
        return lease

    def release(self, client: str) -> None:
        if self.leases.pop(client, None) is not None:
            self.retire()

    def expire(self, timeout_s: float) -> None:
        """Drop leases silent for over `timeout_s`, and watched leases whose process is gone (one /proc read per
        watched lease every `WATCH_EVERY_S` at most); then retire what they pinned."""
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
        ended = [n for n, since in self.holds.items() if now - since > timeout_s]
        for number in ended:
            del self.holds[number]
        if ended and not gone:
            self.retire()
        if gone:  # one line per sweep, however many went
            shown = ", ".join(f"{lease_tag(l.client)} (pid {l.pid})" for l in gone[:5])
            log.info("%d lease(s) ended: %d without heartbeat for over %.1fs, %d whose process is gone: %s%s",
                     len(gone), len(silent), timeout_s, len(exited), shown, ", ..." if len(gone) > 5 else "")
            self.retire()

    # --- generations -----------------------------------------------------------------------

    def pinned(self) -> dict[int, list[Lease]]:
        out: dict[int, list[Lease]] = {}
        for lease in self.leases.values():
            if lease.generation is not None:
                out.setdefault(lease.generation, []).append(lease)
        return out

    def check_room(self) -> None:
        """Refuse a new generation that would make more than `max_generations` live, naming the pinning leases."""
        pinned = self.pinned()
        after = {g for g in self.live if g in pinned or g in self.holds} | {0}  # 0 stands for the new one
        if len(after) <= self.max_generations:
            return
        latest = self.latest.number if self.latest else None
        holders = ", ".join([f"pid {l.pid} (lease {lease_tag(l.client)}) on generation {g}"
                             for g, leases in sorted(pinned.items()) if g != latest for l in leases]
                            + [f"the restart's hold on adopted generation {g} (one lease timeout)"
                               for g in sorted(self.holds) if g != latest])
        raise GenerationLimit(
            f"a new generation would make {len(after)} live, over max_generations={self.max_generations}; "
            f"old generations are pinned by: {holders}. Have those workers refresh() or exit, or raise max_generations"
        )

    def publish(self, gen: Generation) -> None:
        self.live[gen.number] = gen
        self.latest = gen
        self.retire()

    def adopt(self, gens: list[Generation], leases: list[dict]) -> None:
        """Serve a predecessor's generations (oldest first; the last is the latest) under their numbers, re-grant
        its leases, and hold each generation one lease timeout for the workers that re-take theirs."""
        for gen in gens:
            self.live[gen.number] = gen
        self.latest = gens[-1]
        self.restore(leases)
        for number in self.live:
            self.hold(number)
        self.retire()

    def retire(self) -> list[int]:
        """Drop old generations no lease holds; unlink their segments that no live generation uses."""
        pinned = self.pinned()
        gone = [g for n, g in self.live.items() if g is not self.latest and n not in pinned and n not in self.holds]
        for gen in gone:
            del self.live[gen.number]
            gen.drop_index()
            if self.on_retire is not None:
                self.on_retire(gen.number)
        if not gone:
            return []
        in_use = set().union(*(g.segments() for g in self.live.values()))
        freed = [name for gen in gone for name in gen.segments() - in_use if unlink_segment(name, gen.index.shm_dir)]
        log.info("retired generation(s) %s: %d segment(s) freed", ", ".join(str(g.number) for g in gone), len(freed))
        return [g.number for g in gone]

    def segments_by_generation(self) -> dict[int, list[str]]:
        return {n: sorted(g.segments() | {g.index_place["segment"]}) for n, g in self.live.items()}

    def leave(self) -> None:
        """Forget every live generation without unlinking anything (a handover: a successor adopts them)."""
        self.live.clear()
        self.latest = None

    def close(self) -> None:
        """Unlink every segment of every live generation (the daemon is stopping)."""
        for gen in self.live.values():
            for name in gen.segments():
                unlink_segment(name, gen.index.shm_dir)
            gen.drop_index()
            gen.built.arena.unlink()
        self.live.clear()
        self.latest = None

    def status(self) -> list[dict]:
        """One row per live generation, newest first."""
        latest_places = self.latest.places() if self.latest else set()
        pinned = self.pinned()
        rows = []
        for n, gen in sorted(self.live.items(), reverse=True):
            shared = sum(t.nbytes for t in gen.index.tensors if (t.segment, t.offset) in latest_places)
            rows.append({
                "generation": n, "tensors": len(gen.index.tensors), "bytes": gen.nbytes, "bytes_shared_with_latest": shared,
                "leases": [{"client": lease_tag(l.client), "pid": l.pid} for l in pinned.get(n, [])],
                "variants": [v.status() for v in gen.variants.values()],
            })
        return rows
