"""The weight service at one moment: what the `status` op and the metrics both read.

Every figure of what is served, leased, built and derived is computed here, on its first read and once per
snapshot: the metrics read a few of them between requests (the latest generation's only when it changed), `status`
reads them all, and neither walks the leases, the jobs or the derived tensors on its own. A snapshot changes nothing
and is read on the loop's thread right after it is taken.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import NamedTuple

from expertd import replies
from expertd.partition import ExpertParallel

from ..derived.requests import DerivedRequests
from ..serving.generations import Generation, Generations
from ..serving.jobs import Jobs
from ..serving.leases import LeaseTable


class Ended(NamedTuple):
    """A finished build, as the metrics count it."""

    number: int
    kind: str  # "load" | "reload" | "update" | "check"
    state: str  # "published" | "failed" | "unchanged"
    seconds: float | None  # how long it took to build, for a published one


class Snapshot:
    """The service's generations, leases, jobs and derived tensors now; each figure made on its first read."""

    def __init__(self, gens: Generations, leases: LeaseTable, jobs: Jobs, derived: DerivedRequests, *,
                 generation: int, checkpoint: str, build_progress: tuple[int, int]):
        self.now = time.monotonic()
        self.latest: Generation | None = gens.latest
        self.generation = generation  # the latest, or while loading the one being built
        self.checkpoint = checkpoint  # what the latest generation was built from
        self.build_progress = build_progress  # (bytes placed, bytes to place) of the latest build from a checkpoint
        self._gens, self._leases, self._jobs, self._derived = gens, leases, jobs, derived

    @property
    def number(self) -> int:
        """The latest generation's number; 0 while the first one loads."""
        return self.latest.number if self.latest is not None else 0

    @cached_property
    def bytes_by_dtype(self) -> dict[str, int]:
        return self.latest.index.total_bytes_by_dtype() if self.latest is not None else {}

    @property
    def tensors(self) -> int:
        return len(self.latest.index.tensors) if self.latest is not None else 0

    @cached_property
    def views(self) -> int:
        return self.latest.index.view_count() if self.latest is not None else 0

    @property
    def segments(self) -> list[str]:
        return [s.name for s in self.latest.index.segments] if self.latest is not None else []

    @property
    def index_segment(self) -> str | None:
        """The latest index segment's name."""
        return self.latest.index_place["segment"] if self.latest is not None else None

    @property
    def partition(self) -> ExpertParallel | None:
        """The EP partition the latest generation serves (None: not partitioned)."""
        return self.latest.index.expert_parallel if self.latest is not None else None

    @cached_property
    def expert_parallel(self) -> dict | None:
        """The partition as `status` shows it: EP size, its ranks, and per fused expert tensor the experts it holds."""
        if self.partition is None:
            return None
        return {**self.partition.to_dict(),
                "experts": {t.name: t.experts.to_dict() for t in self.latest.index.tensors if t.experts is not None}}

    @cached_property
    def served_experts(self) -> int:
        """Experts served in the fused expert tensors, summed over them."""
        if self.latest is None:
            return 0
        return sum(t.experts.count for t in self.latest.index.tensors if t.experts is not None)

    @property
    def lease_count(self) -> int:
        return len(self._leases.leases)

    @cached_property
    def leases(self) -> list[dict]:
        """One row per lease (never its id)."""
        return self._leases.status(self.now)

    @property
    def live_generations(self) -> int:
        return len(self._gens.live)

    @cached_property
    def generations(self) -> list[dict]:
        """One row per live generation, newest first."""
        return self._gens.status()

    @cached_property
    def derived(self) -> dict:
        """Derived tensors: bytes and files (in pages), limits, per reader, the derivation job."""
        return self._derived.status()

    @cached_property
    def job(self) -> replies.JobState | None:
        """The build in flight, else the last one finished."""
        job = self._jobs.last()
        return job.report() if job is not None else None

    @cached_property
    def ended(self) -> list[Ended]:
        """The finished builds still remembered, oldest first."""
        return [Ended(number, job.kind, job.state,
                      job.built.seconds if job.state == "published" and job.built is not None else None)
                for number, job in self._jobs.done.items()]
