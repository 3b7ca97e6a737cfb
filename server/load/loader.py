"""The one place the stages meet: checkpoint → plan → dequant → shared memory → tensor index.

Building and publishing are apart. `build` places a generation's tensors in fresh segments, one
per served tensor; given the generation it replaces, it keeps every served tensor whose source
bytes (FP8 weight + scale, or the stored bytes) did not change, so the new index points at the
same bytes, and for a block that did change it copies the unchanged parts instead of
dequantizing them again. A computed tensor (transformers converts it with more than a rename or a
stack) is rebuilt whole when any source changed, and its index entry lists no sources: its
checkpoint tensors are not parts of it. The steps, per served tensor, are `building.Build`'s; `build` takes one
through them and owns what lies around them. `publish` writes the index only once everything is in place.
"""

from __future__ import annotations

import gc
import logging
import time

import torch
from tqdm import tqdm

from expertd.errors import ConfigError
from expertd.extents import extents_of
from expertd.hf import model_config
from expertd.index import DEFAULT_SHM_DIR, SegmentEntry, TensorEntry, TensorIndex
from expertd.partition import ExpertParallel, PartitionError
from expertd.procfs import default_threads

from ..shm.arena import Arena
from .building import TURNS_PER_THREAD, Build
from .built import Built, publish
from .checkpoint import Checkpoint
from .compute import build_whole
from .filling import OrderedPool, dequantized
from .layout import Plan, plan_checkpoint
from .layout_cache import LayoutCache

log = logging.getLogger("expertd.loader")


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


def prepare(checkpoint: str, partition: ExpertParallel | None = None,
            layouts: str | None = None) -> tuple[Checkpoint, Plan]:
    """Open and fully validate a checkpoint (planning only `partition`'s experts when given, transformers' answer
    read from the layout cache folder `layouts` where it holds it); nothing is written but that cache."""
    ckpt = Checkpoint.open(checkpoint)
    try:
        plan = plan_checkpoint(ckpt, partition=partition, layouts=LayoutCache(layouts) if layouts else None)
        if partition is not None and not any(t.experts is not None for t in plan.tensors):
            raise PartitionError(f"expert_parallel (EP size {partition.size}) is set, but {checkpoint} "
                                 f"({plan.model_type or 'no model_type'}) has no expert stacks to split over EP ranks: "
                                 "a dense model is served whole; remove expert_parallel from the config")
        return ckpt, plan
    except BaseException:
        ckpt.close()
        raise


def segments_of(entries: list[TensorEntry], *indexes: TensorIndex, arena: Arena) -> list[SegmentEntry]:
    """The segments `entries` lie in, in first-use order, sized from the arena or the older indexes."""
    sizes = {s.name: s.nbytes for index in indexes for s in index.segments}
    sizes.update({s.name: s.nbytes for s in arena.segments})
    seen = dict.fromkeys(x.segment for e in entries for x in extents_of(e))  # every extent's too
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
    ranges: bool = False,
) -> Built:
    """Place every planned tensor in shared memory on `threads` threads (default: every core this
    process may use); with `previous`, write only what changed (with `ranges`, only the changed parts of a stack:
    `expert_ranges`)."""
    dev = resolve_device(device)
    threads = threads or default_threads()
    arena = Arena(namespace, generation, group=group, shm_dir=shm_dir)
    started = time.perf_counter()
    pool = OrderedPool(threads)
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="expertd load", disable=not progress)
    steps = Build(ckpt, plan, previous, arena, pool, dev, bar, on_progress, should_stop, ranges)
    # Tens of thousands of small objects per build (parts, digests, identities) would start full collections
    # that scan the whole heap (the model skeleton, the plan) for nothing: ~15 % of a DeepSeek-V3-count build.
    collecting = gc.isenabled()
    gc.disable()
    try:
        steps.check_space()
        steps.find_unchanged()
        # Threads take turns among TURNS_PER_THREAD x `threads` tensors at a time: each then mostly writes a
        # segment of its own (writes into one file take turns on its lock).
        steps.fill(threads * TURNS_PER_THREAD)
        bar.close()
        entries, parts, sums = steps.entries()
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
        steps.drop()
        raise
    finally:
        bytes_read = ckpt.bytes_read
        ckpt.close()
        if collecting:
            gc.enable()
    elapsed = time.perf_counter() - started
    log.info(
        "built generation %d on %d thread(s): %d of %d tensors written (%.1f MiB) in %.2fs",
        generation, threads, steps.count, len(entries), steps.written / 2**20, elapsed,
    )
    return Built(arena, index, parts, steps.known, steps.written, steps.count, elapsed, bytes_read, sums)


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
            result = torch.empty(planned.shape, dtype=planned.dtype)
            build_whole(ckpt, planned, result, model_config(ckpt.config) if planned.computed is not None else None,
                        device)
        else:
            result = torch.cat([dequantized(ckpt, src, device).reshape(-1) for src in planned.sources])
        out[name] = result.view(planned.shape)
    return out


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
