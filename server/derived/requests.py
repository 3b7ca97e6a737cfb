"""Derived tensors asked by readers (`cast`, `gather`): checked whole, counted, made once per host, off the loop
when large.

A request is planned first (`tensors.plan_*`: names, dtypes, shapes and sizes; nothing inflated), then checked
whole (`tensors.check`: every index inflated chunk by chunk and in range, every derivation named by its digest),
then what no live generation has yet is counted against the reader's and the daemon's quotas (`quota`) in one
check, then made. A request that fails anywhere makes nothing: no build-then-unlink.

Small requests (few items, index entries and bytes) run on the request loop. Larger ones are derivation jobs
(`derived/jobs`): checked, counted and made a slice at a time on the load's threads, the quota check on the loop's
thread between them, so only the loop ever touches the tables; readers take turns by the time they were served.
Meanwhile the reply says `building` and the client asks again; other clients are answered as usual. A request is
known again by its digest (`request_digest`: the request as sent and its sources' identity): the names a job found
answer the next ask of anyone without inflating anything; a job's refusal answers the next ask of the reader who
asked (never another's: a refusal may be that reader's quota), kept as its type and words only (no frames, nothing
of the request).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections import OrderedDict
from dataclasses import replace

from expertd import replies
from expertd.derived import source_identity
from expertd.errors import DerivedLimit, GenerationGone
from expertd.extents import extents_of

from ..serving.jobs import forget_frames
from ..shm.arena import unlink_segment
from .extents import make_changed, older_forms, placed_bytes, prior
from .holds import Holds
from .jobs import Scheduler, Work, kept_bytes
from .quota import Quota, reader_of
from .tensors import Planned, DerivedTensor, check, make, plan_casts, plan_gathers, summary

log = logging.getLogger("expertd.derived")

INLINE_ITEMS = 4  # a request is made on the request loop when it names at most this many tensors,
INLINE_ENTRIES = 1 << 12  # inflates at most this many index entries (16 KiB),
INLINE_BYTES = 256 << 10  # and makes at most this many bytes; else it is a derivation job
REMEMBERED = 256  # requests whose names (or refusal) are kept for the next ask


def _alike(p: Planned) -> tuple:
    """What decides a gather's inflated index, its checks and its strided form: the index as sent, its length, the
    source block and whether it reads several sources."""
    return *p.gather.index_key(), bool(p.more)


def _named(p: Planned, first: Planned) -> None:
    """An item whose index another (`first`) sends alike takes its digest and strided form, and names itself."""
    p.gather.digest = first.gather.digest
    p.key = p.gather.key([p.entry, *p.more])
    p.gather.form = first.gather.form if not p.more else None


def request_digest(kind: str, planned: list[Planned], items: list) -> str:
    """What knows a request again: BLAKE2b of each item's canonical header (sources' identity included) and its
    deflated index as sent (length-prefixed)."""
    digest = hashlib.blake2b(digest_size=32, person=b"expertd.request")
    for p, item in zip(planned, items):
        sources = [source_identity(e) for e in (p.entry, *p.more)]
        head = p.gather.request_header([p.entry, *p.more]) if p.gather is not None else [kind, p.dtype, sources]
        digest.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode() + b"\0")
        index = item.index if p.gather is not None else b""
        digest.update(len(index).to_bytes(8, "little") + index)
    return digest.hexdigest()


class DerivedRequests:
    def __init__(self, cfg, gens):
        self.cfg, self.gens = cfg, gens
        self.holds = Holds(gens.leases)  # which leases hold each derived tensor
        self.quota = Quota(cfg, gens, self.holds)
        self.quota.warn_unshared(log)
        self.known: OrderedDict[str, list[str]] = OrderedDict()  # request digest -> its derivations' names
        # (reader, request digest) -> a job's refusal, as (type, words): told to that reader's next ask
        self.refused: OrderedDict[tuple[str, str], tuple[type, str]] = OrderedDict()
        self.jobs = Scheduler(cfg.load_threads)  # large requests, made a slice at a time off the loop
        self._numbers = itertools.count(1)

    @property
    def busy(self) -> bool:
        """A derivation job is under way (its next step waits for a `tick`)."""
        return self.jobs.current is not None

    def ask(self, kind: str, gen, items: list, peer, lease: str | None = None) -> replies.DerivedReply:
        """The reply to a `cast` or `gather` of generation `gen` on lease `lease` (which then holds what it names):
        its derived tensors, or `building` (ask again)."""
        served = gen.served()
        if kind == "cast":
            planned = plan_casts(items, served, gen.number)
        else:
            planned = plan_gathers(items, served, gen.number, self.quota.limits()["max_bytes_per_reader"])
        rid, reader = request_digest(kind, planned, items), reader_of(peer)
        if (reader, rid) in self.refused:
            cls, words = self.refused.pop((reader, rid))
            raise cls(words)
        names = self.known.get(rid)
        if names is not None:
            for p, name in zip(planned, names):
                p.key = name
            found = self._resolve(gen, planned)
            if all(v is not None for v in found):
                return self._reply(gen, self._list(gen, found), lease)
        if len(planned) <= INLINE_ITEMS and sum(p.entries for p in planned) <= INLINE_ENTRIES \
                and sum(p.nbytes for p in planned) <= INLINE_BYTES:
            for p in planned:
                check(p)
            return self._reply(gen, self._make_now(gen, planned, reader, rid), lease)
        self._wait(Work(0, rid, gen, planned, reader, lease, kept_bytes(items)))
        return replies.DerivedReply(generation=gen.number, tensors=[], building=True)

    def _wait(self, work: Work) -> None:
        """Queue a large request (once; DerivedLimit past the queue's bounds) and start a slice if none runs."""
        if (work.reader, work.rid) in self.jobs.works:
            return
        work.number = next(self._numbers)
        evicted = self.jobs.admit(work)
        if evicted is not None:
            self._refuse(evicted, DerivedLimit(
                f"{evicted.reader}'s request waited in a full derivation queue behind more of its own than another "
                "reader had: it gave its place to that reader's; ask again"))
        if self.jobs.current is None:
            self._advance()

    def _reply(self, gen, derived: list[DerivedTensor], lease: str | None) -> replies.DerivedReply:
        self.holds.hold(lease, derived)
        return replies.DerivedReply(generation=gen.number, tensors=[v.to_wire() for v in derived])

    def _resolve(self, gen, planned: list[Planned]) -> list[DerivedTensor | None]:
        """Each checked item's derived tensor where one exists: the served tensor itself, this generation's, or another
        live generation's made of the same bytes (reused); None where it is to be made."""
        others = {}
        for other in self.gens.live.values():
            if other is not gen:
                others.update(other.derived)
        out = []
        for p in planned:
            if not p.key:
                out.append(DerivedTensor(p.entry, p.entry))
                continue
            found = gen.derived.get(p.key)
            if found is None and p.key in others:
                theirs = others[p.key]
                if theirs.made_of() == DerivedTensor(p.entry, p.entry, also=p.more).made_of():
                    found = replace(theirs, of=p.entry, key=p.key, also=p.more)
            out.append(found)
        return out

    def _todo(self, gen, planned: list[Planned], reader: str) -> list[tuple[Planned, int, tuple | None]]:
        """What is to be made (each name once; a derivation an older generation's derived tensor of the same form keeps
        blocks of: its changed blocks only, `derived/extents`), counted against the quotas at once: DerivedLimit makes
        nothing."""
        todo, forms, reused = {}, older_forms(self.gens, gen), []
        for p, v in zip(planned, self._resolve(gen, planned)):
            if v is not None and v.key:
                reused.append(v)
            if v is None and p.key not in todo:
                keep = prior(p, forms, self.quota.unit)
                todo[p.key] = (p, self.quota.placed(p.nbytes if keep is None else placed_bytes(p, keep[1])), keep)
        names = [p.entry.name for p, _, _ in todo.values()]
        what = f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") if names else ""
        sizes = [placed for _, placed, _ in todo.values()]
        try:
            self.quota.check(reader, sizes, gen.number, what, reused)
        except DerivedLimit as exc:
            if not getattr(exc, "daemon_wide", False) or not self.reclaim():
                raise
            self.quota.check(reader, sizes, gen.number, what, reused)  # the room the unheld took: enough now?
        return list(todo.values())

    def reclaim(self) -> bool:
        """Unlist the derived tensors no live lease holds, and unlink their segments no live generation uses any more
        (a process that mapped one keeps its pages): a daemon-wide limit is met by what nobody holds first. Whether
        any went."""
        unheld = set(self.quota.usage().unheld)
        if not unheld:
            return False
        nbytes = 0
        for gen in self.gens.live.values():
            nbytes += sum(v.placed for v in gen.remove_derived(unheld))
        in_use = set().union(*(g.segments() for g in self.gens.live.values()))
        shm_dir = self.cfg.shm_dir
        freed = [name for name in unheld if name not in in_use and unlink_segment(name, shm_dir)]
        for name in unheld:
            self.holds.forget(name)
        log.info("reclaimed %d derived tensor(s) no lease holds (%.1f MiB) to make room: %d segment(s) freed",
                 len(unheld), nbytes / 2**20, len(freed))
        return True

    def _make(self, gen, p: Planned, reader: str, placed: int, keep: tuple | None, should_stop=None) -> DerivedTensor:
        if keep is None:
            return make(gen, p, reader, placed, self.cfg.group, should_stop)
        return make_changed(gen, p, *keep, reader, placed, self.cfg.group, should_stop)

    def _make_now(self, gen, planned: list[Planned], reader: str, rid: str) -> list[DerivedTensor]:
        made = []
        try:
            for p, placed, keep in self._todo(gen, planned, reader):
                made.append(self._make(gen, p, reader, placed, keep))
        except BaseException:
            for v in made:
                unlink_segment(v.created, gen.index.shm_dir)
            raise
        return self._list(gen, self._register(gen, made, planned, rid))

    def _register(self, gen, made: list[DerivedTensor], planned: list[Planned], rid: str, job: Work | None = None
                  ) -> list[DerivedTensor]:
        kept = set().union(*(g.segments() for g in self.gens.live.values())) if any(v.made for v in made) else set()
        for v in made:
            if v.key in gen.derived:  # made meanwhile by a small request: the one listed first stays
                unlink_segment(v.created, gen.index.shm_dir)
            elif v.made and any(x.segment not in kept | {v.made} for x in extents_of(v.entry)):
                # the older layout it keeps blocks of retired while a job made it: not listed (the next ask makes it
                # again, whole; a small request is made on the loop, where nothing retires meanwhile)
                unlink_segment(v.made, gen.index.shm_dir)
            else:
                gen.add_derived(v.key, v)
        if made:
            log.info("generation %d: %d derived tensor(s) made once for this host (%s; %.1f MiB)%s", gen.number,
                     len(made), summary(made), sum(v.entry.nbytes for v in made) / 2**20, "" if job is None else
                     f" in {time.monotonic() - job.started:.2f} s (checked in {job.checked_s:.2f} s)")
        self.known[rid] = [p.key for p in planned]
        while len(self.known) > REMEMBERED:
            self.known.popitem(last=False)
        return self._resolve(gen, planned)

    def _list(self, gen, found: list[DerivedTensor]) -> list[DerivedTensor]:
        """List reused derived tensors in `gen` (they live as long as it does too)."""
        for v in found:
            if v.key:
                gen.add_derived(v.key, v)
        return found

    # --- derivation jobs: off the request loop, a slice at a time ---------------------------------------

    def _advance(self) -> None:
        """Run the next slice: of the least lately served reader's work, starting it when it waits."""
        while True:
            work = self.jobs.pick()
            if work is None:
                return
            if work.phase == "waiting":
                if work.gen.number not in self.gens.live:  # retired while it waited: asked again, it is planned anew
                    self.jobs.finish(work)
                    continue
                work.started = time.monotonic()
                self._checking(work)
            work.slice_started = time.monotonic()
            self.jobs.run_slice(work)
            return

    def _checking(self, work: Work) -> None:
        """Its steps: check every item, but of the items that send an index alike (a model's layers of one kind)
        only the first; the others take its digest and strided form then (`naming`)."""
        firsts: dict[tuple, Planned] = {}
        for p in work.planned:
            if p.gather is not None:
                firsts.setdefault(_alike(p), p)
        leads = {id(p) for p in firsts.values()}
        work.phase, work.at = "checking", 0
        work.steps = [(check, (p,)) for p in work.planned if p.gather is None or id(p) in leads]
        work.naming = [(_named, (p, firsts[_alike(p)])) for p in work.planned
                       if p.gather is not None and id(p) not in leads]

    def tick(self) -> None:
        """Between requests: once a slice has ended, count it to its reader, move its work to its next phase (count
        a checked one; list what a made one made) and run the next slice, whosever it is."""
        work = self.jobs.current
        if work is None or work.thread is None or work.thread.is_alive():
            return
        self.jobs.charge(work.reader, time.monotonic() - work.slice_started)
        work.thread = None
        if work.error is not None:
            self._end(work)
        elif work.done:
            self._next_phase(work)
        self._advance()

    def _next_phase(self, work: Work) -> None:
        if work.phase == "checking" and work.naming:
            work.phase, work.steps, work.at = "naming", work.naming, 0
            return
        if work.phase in ("checking", "naming"):
            work.checked_s = time.monotonic() - work.started
            try:
                work.todo = self._todo(work.gen, work.planned, work.reader)
            except Exception as exc:
                work.error = exc
                self._end(work)
                return
            if work.todo:
                self.quota.reserve(work.number, work.reader, sum(n for _, n, _ in work.todo), len(work.todo))
                work.phase, work.at = "making", 0
                work.steps = [(self._make_one, (work, *item)) for item in work.todo]
                return
        self._end(work)

    def _make_one(self, work: Work, p: Planned, placed: int, keep: tuple | None) -> None:
        work.made.append(self._make(work.gen, p, work.reader, placed, keep, work.stop.is_set))

    def _end(self, work: Work) -> None:
        """A work is finished: list what it made (its lease holds it), or unlink it and keep its refusal's words."""
        self.quota.release(work.number)
        self.jobs.finish(work)
        if work.error is None and work.gen.number not in self.gens.live:
            work.error = GenerationGone(f"generation {work.gen.number} retired while its derived tensors were made: "
                                        f"refresh() and ask again")
        if work.error is not None:
            for v in work.made:
                unlink_segment(v.created, work.gen.index.shm_dir)
            forget_frames(work.error)  # what the failed job held (its request, its chunks) goes with it
            self._refuse(work, work.error)
        else:
            self.holds.hold(work.lease, self._register(work.gen, work.made, work.planned, work.rid, work))

    def _refuse(self, work: Work, exc: BaseException) -> None:
        """Tell `exc` (its type and words) to the next ask of `work`'s reader for the same request."""
        self.refused[(work.reader, work.rid)] = (type(exc), str(exc))
        while len(self.refused) > REMEMBERED:
            self.refused.popitem(last=False)

    def close(self) -> None:
        """Stop the derivation jobs (a slice stops between index chunks) and unlink what they made but never listed."""
        works, current = list(self.jobs.works.values()), self.jobs.current
        for work in works:
            work.stop.set()
        if current is not None and current.thread is not None:
            current.thread.join(self.cfg.stop_timeout_s)
        for work in works:
            for v in work.made:
                unlink_segment(v.created, work.gen.index.shm_dir)
            self.quota.release(work.number)
            self.jobs.finish(work)

    def status(self) -> dict:
        waiting = self.jobs.waiting()
        return {**self.quota.status(), "job": self.jobs.current.status() if self.jobs.current is not None else None,
                "queued": len(waiting), "queued_bytes": sum(w.kept for w in waiting)}
