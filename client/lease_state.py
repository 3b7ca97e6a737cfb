"""The lease an ExpertClient holds, shared between the caller's thread and the heartbeat thread under one lock.

The heartbeat replaces the lease (a lost one resumed, a revoked one moved on from) while `refresh()`, `close()` and
`reconnect()` read and replace it from the caller's thread: each change below is one step under the lock, and a
replacement made after a network call names the lease it replaces, so it is refused if the other thread got there
first (the caller then releases the lease it took instead of leaking it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from expertd.errors import GenerationGone
from expertd.index import TensorIndex


@dataclass(frozen=True)
class LeaseSnapshot:
    """One consistent reading of a client's lease state."""

    lease: str | None
    timeout_s: float
    generation: int | None  # the generation this client's lease reads (None until its index is read)
    place: dict | None  # where that generation's index segment lies (None while the daemon loads)
    index: TensorIndex | None  # the index read from `place` (or kept for the model after moving on)
    gone: GenerationGone | None  # the daemon restarted without the generation this client reads
    lost: bool  # a lease was lost and its generation is gone (until attach)
    revoked: tuple[str, ...]  # leases revoked for a push, released once refresh() has moved off them
    latest: int  # the newest generation the daemon serves, from its last reply
    epoch: int  # counts changes of the lease or of where its index lies


class LeaseState:
    """A client's lease, its generation, index, revoked leases and newest known generation, behind one lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lease: str | None = None
        self._timeout_s = 0.0
        self._generation: int | None = None
        self._place: dict | None = None
        self._index: TensorIndex | None = None
        self._gone: GenerationGone | None = None
        self._lost = False
        self._revoked: list[str] = []
        self._latest = 0
        self._announced = 0
        self._open = False  # the lease may be replaced: False between detach() and attach(), and after close()
        self._epoch = 0

    def snapshot(self) -> LeaseSnapshot:
        """Everything at once, as one step left it (never half of another)."""
        with self._lock:
            return LeaseSnapshot(self._lease, self._timeout_s, self._generation, self._place, self._index, self._gone,
                                 self._lost, tuple(self._revoked), self._latest, self._epoch)

    # --- the caller's thread ---------------------------------------------------------------------------------------

    def attach(self, lease: str, place: dict | None, timeout_s: float, latest: int) -> None:
        """A lease just granted on connecting: nothing of the previous one is kept (its index, gone, lost)."""
        with self._lock:
            self._lease, self._place, self._timeout_s = lease, place, timeout_s
            self._generation = self._index = self._gone = None
            self._lost, self._open = False, True
            self._latest = self._announced = latest
            self._epoch += 1

    def detach(self) -> list[str]:
        """Every lease this client holds, to release before it connects anew: its generation and index are
        forgotten, and nothing replaces the lease until `attach`."""
        with self._lock:
            self._generation = self._index = self._gone = None
            return self._let_go()

    def close(self) -> list[str]:
        """Every lease this client holds, to release; nothing replaces the lease from now on."""
        with self._lock:
            self._index = None  # this client's own reference (views and models handed out keep theirs)
            return self._let_go()

    def _let_go(self) -> list[str]:
        held = [lease for lease in (self._lease, *self._revoked) if lease is not None]
        self._revoked, self._open = [], False
        self._epoch += 1
        return held

    def install_index(self, epoch: int, place: dict, index: TensorIndex) -> bool:
        """Keep `index`, read from `place` at `epoch`, unless the lease or its place changed since (read again)."""
        with self._lock:
            if epoch != self._epoch:
                return False
            self._place, self._index, self._generation = place, index, index.generation
            return True

    def refreshed(self, lease: str, generation: int, place: dict) -> bool:
        """`lease` now reads `generation`, whose index lies at `place`; refused when the lease changed meanwhile."""
        with self._lock:
            if lease != self._lease:
                return False
            self._generation, self._place, self._index = generation, place, None
            self._epoch += 1
            return True

    def take_revoked(self) -> list[str]:
        """The revoked leases, to release now that the client has moved off them."""
        with self._lock:
            done, self._revoked = self._revoked, []
            return done

    # --- either thread: each replaces lease `old` only if it is still the one held -------------------------------

    def resume(self, old: str, new: str) -> bool:
        """`new` reads the generation `old` read (the daemon forgot `old`)."""
        with self._lock:
            return self._replace(old, new)

    def lease_latest(self, old: str, new: str, place: dict | None) -> bool:
        """`new` reads the latest generation, whose index lies at `place` (None: the daemon still loads)."""
        with self._lock:
            if not self._replace(old, new):
                return False
            self._place, self._index = place, None
            return True

    def move_on(self, old: str, new: str, place: dict | None) -> bool:
        """`old` was revoked for a push; `new` reads the latest generation. The index the model binds is kept (its
        pages stay mapped) until refresh(), which releases `old`."""
        with self._lock:
            if not self._replace(old, new):
                return False
            self._place = place
            self._revoked.append(old)
            return True

    def _replace(self, old: str, new: str) -> bool:
        if not self._open or self._lease != old:
            return False
        self._lease, self._gone = new, None
        self._epoch += 1
        return True

    def mark_gone(self, old: str, gone: GenerationGone) -> bool:
        """Lease `old` was lost and its generation is gone: the next call raises `gone`."""
        with self._lock:
            if not self._open or self._lease != old:
                return False
            self._gone, self._lost = gone, True
            return True

    def note_latest(self, latest: int) -> None:
        """The daemon serves generation `latest` (never moves back)."""
        with self._lock:
            self._latest = max(self._latest, latest)

    def next_announcement(self) -> int | None:
        """The next generation number to announce to `on_update` (each once, in order), or None when all were."""
        with self._lock:
            if self._announced >= self._latest:
                return None
            self._announced += 1
            return self._announced
