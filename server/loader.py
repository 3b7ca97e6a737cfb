"""The one place the stages meet: checkpoint → plan → dequant → shared memory → tensor index.

Building and publishing are apart. `build` places a generation's tensors in fresh segments, one
per served tensor; given the generation it replaces, it keeps every served tensor whose source
bytes (FP8 weight + scale, or the stored bytes) did not change, so the new index points at the
same bytes, and for a block that did change it copies the unchanged parts instead of
dequantizing them again. A computed tensor (transformers converts it with more than a rename or a
stack) is rebuilt whole when any source changed, and its index entry lists no sources: its
checkpoint tensors are not parts of it. `publish` writes the index only once everything is in place.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from expertd.errors import ConfigError
from expertd.index import (
    DEFAULT_SHM_DIR, SegmentEntry, TensorEntry, TensorIndex, combined_checksum, write_json_atomic,
)
from expertd.partition import ExpertParallel
from expertd.shm import map_segment, segment_bytes, view

from .arena import Arena
from .compute import build_whole
from .filling import OrderedPool, Part, batches, default_threads, dequantized, fill, source_digest
from .layout import Plan, plan_checkpoint
from .reader import Checkpoint

log = logging.getLogger("expertd.loader")

class Cancelled(Exception):
    """Building was interrupted by a stop request or a signal."""


def resolve_device(device: str) -> torch.device:
    """The torch device dequant runs on; a CUDA device this host cannot use is a ConfigError, not a torch assert."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device {device!r} is not a torch device: use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device {device!r}: {why}; use device cpu or auto (`device:` in the config, "
                              "--device for convert), or install a CUDA build of torch on a GPU host")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: this host has {torch.cuda.device_count()} CUDA device(s); "
                              f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev


@dataclass
class Built:
    """A generation's tensors in shared memory and its index; `parts` holds, per served tensor,
    the digest of each source part, which the next build compares against."""

    arena: Arena  # the segments this build created (older ones belong to the generations that made them)
    index: TensorIndex
    parts: dict[str, list[str]]
    known: dict[tuple, str] = field(default_factory=dict)  # source identity -> digest, to skip re-reading
    bytes_written: int = 0
    tensors_written: int = 0
    seconds: float = 0.0
    bytes_read: int = 0  # checkpoint bytes this build read

    def close(self) -> None:
        """Remove the segments this build created (a build that is not published, or a daemon that exits)."""
        self.arena.unlink()


class PreviousBytes:
    """Read-only access to an older generation's served tensors, to copy unchanged parts from."""

    def __init__(self, index: TensorIndex):
        self.entries = {t.name: t for t in index.tensors}
        self.sizes = {s.name: s.nbytes for s in index.segments}
        self.shm_dir = index.shm_dir
        self._maps: dict[str, torch.Tensor] = {}

    def part(self, entry: TensorEntry, k: int, parts: int) -> torch.Tensor:
        """Part k of `parts` equal parts of a served tensor's bytes (as uint8)."""
        if entry.segment not in self._maps:
            mapping = map_segment(entry.segment, self.sizes[entry.segment], shm_dir=self.shm_dir)
            self._maps[entry.segment] = segment_bytes(mapping)
        flat = view(self._maps, entry).reshape(-1).view(torch.uint8)
        step = flat.numel() // parts
        return flat[k * step: (k + 1) * step]


def prepare(checkpoint: str, partition: ExpertParallel | None = None) -> tuple[Checkpoint, Plan]:
    """Open and fully validate a checkpoint (planning only `partition`'s experts when given); nothing is written."""
    ckpt = Checkpoint.open(checkpoint)
    try:
        return ckpt, plan_checkpoint(ckpt, partition=partition)
    except BaseException:
        ckpt.close()
        raise


def segments_of(entries: list[TensorEntry], *indexes: TensorIndex, arena: Arena) -> list[SegmentEntry]:
    """The segments `entries` lie in, in first-use order, sized from the arena or the older indexes."""
    sizes = {s.name: s.nbytes for index in indexes for s in index.segments}
    sizes.update({s.name: s.nbytes for s in arena.segments})
    seen = dict.fromkeys(e.segment for e in entries)
    return [SegmentEntry(name, sizes[name]) for name in seen]


