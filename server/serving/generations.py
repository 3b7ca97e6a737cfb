"""Generations: what the daemon serves, and when bytes can go (who holds what is the lease table, `leases`).

A `Generation` is one published set of served tensors: its index, the segments its build
created, its index packed into a read-only segment of its own (named in lease replies, see
`expertd.index_segment`; unlinked when the generation retires) and the leases on it. Generation N+1 shares every
unchanged tensor's bytes with N (its index points into N's segments). A generation older than the latest
is retired when no lease holds it; its segments that no live generation references are then
unlinked. Workers that still map them keep valid, unchanged pages until they drop their views:
an unlinked segment lives until its last mapping goes.
"""

from __future__ import annotations

import itertools
import logging
import time

from expertd import index_segment
from expertd.errors import GenerationGone, GenerationLimit, LeaseLimit, NotReady
from expertd.extents import Extent, overlap, extents_of
from expertd.index import TensorIndex

from ..load.built import Built
from ..shm.arena import Arena, segment_pattern, unlink_segment
from .leases import Lease, LeaseTable, lease_tag

log = logging.getLogger("expertd.generations")
LISTED_DERIVED = 256  # derived tensors a generation's status row lists at most (its `derived` counts them all)

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
        self._index_map: dict | None = None
        self._served: dict | None = None
        self.derived: dict[str, object] = {}  # derivation name (`expertd.derived.key`) -> tensors.DerivedTensor
        self._derived_numbers = itertools.count()
        self.derived_changes = 0  # counts every derived tensor listed or unlisted (what `Quota.usage` caches by)

    def next_derived(self) -> int:
        """The number of this generation's next derived tensor segment (`/{namespace}.{pid}.v{N}.{k}`)."""
        return next(self._derived_numbers)

    def adopt_derived(self, derived: dict, segments) -> None:
        """Serve a predecessor's derived tensors of this generation again (`adopt`: verified), and number this
        generation's next derived tensor segments after every adopted segment of its tag (`segments`: those of all
        adopted generations, a newer one's record may name one of this generation's that its own record had not listed
        yet)."""
        self.derived.update(derived)
        self.derived_changes += 1
        pattern, tag = segment_pattern(self.index.namespace), f"v{self.number}"
        taken = [int(m.group(3)) for m in (pattern.match(name.lstrip("/")) for name in segments)
                 if m is not None and m.group(2) == tag]
        self._derived_numbers = itertools.count(max(taken, default=-1) + 1)

    def add_derived(self, key: str, derived_tensor) -> bool:
        """List a derived tensor under its derivation name, unless one is listed there already (the first listed
        stays: it may have been handed out); whether it was listed."""
        if key in self.derived:
            return False
        self.derived[key] = derived_tensor
        self.derived_changes += 1
        return True

    def remove_derived(self, segments: set[str]) -> list:
        """Unlist the derived tensors made in `segments` (reclaimed: no lease holds them); those unlisted. Their
        segments are the caller's to unlink once no live generation uses them."""
        gone = [key for key, v in self.derived.items() if v.key and v.created in segments]
        self.derived_changes += 1
        return [self.derived.pop(key) for key in gone]

    def drop_derived(self, derived_tensor) -> None:
        """Unlink a derived tensor's segment that no request got (its request failed after it was cast)."""
        unlink_segment(derived_tensor.created, self.index.shm_dir)

    def served(self) -> dict:
        """Its tensors by name, made once (every cast and gather looks its items up here)."""
        if self._served is None:
            self._served = {t.name: t for t in self.index.tensors}
        return self._served

    def index_map(self) -> dict:
        """The index as the `index` op sends it inline (for tools that ask over the socket), made once: a DeepSeek-V3
        index has tens of thousands of tensors."""
        if self._index_map is None:
            self._index_map = self.index.to_dict()
        return self._index_map

    def segments(self) -> set[str]:
        """Every segment this generation uses: its tensors' and its derived tensors' (each range's, for a derived stack
        that
        keeps an older derived tensor's blocks)."""
        return {s.name for s in self.index.segments} | {x.segment for v in self.derived.values()
                                                         for x in extents_of(v.entry)}

    def drop_index(self) -> None:
        """Unlink the index segment (the generation retires); workers that mapped it have decoded it already."""
        unlink_segment(self.index_place["segment"], self.index.shm_dir)

    def extents(self) -> set[Extent]:
        """Every byte range its tensors lie in (a tensor of several generations' ranges: each of them)."""
        return {x for t in self.index.tensors for x in extents_of(t)}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.index.tensors)


