"""One build's steps: which served tensors are unchanged, the pool tasks that fill the rest, their index entries.

`loader.build` takes a `Build` through them in order and owns what lies around them (the arena's and the
pool's lives, the garbage collector, the index). Each served tensor goes one of three ways: kept (no source
changed: the new index points at the old bytes), whole (one task reads every source at once: a computed
tensor, or one not split into parts), or part by part (one checkpoint tensor a part, in batches; a part
whose source did not change is copied from the old bytes instead of dequantized again). With `ranges`
(`expert_ranges`), a stack of which some parts changed has only those written, into a segment of their size; its
entry's extents keep the others where they lie (`expert_ranges`).
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

import torch

from expertd.extents import extents_of
from expertd.hf import model_config
from expertd.index import TensorEntry, TensorIndex, combined_checksum
from expertd.segments import map_segment
from expertd.shm import segment_bytes, view

from ..shm.arena import Arena, align_up
from .built import Cancelled
from .checkpoint import Checkpoint
from .compute import build_whole
from .expert_slots import MAX_EXTENTS, layout, part_sums, say_unpaged, whole_pages
from .filling import OrderedPool, batches, fill, source_digest
from .layout import Plan
from .parts import Part

# Room the packed index takes per served tensor, for the space check (~280 bytes measured at DeepSeek-V3's
# counts: 479 kB for 1,755 tensors; a tensor's many source names are one pattern).
INDEX_BYTES_PER_TENSOR = 1024


def first_build_bytes(plan, unit: int) -> int:
    """What a first build of `plan` takes in a folder of `unit`-byte pages: a segment per tensor, and the index
    segment published after them."""
    pages = [max(t.nbytes, 1) for t in plan.tensors] + [INDEX_BYTES_PER_TENSOR * len(plan.tensors)]
    return sum(align_up(n, unit) for n in pages)

# Tensors in turn per loader thread. With as many tensors as threads, a thread that gets ahead soon lands
# on the tensor another thread is writing and waits on that file's lock; with 4 per thread the ~1 GB bench
# model loaded 1.1x faster at 2 threads (3.28 vs 2.92 GB/s, medians of 7, three alternating rounds), and
# 8 or 16 gained nothing more.
TURNS_PER_THREAD = 4

_part_bytes = attrgetter("nbytes")


def interleave(streams, width: int):
    """The items of `streams` (iterables, taken in order), `width` of them at a time taking turns: a stream
    joins when one before it is done."""
    streams, active = iter(streams), deque()
    while True:
        while len(active) < width:
            stream = next(streams, None)
            if stream is None:
                break
            active.append(iter(stream))
        if not active:
            return
        stream = active.popleft()
        for item in stream:
            yield item
            active.append(stream)
            break


class PreviousBytes:
    """Read-only access to an older generation's served tensors, to copy unchanged parts from."""

    def __init__(self, index: TensorIndex):
        self.entries = {t.name: t for t in index.tensors}
        self.sizes = {s.name: s.nbytes for s in index.segments}
        self.shm_dir = index.shm_dir
        self._maps: dict[str, torch.Tensor] = {}
        self._flat: dict[str, torch.Tensor] = {}  # a served tensor's bytes (one view, however many ranges)

    def part(self, entry: TensorEntry, k: int, parts: int) -> torch.Tensor:
        """Part k of `parts` equal parts of a served tensor's bytes (as uint8)."""
        flat = self._flat.get(entry.name)
        if flat is None or flat.numel() != entry.nbytes:
            for name in dict.fromkeys(x.segment for x in extents_of(entry)):  # every extent's segment
                if name not in self._maps:
                    self._maps[name] = segment_bytes(map_segment(name, self.sizes[name], shm_dir=self.shm_dir))
            flat = self._flat[entry.name] = view(self._maps, entry).reshape(-1).view(torch.uint8)
        step = flat.numel() // parts
        return flat[k * step: (k + 1) * step]


