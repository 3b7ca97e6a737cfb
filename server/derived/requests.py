"""Derived tensors asked by readers (`cast`, `gather`): checked whole, counted, made once per host, off the loop
when large.

A request is planned first (`tensors.plan_*`: names, dtypes, shapes and sizes; nothing inflated), then checked
whole (`tensors.check`: every index inflated chunk by chunk and in range, every derivation named by its digest),
then what no live generation has yet is counted against the reader's and the daemon's quotas (`quota`) in one
check, then made. A request that fails anywhere makes nothing: no build-then-unlink.

Small requests (few items, index entries and bytes) run on the request loop. Larger ones run as a derivation job
on a thread of its own, in two steps (check, then make) with the quota check between them on the loop's thread, so
only the loop ever touches the tables. Meanwhile the reply says `building` and the client asks again; other
clients are answered as usual. A request is known again by its digest (`request_digest`: the request as sent and
its sources' identity): the names a job found answer the next ask of anyone without inflating anything; a job's
refusal answers the next ask of the reader who asked (never another's: a refusal may be that reader's quota), kept
as its type and words only (no frames, nothing of the request). One job at a time; other large requests wait in a
queue served reader by reader in turn, at most QUEUED_PER_READER of one reader's at once, so no reader holds the
job for others.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from expertd import replies
from expertd.derived import source_identity
from expertd.errors import DerivedLimit, GenerationGone
from expertd.extents import extents_of
from expertd.procfs import default_threads, name_this_thread

from ..serving.jobs import forget_frames
from ..shm.arena import unlink_segment
from .extents import make_changed, older_forms, placed_bytes, prior
from .quota import Quota, reader_of
from .tensors import Planned, DerivedTensor, check, make, plan_casts, plan_gathers, summary

log = logging.getLogger("expertd.derived")

INLINE_ITEMS = 64  # a request is made on the request loop when it names at most this many tensors,
INLINE_ENTRIES = 1 << 20  # inflates at most this many index entries (4 MiB),
INLINE_BYTES = 8 << 20  # and makes at most this many bytes; else it is a derivation job
REMEMBERED = 256  # requests whose names (or refusal) are kept for the next ask
QUEUED_PER_READER = 4  # a reader's large requests waiting for the job at once (more: DerivedLimit, ask again later)


def _alike(p: Planned) -> tuple:
    """What decides a gather's inflated index, its checks and its strided form: the index as sent, its length, the
    source block and whether it reads several sources."""
    return *p.gather.index_key(), bool(p.more)


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


@dataclass
class Work:
    """A derivation job: check `planned` (thread), count (loop), make `todo` (thread), list what it made (loop)."""

    number: int
    rid: str
    gen: object
    planned: list
    reader: str
    phase: str = "checking"  # "checking" | "making"
    thread: threading.Thread | None = None
    error: BaseException | None = None
    todo: list = field(default_factory=list)  # (planned, placed bytes) to make
    made: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    checked_s: float = 0.0  # how long its check took

    def status(self) -> dict:
        return {"job": self.number, "generation": self.gen.number, "phase": self.phase, "reader": self.reader,
                "tensors": len(self.planned), "made": len(self.made), "to_make": len(self.todo)}


class DerivedRequests:
    def __init__(self, cfg, gens):
        self.cfg, self.gens = cfg, gens
        self.quota = Quota(cfg, gens)
        self.known: OrderedDict[str, list[str]] = OrderedDict()  # request digest -> its derivations' names
        # (reader, request digest) -> a job's refusal, as (type, words): told to that reader's next ask
        self.refused: OrderedDict[tuple[str, str], tuple[type, str]] = OrderedDict()
        self.queue: OrderedDict[tuple[str, str], tuple] = OrderedDict()  # (reader, digest) -> (gen, planned)
        self.job: Work | None = None
        self._numbers = itertools.count(1)

    @property
    def busy(self) -> bool:
        """A derivation job is under way (its next step waits for a `tick`)."""
        return self.job is not None

    def ask(self, kind: str, gen, items: list, peer) -> replies.DerivedReply:
        """The reply to a `cast` or `gather` of generation `gen`: its derived tensors, or `building` (ask again)."""
        served = {t.name: t for t in gen.index.tensors}
        if kind == "cast":
            planned = plan_casts(items, served, gen.number)
        else:
            planned = plan_gathers(items, served, gen.number, self.quota.limits()["max_bytes"])
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
                return self._reply(gen, self._list(gen, found))
        if len(planned) <= INLINE_ITEMS and sum(p.entries for p in planned) <= INLINE_ENTRIES \
                and sum(p.nbytes for p in planned) <= INLINE_BYTES:
            for p in planned:
                check(p)
            return self._reply(gen, self._make_now(gen, planned, reader, rid))
        self._wait(reader, rid, gen, planned)
        return replies.DerivedReply(generation=gen.number, tensors=[], building=True)

    def _wait(self, reader: str, rid: str, gen, planned: list[Planned]) -> None:
        """Start the job for a large request, or queue it behind the one running (once; at most QUEUED_PER_READER
        of one reader's)."""
        job = self.job
        if (job is not None and (job.reader, job.rid) == (reader, rid)) or (reader, rid) in self.queue:
            return
        if sum(1 for r, _ in self.queue if r == reader) >= QUEUED_PER_READER:
            raise DerivedLimit(f"{reader} has {QUEUED_PER_READER} large cast or gather requests waiting for the "
                               "daemon's derivation job: ask again once one is made")
        self.queue[(reader, rid)] = (gen, planned)
        if job is None:
            self._next()

    def _next(self, after: str | None = None) -> None:
        """Start the next queued request whose generation is live: the first of a reader other than `after` (the
        reader served last) when there is one, so readers take turns."""
        while self.queue:
            key = next((k for k in self.queue if k[0] != after), next(iter(self.queue)))
            gen, planned = self.queue.pop(key)
            if gen.number in self.gens.live:
                self.job = Work(next(self._numbers), key[1], gen, planned, key[0])
                self._run(self.job, self._check_all)
                return

    def _reply(self, gen, derived: list[DerivedTensor]) -> replies.DerivedReply:
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
        todo, forms = {}, older_forms(self.gens, gen)
        for p, v in zip(planned, self._resolve(gen, planned)):
            if v is None and p.key not in todo:
                keep = prior(p, forms, self.quota.unit)
                todo[p.key] = (p, self.quota.placed(p.nbytes if keep is None else placed_bytes(p, keep[1])), keep)
        names = [p.entry.name for p, _, _ in todo.values()]
        what = f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") if names else ""
        self.quota.check(reader, [placed for _, placed, _ in todo.values()], gen.number, what)
        return list(todo.values())

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

    # --- derivation jobs: off the request loop ---------------------------------------------------------

    def _run(self, job: Work, step) -> None:
        def run() -> None:
            name_this_thread("expertd-derive")  # the kernel keeps 15 bytes: no number
            try:
                step(job)
            except BaseException as exc:  # told to the next ask of the same request
                job.error = exc

        job.thread = threading.Thread(target=run, name=f"expertd-derive-{job.number}", daemon=True)
        job.thread.start()

    def _check_all(self, job: Work) -> None:
        """Check every item: an index several items send alike (a model's layers of one kind) is checked, digested
        and its strided form found by the first of them; the others take those and only name themselves."""
        def one(p: Planned, first: Planned | None) -> None:
            if job.stop.is_set():
                raise InterruptedError("the daemon is stopping")
            if first is None:
                check(p)
            else:
                p.gather.digest = first.gather.digest
                p.key = p.gather.key([p.entry, *p.more])
                p.gather.form = first.gather.form if not p.more else None

        firsts: dict[tuple, Planned] = {}
        for p in job.planned:
            if p.gather is not None:
                firsts.setdefault(_alike(p), p)
        leads = {id(p) for p in firsts.values()}
        self._on_threads(job, one, [(p, None) for p in job.planned if p.gather is None or id(p) in leads])
        self._on_threads(job, one, [(p, firsts[_alike(p)]) for p in job.planned
                                    if p.gather is not None and id(p) not in leads])
        job.checked_s = time.monotonic() - job.started

    def _make_all(self, job: Work) -> None:
        def one(p: Planned, placed: int, keep: tuple | None) -> None:
            job.made.append(self._make(job.gen, p, job.reader, placed, keep, job.stop.is_set))

        self._on_threads(job, one, job.todo)

    def _on_threads(self, job: Work, step, items: list[tuple]) -> None:
        """`step(*item)` for each of `items` on as many threads as the load uses (each item on its own: inflating,
        hashing and torch's copies release the GIL): every one done or failed before this returns, the first error
        raised."""
        import torch

        workers = max(1, min(len(items), self.cfg.load_threads or default_threads()))
        threads = torch.get_num_threads()  # the pool is the parallelism (as the load's): each thread runs torch's
        torch.set_num_threads(1)  # ops on itself, taking this count at its first op
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix=f"expertd-derive-{job.number}") as pool:
                done = [pool.submit(step, *item) for item in items]
        finally:
            torch.set_num_threads(threads)
        for future in done:
            future.result()

    def tick(self) -> None:
        """Between requests: move the job on once its thread has ended (count, then list what it made)."""
        job = self.job
        if job is None or job.thread.is_alive():
            return
        if job.error is None and job.phase == "checking":  # checked: count, then make
            try:
                job.todo = self._todo(job.gen, job.planned, job.reader)
            except Exception as exc:
                job.error = exc
            else:
                self.quota.reserve(job.number, job.reader, sum(n for _, n, _ in job.todo), len(job.todo))
                job.phase = "making"
                self._run(job, self._make_all)
                return
        self.quota.release(job.number)
        self.job = None
        if job.error is None and job.gen.number not in self.gens.live:
            job.error = GenerationGone(f"generation {job.gen.number} retired while its derived tensors were made: "
                                       f"refresh() and ask again")
        if job.error is not None:
            for v in job.made:
                unlink_segment(v.created, job.gen.index.shm_dir)
            forget_frames(job.error)  # what the failed job held (its request, its chunks) goes with it
            self.refused[(job.reader, job.rid)] = (type(job.error), str(job.error))
            while len(self.refused) > REMEMBERED:
                self.refused.popitem(last=False)
        else:
            self._register(job.gen, job.made, job.planned, job.rid, job)
        self._next(after=job.reader)

    def close(self) -> None:
        """Stop a derivation job (it stops between index chunks) and unlink what it made but never listed."""
        job, self.job = self.job, None
        self.queue.clear()
        if job is None:
            return
        job.stop.set()
        job.thread.join(self.cfg.stop_timeout_s)
        for v in job.made:
            unlink_segment(v.created, job.gen.index.shm_dir)
        self.quota.release(job.number)

    def status(self) -> dict:
        return {**self.quota.status(), "job": self.job.status() if self.job is not None else None}