class Generations:
    """The live generations: published, held after a restart, pinned by the lease table's leases, retired."""

    def __init__(self, leases: LeaseTable, max_generations: int = 3, on_retire=None, revoke_after_s: float = 30.0,
                 hold_s: float = 30.0, max_old_per_holder: int = 1):
        self.leases = leases
        self.max_generations = max_generations
        self.max_old_per_holder = max_old_per_holder  # generations older than the latest one holder may pin
        self.revoke_after_s = revoke_after_s  # a push refused for room: the oldest generation's leases go this later
        self.hold_s = hold_s  # how long an adopted generation is held (one lease timeout: `end_holds`)
        self.revoking: dict[int, float] = {}  # generation -> when its leases are revoked (a push waits for room)
        self.live: dict[int, Generation] = {}
        self.latest: Generation | None = None
        self.holds: dict[int, float] = {}  # adopted generation -> since when it is held for workers re-taking leases
        self.on_retire = on_retire  # called with each retired generation's number (its ledger record goes)

    def leasable(self, generation: int | None) -> int | None:
        """The generation a new lease reads: live `generation` (a worker resuming what it read before the daemon
        restarted: GenerationGone when it is not live), else the latest (None while the first one loads)."""
        if generation is not None and generation not in self.live:
            raise GenerationGone(f"generation {generation} is not served any more (live: "
                                 f"{sorted(self.live) or 'none'}); reconnect() or refresh() to read the latest")
        return generation if generation is not None else self.latest.number if self.latest else None

    def check_pin(self, holder: str, generation: int | None) -> None:
        """Refuse (LeaseLimit) a lease that would make `holder` pin more than `max_old_per_holder` generations older
        than the latest: one reader cannot keep old generations live for everyone's pushes to revoke others."""
        latest = self.latest.number if self.latest else None
        if generation is None or generation == latest:
            return
        old = self._old_pins(latest).get(holder, set())
        if generation not in old and len(old) >= self.max_old_per_holder:
            raise LeaseLimit(f"{holder or 'this client'} already pins {len(old)} generation(s) older than the latest "
                             f"({', '.join(map(str, sorted(old)))}), the daemon's max_old_generations_per_holder="
                             f"{self.max_old_per_holder}: refresh() those workers onto generation {latest}, or lease "
                             "the latest")

    def _old_pins(self, latest: int | None) -> dict[str, set[int]]:
        """Each holder's pinned generations older than the latest."""
        out: dict[str, set[int]] = {}
        for number, leases in self.leases.pinned().items():
            if number != latest:
                for lease in leases:
                    out.setdefault(lease.counted, set()).add(number)
        return out

    def serving(self) -> Generation:
        """The latest generation; NotReady while the first one is still loading."""
        if self.latest is None:
            raise NotReady("the daemon is still loading")
        return self.latest

    def hold(self, generation: int) -> None:
        """Keep an adopted generation live for one lease timeout (no lease of anyone's, no client in status): a
        worker whose lease the predecessor had not yet recorded re-takes it on this generation meanwhile."""
        self.holds[generation] = time.monotonic()

    def end_holds(self, timeout_s: float) -> bool:
        """Let adopted generations held for over `timeout_s` go; whether any hold ended."""
        now = time.monotonic()
        ended = [n for n, since in self.holds.items() if now - since > timeout_s]
        for number in ended:
            del self.holds[number]
        return bool(ended)

    def generation_of(self, lease: Lease | None) -> Generation | None:
        """The generation a lease reads; a lease taken while loading binds to the first one published."""
        if lease is None:
            return self.latest
        if lease.generation is None and self.latest is not None:
            self.leases.move(lease, self.latest.number)
        return self.live.get(lease.generation) if lease.generation is not None else None

    def check_room(self) -> None:
        """Refuse a new generation that would make more than `max_generations` live, naming the pinning leases. Readers
        never block a push for good: an old generation's leases are revoked `revoke_after_s` after the first refusal
        (at once when 0; which one: `_victim`); until then GenerationLimit says when a retry proceeds
        (`retry_after_s`)."""
        while True:
            pinned = self.leases.pinned()
            after = {g for g in self.live if g in pinned or g in self.holds} | {0}  # 0 stands for the new one
            if len(after) <= self.max_generations:
                return
            latest = self.latest.number if self.latest else None
            old = sorted(g for g in after if g not in (0, latest))
            now = time.monotonic()
            victim = self._victim([g for g in old if g not in self.holds], pinned, latest)
            if victim is not None:
                due = self.revoking.setdefault(victim, now + self.revoke_after_s)
                if now >= due:
                    self.revoke(victim)
                    continue
                wait = due - now
            else:  # an adopted generation's hold ends by itself (the latest one's pins nothing a push can take)
                wait = self.holds[old[0]] + self.hold_s - now if old else None
            raise self._limit(len(after), pinned, latest, wait)

    def _victim(self, old: list[int], pinned: dict, latest: int | None) -> int | None:
        """The old generation a push revokes the leases of: one already being revoked, else the one pinned by the
        fewest leases of holders within `max_old_per_holder` (a holder pinning more old generations than that is
        revoked first, never a neighbour for it), the oldest of equals."""
        if not old:
            return None
        due = [g for g in old if g in self.revoking]
        if due:
            return due[0]
        over = {h for h, numbers in self._old_pins(latest).items() if len(numbers) > self.max_old_per_holder}
        return min(old, key=lambda g: (sum(lease.counted not in over for lease in pinned.get(g, [])), g))

    def _limit(self, count: int, pinned: dict, latest: int | None, wait: float | None) -> GenerationLimit:
        holders = ", ".join([f"{lease.where()} (lease {lease_tag(lease.client)}) on generation {g}"
                             for g, leases in sorted(pinned.items()) if g != latest for lease in leases[:8]]
                            + [f"the restart's hold on adopted generation {g} (one lease timeout)"
                               for g in sorted(self.holds) if g != latest])
        when = (f"; the oldest one's leases are revoked in {max(wait, 0):.1f}s "
                f"(revoke_after_s={self.revoke_after_s:g}): retry then" if wait is not None else "")
        exc = GenerationLimit(
            f"a new generation would make {count} live, over max_generations={self.max_generations}; old generations "
            f"are pinned by: {holders}{when}. Have those workers refresh() or exit, or raise max_generations")
        exc.retry_after_s = max(float(wait), 0.0) if wait is not None else None
        return exc

    def revoke(self, number: int) -> None:
        """Revoke every lease on old generation `number` (a push waited `revoke_after_s` for its room): their holders
        learn it on their next heartbeat or refresh (LeaseRevoked); the generation retires."""
        self.revoking.pop(number, None)
        gone = self.leases.revoke(number)
        shown = ", ".join(f"{lease.where()} (lease {lease_tag(lease.client)})" for lease in gone[:5])
        log.info("revoked %d lease(s) on generation %d to make room for a push: %s%s", len(gone), number, shown,
                 ", ..." if len(gone) > 5 else "")
        self.retire()

    def revoke_due(self) -> None:
        """Between requests: revoke the generations whose grace has passed (their readers learn it at once)."""
        now = time.monotonic()
        for number in [n for n, due in self.revoking.items() if now >= due]:
            self.revoke(number)

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
        self.leases.restore(leases, self.live)
        for number in self.live:
            self.hold(number)
        self.retire()

    def retire(self) -> list[int]:
        """Drop old generations no lease holds; unlink their segments that no live generation uses."""
        pinned = self.leases.pinned()
        gone = [g for n, g in self.live.items() if g is not self.latest and n not in pinned and n not in self.holds]
        for gen in gone:
            del self.live[gen.number]
            self.revoking.pop(gen.number, None)
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
        latest_extents = self.latest.extents() if self.latest else set()
        pinned = self.leases.pinned()
        rows = []
        for n, gen in sorted(self.live.items(), reverse=True):  # a stack of ranges shares the ranges it kept
            shared = overlap(gen.extents(), latest_extents)
            rows.append({
                "generation": n, "tensors": len(gen.index.tensors), "bytes": gen.nbytes,
                "bytes_shared_with_latest": shared,
                "leases": [{"client": lease_tag(lease.client), "pid": lease.pid} for lease in pinned.get(n, [])],
                "derived": {"bytes": sum(v.placed for v in gen.derived.values()), "files": len(gen.derived),
                            "tensors": [v.status() for v in itertools.islice(gen.derived.values(), LISTED_DERIVED)]},
            })
        return rows