class Build:
    """A generation's tensors on their way into `arena`: what the steps share, per plan position (slot).

    `previous` is the generation this one replaces (a `built.Built`), or None for a first build. `bar` and
    `on_progress` hear of every byte placed or kept; `should_stop` is asked before each served tensor."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, previous, arena: Arena, pool: OrderedPool,
                 device: torch.device, bar, on_progress=None, should_stop=None, ranges: bool = False):
        self.ckpt, self.plan, self.previous, self.device, self.ranges = ckpt, plan, previous, device, ranges
        self.arena, self.pool = arena, pool
        self.bar, self.on_progress, self.should_stop = bar, on_progress, should_stop
        self.known: dict[tuple, str] = {}  # source identity -> digest, for the next build to skip re-reading
        self.prev: list[TensorEntry | None] = [None] * len(plan.tensors)  # the old entry, where comparable
        self.digests: list[list[str] | None] = [None] * len(plan.tensors)  # its sources' digests now
        self.slots: dict[int, list] = {}  # slot -> [placement, out, results per part, parts pending]
        self.changed: dict[int, list[int]] = {}  # slot -> the parts written, where only those are (`ranges`)
        self.unpaged: list[TensorEntry] = []  # changed stacks written whole: their parts are not whole pages
        self.unmapping = []  # a finished tensor's writable mapping is dropped on the pool while others fill
        self.config = None  # the model config, for computed tensors, made once
        self.old: PreviousBytes | None = None  # the previous generation's bytes, mapped once
        self.written = self.count = 0  # bytes and tensors this build wrote (not kept)

    def advance(self, nbytes: int) -> None:
        """Bytes placed or kept, for the progress bar and the caller's `on_progress`."""
        self.bar.update(nbytes)
        if self.on_progress is not None:
            self.on_progress(nbytes)

    def check_stop(self) -> None:
        """Cancelled once `should_stop` says so (asked between tasks: a running task finishes)."""
        if self.should_stop is not None and self.should_stop():
            raise Cancelled("building stopped before it finished")

    def check_space(self) -> None:
        """Refuse a first build the shared-memory folder cannot hold, before anything is written: its tensors
        and the index segment published after them."""
        if self.previous is None:
            self.arena.check_space(first_build_bytes(self.plan, self.arena.shm.unit))

    def find_unchanged(self) -> None:
        """Per slot, the previous generation's entry where it can be compared (same name, shape, dtype and
        part count) and the digests of its sources now (read and hashed on the pool)."""
        previous, prev, digests, known, ckpt = self.previous, self.prev, self.digests, self.known, self.ckpt
        if previous is None:
            return
        entries = {t.name: t for t in previous.index.tensors}
        todo = []
        for slot, planned in enumerate(self.plan.tensors):
            entry = entries.get(planned.name)
            old_parts = previous.parts.get(planned.name)
            if (entry is not None and entry.shape == list(planned.shape) and entry.dtype == str(planned.dtype)
                    and old_parts is not None and len(old_parts) == len(planned.sources)):
                prev[slot] = entry
                digests[slot] = [None] * len(planned.sources)
                todo.extend((slot, k, src) for k, src in enumerate(planned.sources))

        def digest_all(items):
            return [source_digest(ckpt, src, previous.known) for _, _, src in items]

        def collect(done) -> None:
            for batch, results in done:
                for (slot, k, _), (digest, ids) in zip(batch, results):
                    digests[slot][k] = digest
                    known.update(ids)

        for batch in batches(todo, lambda item: item[2].info.nbytes):
            self.check_stop()
            collect(self.pool.submit(batch, digest_all, batch))
        collect(self.pool.drain())

    def fill(self, width: int) -> None:
        """Run every served tensor's tasks on the pool, `width` tensors at a time taking turns, and wait for
        all of them and for the writable mappings they leave to be dropped."""
        pool, collect = self.pool, self._collect
        for tag, fn, *args in interleave((self.tasks(slot, planned) for slot, planned in enumerate(self.plan.tensors)),
                                         width):
            collect(pool.submit(tag, fn, *args))
        collect(pool.drain())
        for future in self.unmapping:
            future.result()

    def tasks(self, slot: int, planned):
        """The pool tasks that fill one served tensor, as (tag, function, arguments...): none when it is kept."""
        self.check_stop()
        if self.prev[slot] is not None and self.digests[slot] == self.previous.parts[planned.name]:
            self.advance(planned.nbytes)
            return  # unchanged: the new index points at the same bytes
        if planned.whole:
            yield self._whole(slot, planned)
        else:
            yield from self._parts(slot, planned)

    def _place(self, slot: int, planned, pending: int, changed: int | None = None):
        """A served tensor's place in a fresh segment (with `changed`: that many of its parts only, as a
        [changed, *source_shape] block), and a writable tensor over it; its slot awaits `pending` results."""
        shape, nbytes = planned.shape, planned.nbytes
        if changed is not None:
            shape, nbytes = (changed, *planned.source_shape), nbytes // len(planned.sources) * changed
        where = self.arena.add(nbytes, slot, reserve=planned.whole)
        out = self.arena.tensor(where, shape, planned.dtype)
        self.slots[slot] = [where, out, [None] * pending, pending]
        return where, out

    def _whole(self, slot: int, planned):
        """The one task that makes a tensor from all its sources at once (computed, or not split into parts)."""
        _, out = self._place(slot, planned, 1)
        if planned.computed is not None and self.config is None:
            self.config = model_config(self.ckpt.config)
        return (slot, 0, planned.nbytes), build_whole, self.ckpt, planned, out, self.config, self.device

    def _parts(self, slot: int, planned):
        """The tasks that fill a tensor part by part (a checkpoint tensor each), a few MiB of parts a task."""
        n = len(planned.sources)
        step = planned.nbytes // n
        changed = self._changed_only(slot, planned)
        if changed is not None:  # only they are written, into a segment of their size
            where, chunks = self._place(slot, planned, len(changed), len(changed))
            items = [Part(planned.sources[k], chunks, j, where, j * step, step) for j, k in enumerate(changed)]
            self.changed[slot] = changed
            self.advance((n - len(changed)) * step)
        else:
            where, out = self._place(slot, planned, n)
            chunks = out.view(n, *planned.source_shape) if n > 1 else out.view(1, *planned.shape)
            items = [Part(src, chunks, k, where, k * step, step) for k, src in enumerate(planned.sources)]
            del out  # the parts hold the block; its mapping closes once they are done
            if self.prev[slot] is not None:
                self._copy_unchanged(slot, planned, items)
        del chunks
        ckpt, arena, device, first = self.ckpt, self.arena, self.device, 0
        for batch in batches(items, _part_bytes):
            yield (slot, first, sum(item.nbytes for item in batch)), fill, batch, ckpt, arena, device
            first += len(batch)

    def _changed_only(self, slot: int, planned) -> list[int] | None:
        """With `ranges`, the parts of a stack whose sources changed, where only they are to be written: some but
        not all changed, the parts whole pages, the new ranges at most MAX_EXTENTS. Else None (written whole)."""
        entry = self.prev[slot]
        if not self.ranges or entry is None:
            return None
        now, before = self.digests[slot], self.previous.parts[planned.name]
        changed = [k for k in range(len(now)) if now[k] != before[k]]
        if not changed or len(changed) == len(now) or not whole_pages(entry, self.arena, self.unpaged):
            return None
        return changed if len(layout(entry, changed, "")) <= MAX_EXTENTS else None

    def _copy_unchanged(self, slot: int, planned, items: list[Part]) -> None:
        """Point each part whose source did not change at the previous generation's bytes: copied, not dequantized."""
        if self.old is None:
            self.old = PreviousBytes(self.previous.index)
        old, entry, n = self.old, self.prev[slot], len(items)
        now, before = self.digests[slot], self.previous.parts[planned.name]
        for k, item in enumerate(items):
            if now[k] == before[k]:
                item.old, item.digest = old.part(entry, k, n), now[k]

    def _collect(self, done) -> None:
        """Record finished tasks' results in order; a tensor whose last part is in has its mapping dropped."""
        slots, known = self.slots, self.known
        for (slot, first, nbytes), results in done:
            entry = slots[slot]
            for k, (digest, ids, out_digest) in enumerate(results, first):
                known.update(ids)
                entry[2][k] = (digest, out_digest)
            entry[3] -= len(results)
            if entry[3] == 0:
                entry[1] = None
                self.unmapping.append(self.pool.run(self.arena.unmap_segment, entry[0].segment))
            self.advance(nbytes)

    def entries(self) -> tuple[list[TensorEntry], dict[str, list[str]], dict[str, list[str]]]:
        """The index entries in plan order (kept ones as they were), each served tensor's source digests, and the
        checksums of each part of those whose checksum is combined of parts (`Built.sums`)."""
        entries: list[TensorEntry] = []
        parts: dict[str, list[str]] = {}
        sums: dict[str, list[str]] = {}
        slots, written, count = self.slots, 0, 0
        for slot, planned in enumerate(self.plan.tensors):
            if slot not in slots:
                entries.append(self.prev[slot])
                parts[planned.name] = self.digests[slot]
                if planned.name in self.previous.sums:
                    sums[planned.name] = self.previous.sums[planned.name]
                continue
            where, _, results, _ = slots[slot]
            if slot in self.changed:
                entry, parts[planned.name], sums[planned.name] = self._ranged(slot, planned, where, results)
                written += planned.nbytes // len(planned.sources) * len(self.changed[slot])
            else:
                entry, parts[planned.name] = _entry(planned, where, results)
                if not planned.whole:
                    sums[planned.name] = [out_digest for _, out_digest in results]
                written += planned.nbytes
            entries.append(entry)
            count += 1
        slots.clear()
        self.written, self.count = written, count
        say_unpaged(self.unpaged, self.arena, "reload")
        return entries, parts, sums

    def _ranged(self, slot: int, planned, where, results) -> tuple[TensorEntry, list[str], list[str]]:
        """The entry of a stack of which only the changed parts were written (at `where`, in order), its source
        digests and its parts' checksums: the unchanged parts' ranges and checksums are the old entry's."""
        if self.old is None:
            self.old = PreviousBytes(self.previous.index)
        old, changed = self.prev[slot], self.changed[slot]
        digests = list(self.digests[slot])
        sums = part_sums(old, self.old, self.previous.sums.get(planned.name))
        for j, k in enumerate(changed):
            digests[k], sums[k] = results[j]
        extents = layout(old, changed, where.segment, where.offset)
        return TensorEntry(planned.name, extents[0].segment, extents[0].offset, planned.nbytes, list(planned.shape),
                           str(planned.dtype), planned.source_names, checksum=combined_checksum(sums),
                           experts=planned.experts, extents=extents), digests, sums

    def drop(self) -> None:
        """Let go of every tensor the steps hold (a failed build, whose segments are gone)."""
        self.slots.clear()
        self.config = self.old = None


def _entry(planned, where, results) -> tuple[TensorEntry, list[str]]:
    """The index entry of a tensor this build wrote, and its source digests; a computed tensor lists no sources
    (its checkpoint tensors are not parts of it)."""
    if planned.whole:
        part_digests, out_checksum = results[0]
    else:
        part_digests = [digest for digest, _ in results]
        out_checksum = combined_checksum([out_digest for _, out_digest in results])
    return TensorEntry(
        planned.name, where.segment, where.offset, planned.nbytes, list(planned.shape), str(planned.dtype),
        [] if planned.computed is not None else planned.source_names, checksum=out_checksum,
        experts=planned.experts,
    ), part_digests
