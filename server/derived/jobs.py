"""Derivation jobs: large casts and gathers made off the request loop, a slice at a time, readers served fairly.

A large request becomes a `Work` in three phases — checking (each distinct index inflated, in range, digested),
naming (the items that send an index alike take its digest), making — each a list of steps run on the load's
threads a slice at a time (`SLICE_PER_THREAD` steps a thread). Between slices the loop's thread takes over (`tick`):
it counts a checked request against the quotas, lists what a finished one made, and picks the next slice: of the
reader served least lately (seconds of slices, halving every HALF_LIFE_S), its request in progress first, else its
oldest. A reader flooding the queue thus delays another's request by one slice, not by its own requests.

What waits is bounded per reader (QUEUED_PER_READER) and for the daemon (MAX_QUEUED requests, MAX_QUEUED_BYTES of
what they keep: their indexes as sent). When the daemon's bound is reached, a reader with fewer requests waiting
takes the place of the newest request of the reader with the most (told to that reader's next ask as DerivedLimit).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from expertd.errors import DerivedLimit
from expertd.procfs import default_threads, name_this_thread

QUEUED_PER_READER = 4  # a reader's large requests waiting at once (more: DerivedLimit, ask again later)
MAX_QUEUED = 64  # every reader's together
MAX_QUEUED_BYTES = 32 << 20  # what they keep together (indexes as sent, and a little for each item)
ITEM_BYTES = 512  # what one item keeps besides its index
SLICE_PER_THREAD = 2  # steps a slice gives each thread: another reader waits at most one slice
HALF_LIFE_S = 30.0  # a reader's served seconds halve in this long


@dataclass
class Work:
    """A large request: checked, named, counted, made and listed, a slice at a time."""

    number: int
    rid: str
    gen: object
    planned: list
    reader: str
    lease: str | None = None  # the lease that asked: it holds what the work makes
    kept: int = 0  # the bytes it keeps while it waits (its indexes as sent)
    phase: str = "waiting"  # "waiting" | "checking" | "naming" | "making"
    steps: list = field(default_factory=list)  # the phase's (function, args), in order
    at: int = 0  # how many of them are done
    naming: list = field(default_factory=list)  # the naming phase's steps, made with the checking's
    slice_started: float = 0.0
    thread: threading.Thread | None = None
    error: BaseException | None = None
    todo: list = field(default_factory=list)  # (planned, placed bytes, kept blocks) to make
    made: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    checked_s: float = 0.0  # how long its check took (slices of other readers' work in between included)

    @property
    def done(self) -> bool:
        """Its phase's steps have all run (or one failed)."""
        return self.error is not None or self.at >= len(self.steps)

    def status(self) -> dict:
        return {"job": self.number, "generation": self.gen.number, "phase": self.phase, "reader": self.reader,
                "tensors": len(self.planned), "made": len(self.made), "to_make": len(self.todo)}


def kept_bytes(items: list) -> int:
    """What a waiting request keeps: each gather's index as sent, and ITEM_BYTES an item."""
    return sum(len(getattr(item, "index", b"") or b"") + ITEM_BYTES for item in items)


class Scheduler:
    """The works not finished, by (reader, request digest), and whose slice runs next."""

    def __init__(self, threads: int | None):
        self.threads = threads or default_threads()
        self.works: OrderedDict[tuple[str, str], Work] = OrderedDict()
        self.current: Work | None = None  # the work whose slice runs now, or ran last and is not finished
        self._served: dict[str, tuple[float, float]] = {}  # reader -> (seconds served, when counted)

    def waiting(self, reader: str | None = None) -> list[Work]:
        return [w for w in self.works.values() if w.phase == "waiting" and reader in (None, w.reader)]

    def admit(self, work: Work) -> Work | None:
        """Queue `work`, or refuse it (DerivedLimit); the waiting work it took the place of, if any."""
        waiting = self.waiting()
        mine = sum(w.reader == work.reader for w in waiting)
        if mine >= QUEUED_PER_READER:
            raise DerivedLimit(f"{work.reader} has {QUEUED_PER_READER} large cast or gather requests waiting for the "
                               "daemon's derivation job: ask again once one is made")
        evicted = None
        if len(waiting) >= MAX_QUEUED or sum(w.kept for w in waiting) + work.kept > MAX_QUEUED_BYTES:
            counts: dict[str, int] = {}
            for w in waiting:
                counts[w.reader] = counts.get(w.reader, 0) + 1
            most = max(counts, key=counts.get, default=None)
            if most is None or counts[most] <= mine + 1:
                raise DerivedLimit(f"the daemon's derivation queue is full ({len(waiting)} requests, at most "
                                   f"{MAX_QUEUED} and {MAX_QUEUED_BYTES >> 20} MiB of indexes, shared fairly among "
                                   f"readers): ask again once one is made")
            evicted = [w for w in waiting if w.reader == most][-1]
            del self.works[(evicted.reader, evicted.rid)]
        self.works[(work.reader, work.rid)] = work
        return evicted

    def served(self, reader: str, now: float) -> float:
        seconds, when = self._served.get(reader, (0.0, now))
        return seconds * 0.5 ** ((now - when) / HALF_LIFE_S)

    def charge(self, reader: str, seconds: float) -> None:
        now = time.monotonic()
        self._served[reader] = (self.served(reader, now) + seconds, now)
        if len(self._served) > 4 * MAX_QUEUED:  # readers served long ago weigh nothing: forget them
            for old in sorted(self._served, key=lambda r: self._served[r][1])[:MAX_QUEUED]:
                del self._served[old]

    def pick(self) -> Work | None:
        """The next work to run a slice of: the least lately served reader's (its started one first)."""
        if not self.works:
            return None
        now, first = time.monotonic(), {}
        for w in self.works.values():
            mine = first.get(w.reader)
            if mine is None or (mine.phase == "waiting" and w.phase != "waiting"):
                first[w.reader] = w
        return min(first.values(), key=lambda w: self.served(w.reader, now))

    def finish(self, work: Work) -> None:
        self.works.pop((work.reader, work.rid), None)
        if self.current is work:
            self.current = None

    def run_slice(self, work: Work) -> None:
        """Run the next slice of `work`'s phase on a thread of its own (`work.thread`; its pool the load's threads)."""
        self.current = work
        count = max(1, self.threads) * SLICE_PER_THREAD
        steps, work.at = work.steps[work.at:work.at + count], work.at + count

        def run() -> None:
            name_this_thread("expertd-derive")  # the kernel keeps 15 bytes: no number
            try:
                on_threads(work, steps, self.threads)
            except BaseException as exc:  # told to the next ask of the same request
                work.error = exc

        work.thread = threading.Thread(target=run, name=f"expertd-derive-{work.number}", daemon=True)
        work.thread.start()


def on_threads(work: Work, steps: list[tuple], threads: int) -> None:
    """Each `fn(*args)` of `steps` on up to `threads` threads (inflating, hashing and torch's copies release the GIL):
    every one done or failed before this returns, the first error raised."""
    import torch

    if work.stop.is_set():
        raise InterruptedError("the daemon is stopping")
    workers = max(1, min(len(steps), threads))
    before = torch.get_num_threads()  # the pool is the parallelism (as the load's): each thread runs torch's
    torch.set_num_threads(1)  # ops on itself, taking this count at its first op
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix=f"expertd-derive-{work.number}") as pool:
            done = [pool.submit(fn, *args) for fn, args in steps]
    finally:
        torch.set_num_threads(before)
    for future in done:
        future.result()