def build(
    ckpt: Checkpoint,
    plan: Plan,
    *,
    namespace: str,
    generation: int,
    previous: Built | None = None,
    device: str = "auto",
    threads: int | None = None,
    progress: bool = False,
    should_stop=None,
    group: str | None = None,
    on_progress=None,
    shm_dir: str = DEFAULT_SHM_DIR,
) -> Built:
    """Place every planned tensor in shared memory on `threads` threads (default: every core this
    process may use); with `previous`, write only what changed."""
    dev = resolve_device(device)
    threads = threads or default_threads()
    arena = Arena(namespace, generation, group=group, shm_dir=shm_dir)
    started = time.perf_counter()
    pool = OrderedPool(threads)
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="expertd load", disable=not progress)

    def advance(nbytes: int) -> None:
        bar.update(nbytes)
        if on_progress is not None:
            on_progress(nbytes)

    def check_stop() -> None:
        if should_stop is not None and should_stop():
            raise Cancelled("building stopped before it finished")

    # Tens of thousands of small objects per build (parts, digests, identities) would start full collections
    # that scan the whole heap (the model skeleton, the plan) for nothing: ~15 % of a DeepSeek-V3-count build.
    collecting = gc.isenabled()
    gc.disable()
    slots: dict[int, list] = {}  # plan position -> [placement, out, results per part, parts pending]
    context: dict = {}  # the model config (for computed tensors) and the previous bytes, made once
    try:
        if previous is None:  # the tensors, and the generation's index segment published after them
            arena.check_space(sum(arena.segment_size(t.nbytes) for t in plan.tensors)
                              + arena.segment_size(INDEX_BYTES_PER_TENSOR * len(plan.tensors)))
        known: dict[tuple, str] = {}
        prev, digests = _unchanged(ckpt, plan, previous, pool, known, check_stop)
        unmapping = []  # a finished tensor's writable mapping is dropped on the pool while others fill

        def collect(done) -> None:
            for (slot, first, nbytes), results in done:
                entry = slots[slot]
                for k, (digest, ids, out_digest) in enumerate(results, first):
                    known.update(ids)
                    entry[2][k] = (digest, out_digest)
                entry[3] -= len(results)
                if entry[3] == 0:
                    entry[1] = None
                    unmapping.append(pool.run(arena.unmap_segment, entry[0].segment))
                advance(nbytes)

        def tasks(slot: int, planned):
            """The pool tasks that fill one served tensor: (tag, function, arguments...)."""
            check_stop()
            n = len(planned.sources)
            if prev[slot] is not None and digests[slot] == previous.parts[planned.name]:
                advance(planned.nbytes)
                return  # unchanged: the new index points at the same bytes
            where = arena.add(planned.nbytes, slot, reserve=planned.whole)
            out = arena.tensor(where, planned.shape, planned.dtype)
            pending = 1 if planned.whole else n
            slots[slot] = [where, out, [None] * pending, pending]
            if planned.whole:
                if planned.computed is not None and "config" not in context:
                    from expertd.hf import model_config

                    context["config"] = model_config(ckpt.config)
                yield (slot, 0, planned.nbytes), build_whole, ckpt, planned, out, context.get("config"), dev
                return
            chunks = out.view(n, *planned.source_shape) if n > 1 else out.view(1, *planned.shape)
            step = planned.nbytes // n
            items = [Part(src, chunks, k, where, k * step, step) for k, src in enumerate(planned.sources)]
            del out, chunks  # the parts hold the block; its mapping closes once they are done
            if prev[slot] is not None:  # copy the parts whose sources did not change
                old = context.get("old") or context.setdefault("old", PreviousBytes(previous.index))
                for k, item in enumerate(items):
                    if digests[slot][k] == previous.parts[planned.name][k]:
                        item.old, item.digest = old.part(prev[slot], k, n), digests[slot][k]
            first = 0
            for batch in batches(items, lambda item: item.nbytes):
                yield (slot, first, sum(item.nbytes for item in batch)), fill, batch, ckpt, arena, dev
                first += len(batch)

        # Threads take turns among TURNS_PER_THREAD x `threads` tensors at a time: each then mostly writes a
        # segment of its own (writes into one file take turns on its lock).
        for tag, fn, *args in interleave((tasks(slot, planned) for slot, planned in enumerate(plan.tensors)),
                                         threads * TURNS_PER_THREAD):
            collect(pool.submit(tag, fn, *args))
        collect(pool.drain())
        for future in unmapping:
            future.result()
        bar.close()

        entries: list[TensorEntry] = []
        parts: dict[str, list[str]] = {}
        written = count = 0
        for slot, planned in enumerate(plan.tensors):
            if slot not in slots:
                entries.append(prev[slot])
                parts[planned.name] = digests[slot]
                continue
            where, _, results, _ = slots[slot]
            if planned.whole:
                part_digests, out_checksum = results[0]
            else:
                part_digests = [digest for digest, _ in results]
                out_checksum = combined_checksum([out_digest for _, out_digest in results])
            entries.append(TensorEntry(
                planned.name, where.segment, where.offset, planned.nbytes, list(planned.shape), str(planned.dtype),
                [] if planned.computed is not None else planned.source_names, checksum=out_checksum,
                experts=planned.experts,
            ))
            parts[planned.name] = part_digests
            written += planned.nbytes
            count += 1
        slots.clear()
        arena.unmap()  # the rest (none after a whole build); every tensor over the writable mappings is gone by now
        pool.close()
        index = TensorIndex(
            generation=generation,
            namespace=namespace,
            model_type=plan.model_type,
            layout=plan.layout,
            config=ckpt.config,
            segments=segments_of(entries, *([previous.index] if previous is not None else []), arena=arena),
            tensors=entries,
            views=None,  # derived from the fused tensors' sources: one rule for server and client
            shm_dir=shm_dir,
            expert_parallel=plan.expert_parallel,
        )
    except BaseException:
        pool.close()  # no thread writes any more: then the segments can go
        bar.close()
        arena.unlink()
        # The exception keeps this frame: its tensors over the (now unlinked) segments must not keep their
        # pages alive with it. The rest goes with the frames the daemon clears (`jobs.forget_frames`).
        slots.clear()
        context.clear()
        raise
    finally:
        bytes_read = ckpt.bytes_read
        ckpt.close()
        if collecting:
            gc.enable()
    elapsed = time.perf_counter() - started
    log.info(
        "built generation %d on %d thread(s): %d of %d tensors written (%.1f MiB) in %.2fs",
        generation, threads, count, len(entries), written / 2**20, elapsed,
    )
    return Built(arena, index, parts, known, written, count, elapsed, bytes_read)


