"""Who holds each derived tensor: the leases that asked for it, while they live.

A derived tensor lives while a lease holds it, not as long as its generation: each cast or gather reply holds what it
names for the asking lease. It counts against every reader (`Lease.counted`: a uid, a listed CURVE key, "anonymous")
holding it through a live lease, whichever generation that lease reads now (a worker that refreshed still maps what
it asked for, until the generations listing it retire); a reader whose leases end (released, expired, its process
gone) stops paying for it at once. A derived tensor nobody holds
stays listed (a worker restarting asks again and finds it) until room is needed: then the unheld go first
(`derived/requests` reclaims them before refusing for a daemon-wide limit).
"""

from __future__ import annotations


class Holds:
    def __init__(self, leases):
        self.leases = leases  # the lease table: which lease ids live, on which generation, counted against whom
        self._by_segment: dict[str, set[str]] = {}  # a derived tensor's segment (`created`) -> lease ids that asked
        self.changes = 0  # counts every hold added or forgotten (what `Quota.usage` caches by)

    def hold(self, lease_id: str | None, derived) -> None:
        """Lease `lease_id` holds `derived` (derived tensors a reply names; a served tensor itself holds nothing)."""
        if lease_id is None:
            return
        for v in derived:
            if v is not None and v.key:
                held = self._by_segment.setdefault(v.created, set())
                if lease_id not in held:
                    held.add(lease_id)
                    self.changes += 1

    def adopt(self, gens) -> None:
        """After a restart: each adopted derived tensor is held by the re-granted leases on its generation of the
        reader that made it (the predecessor did not record who else asked; they hold it again when they ask)."""
        ids: dict[tuple, list[str]] = {}  # (generation, reader) -> its re-granted lease ids, grouped once
        for client, lease in self.leases.leases.items():
            ids.setdefault((lease.generation, lease.counted), []).append(client)
        for gen in gens.live.values():
            for v in gen.derived.values():
                if v.key:
                    self._by_segment.setdefault(v.created, set()).update(ids.get((gen.number, v.owner), ()))
        self.changes += 1

    def accounts(self, segment: str) -> set[str]:
        """The readers holding derived segment `segment` through a live lease (on whichever generation it reads now: a
        worker that refreshed still maps what it asked for until its old generation retires); lease ids that ended
        are forgotten here."""
        ids = self._by_segment.get(segment)
        if not ids:
            return set()
        live = {c for c in ids if c in self.leases.leases}
        if len(live) != len(ids):
            if live:
                self._by_segment[segment] = live
            else:
                del self._by_segment[segment]
        return {self.leases.leases[c].counted for c in live}

    def forget(self, segment: str) -> None:
        """`segment` was reclaimed or retired: nobody holds it any more."""
        if self._by_segment.pop(segment, None) is not None:
            self.changes += 1

    def prune(self, listed) -> None:
        """Forget the segments no live generation lists any more (their generations retired)."""
        if len(self._by_segment) <= len(listed):
            return
        for segment in [s for s in self._by_segment if s not in listed]:
            del self._by_segment[segment]
