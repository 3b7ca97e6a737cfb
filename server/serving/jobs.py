"""Building a generation off the request loop: one job at a time, its outcome kept for those who ask.

A job (the first load, a reload, an update) runs in a thread and ends with a built, unpublished
generation or an error. The daemon's loop publishes finished builds itself, so every change to
what is served happens on one thread, between two requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field

from expertd import replies
from expertd.errors import Busy, ExpertdError
from expertd.message_types import ABSENT
from expertd.procfs import name_this_thread

from ..load.built import Built, Cancelled

log = logging.getLogger("expertd.jobs")

KEEP = 32  # finished jobs remembered for `job` requests


def forget_frames(exc: BaseException) -> None:
    """Clear the local variables of the frames a kept exception (and those it chains) still holds: a failed
    build's frames hold tensors over its unlinked segments, whose pages would stay allocated with them."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


@dataclass
class Job:
    number: int
    kind: str  # "load" | "reload" | "update" | "check" (after adopting: has the checkpoint changed?)
    generation: int  # the number it publishes as
    state: str = "building"  # "building" | "built" | "published" | "failed" | "unchanged" (nothing to build)
    error: str | None = None
    message: str | None = None
    built: Built | None = None
    exc: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)
    on_end: object = None  # called on the loop's thread once the job is published or failed
    hold: bool = False  # built, it waits for `publish` (a push to several daemons) instead of publishing
    client: str | None = None  # the lease that committed an update
    checkpoint: str | None = None  # the folder a reload builds from (the ledger records it)

    def report(self, cls: type[replies.JobState] = replies.JobState) -> replies.JobState:
        """This job as `commit`, `publish`, `reload` and `job` reply (cls JobReply) and `status` shows it."""
        failed, b = self.state == "failed", self.built
        return cls(job=self.number, kind=self.kind, state=self.state, generation=self.generation, hold=self.hold,
                   error=self.error if failed else ABSENT, message=self.message if failed else ABSENT,
                   **({} if b is None else dict(bytes_written=b.bytes_written, tensors_written=b.tensors_written,
                                                bytes_read=b.bytes_read, seconds=round(b.seconds, 4))))


class Jobs:
    """The one build slot: the job in flight, or an update staged for the next (one reload or update at a time), and
    the finished jobs kept for those who ask."""

    def __init__(self):
        self.current: Job | None = None
        self.staged: int | None = None  # an update staged and not yet committed: its build takes the slot next
        self.done: OrderedDict[int, Job] = OrderedDict()
        self._ids = itertools.count(1)

    def check_idle(self, update: int | None = None) -> None:
        """Busy while a job builds, or while an update other than `update` is staged and not yet committed."""
        if self.current is not None:
            raise Busy(f"{self.current.kind} {self.current.number} (generation {self.current.generation}) is still "
                       "building; one reload or update at a time")
        if self.staged is not None and self.staged != update:
            raise Busy(f"update {self.staged} is staged and not yet committed; one reload or update at a time")

    def stage(self, update: int) -> None:
        """Hold the slot for staged update `update` until its commit builds it or it is dropped."""
        self.check_idle()
        self.staged = update

    def unstage(self, update: int) -> None:
        """Give the slot back: staged update `update` was dropped (no-op for another, or one already committed)."""
        if self.staged == update:
            self.staged = None

    def start(self, kind: str, generation: int, work, on_end=None, update: int | None = None) -> Job:
        """Run `work()` (returning a Built, or None when there is nothing to build) in a thread as a new job (the build
        of staged update `update`, whose slot it takes)."""
        self.check_idle(update)
        self.staged = None
        job = Job(next(self._ids), kind, generation, on_end=on_end)

        name = f"expertd-{kind}"

        def run() -> None:
            name_this_thread(name)
            try:
                job.built = work()
                job.state = "built" if job.built is not None else "unchanged"  # None: nothing to build
            except BaseException as exc:  # reported through the job, never lost
                job.exc, job.error, job.message = exc, type(exc).__name__, str(exc)
                job.state = "failed"
                if not isinstance(exc, (Cancelled, ExpertdError)):
                    log.exception("%s %d failed", kind, job.number)
                forget_frames(exc)

        job.thread = threading.Thread(target=run, name=name, daemon=True)
        self.current = job
        job.thread.start()
        return job

    def finished(self) -> Job | None:
        """The current job once its thread has ended (built or failed), else None."""
        job = self.current
        if job is None or job.thread.is_alive() or self.held() is job:
            return None
        return job

    def held(self) -> Job | None:
        """The current job when it is built and waits for `publish` (a commit with `hold`), else None."""
        job = self.current
        return job if job is not None and job.hold and job.state == "built" else None

    def close(self, job: Job) -> None:
        """Remember a published or failed job; the next one may start."""
        self.current = None
        job.thread = None
        self.done[job.number] = job
        while len(self.done) > KEEP:
            self.done.popitem(last=False)

    def last(self) -> Job | None:
        """The job in flight, else the last one finished (what `status` shows)."""
        if self.current is not None:
            return self.current
        return next(reversed(self.done.values())) if self.done else None

    def get(self, number) -> Job | None:
        if self.current is not None and self.current.number == number:
            return self.current
        return self.done.get(number)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the current job's thread, `timeout` seconds at most; False when it is still running then (a build
        that does not notice the stop flag: the caller abandons it)."""
        job = self.current
        if job is None or job.thread is None:
            return True
        job.thread.join(timeout)
        return not job.thread.is_alive()