# Room the packed index takes per served tensor, for the space check (~280 bytes measured at DeepSeek-V3's
# counts: 479 kB for 1,755 tensors; a tensor's many source names are one pattern).
INDEX_BYTES_PER_TENSOR = 1024

# Tensors in turn per loader thread. With as many tensors as threads, a thread that gets ahead soon lands
# on the tensor another thread is writing and waits on that file's lock; with 4 per thread the ~1 GB bench
# model loaded 1.1x faster at 2 threads (3.28 vs 2.92 GB/s, medians of 7, three alternating rounds), and
# 8 or 16 gained nothing more.
TURNS_PER_THREAD = 4


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


def _unchanged(ckpt: Checkpoint, plan: Plan, previous: Built | None, pool: OrderedPool, known: dict, check_stop):
    """Per plan position, the previous generation's entry when it can be compared (same name, shape, dtype
    and part count) and the digests of its sources now (read and hashed on the pool); None elsewhere."""
    prev: list[TensorEntry | None] = [None] * len(plan.tensors)
    digests: list[list[str] | None] = [None] * len(plan.tensors)
    if previous is None:
        return prev, digests
    entries = {t.name: t for t in previous.index.tensors}
    todo = []
    for slot, planned in enumerate(plan.tensors):
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
        check_stop()
        collect(pool.submit(batch, digest_all, batch))
    collect(pool.drain())
    return prev, digests


def rebuild_tensors(ckpt: Checkpoint, plan, names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Served tensors `names` made anew from the checkpoint, as a build makes them (a successor repairing what it
    adopted: the caller keeps them only where they hash to the recorded checksum); names the plan lacks are left out."""
    by_name = {t.name: t for t in plan.tensors}
    out = {}
    for name in names:
        planned = by_name.get(name)
        if planned is None:
            continue
        if planned.whole:
            from expertd.hf import model_config

            result = torch.empty(planned.shape, dtype=planned.dtype)
            build_whole(ckpt, planned, result, model_config(ckpt.config) if planned.computed is not None else None, device)
        else:
            result = torch.cat([dequantized(ckpt, src, device).reshape(-1) for src in planned.sources])
        out[name] = result.view(planned.shape)
    return out


def publish(index: TensorIndex, index_path: str | None) -> None:
    """Write a built generation's index JSON (temp + rename): readers see the old index or the new, whole."""
    if index_path is not None:
        os.makedirs(os.path.dirname(index_path) or ".", exist_ok=True)
        write_json_atomic(index_path, index.to_dict(), indent=None)  # compact: ~0.5 MB at DeepSeek-V3 counts


def load(ckpt: Checkpoint, plan: Plan, *, namespace: str, generation: int, index_path: str | None = None,
         **options) -> Built:
    """Build a first generation and publish it (what a one-shot load is)."""
    built = build(ckpt, plan, namespace=namespace, generation=generation, **options)
    try:
        publish(built.index, index_path)
    except BaseException:
        built.close()
        raise
    return built
