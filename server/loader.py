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

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from expertd.errors import ConfigError
from expertd.index import DEFAULT_SHM_DIR, SegmentEntry, TensorEntry, TensorIndex, tensor_checksum, write_json_atomic
from expertd.shm import map_segment, segment_bytes, view

from .arena import Arena
from .compute import compute, source_tensor
from .layout import Plan, plan_checkpoint
from .reader import Checkpoint

log = logging.getLogger("expertd.loader")

READ_AHEAD = 256  # sources hashed ahead of the one being written: views of the file mappings, not copies


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

    def close(self) -> None:
        """Remove the segments this build created (a build that is not published, or a daemon that exits)."""
        self.arena.unlink()


def _read_source(ckpt: Checkpoint, src, known: dict) -> tuple:
    """(source, part digest, data or None, scale, identities): off the writing thread.

    The weight is not read when its identity (same file, same place) is known from the last
    build: its digest is known, and its bytes are only needed if the part must be rewritten.
    """
    ids = {}
    weight_id = ckpt.identity(src.info)
    digest = known.get(weight_id)
    data = None
    if digest is None:
        data = ckpt.view(src.info)
        digest = tensor_checksum(data)  # touches every page: the file is pulled in here, not in the writer
    ids[weight_id] = digest
    scale = None
    if src.scale is not None:
        scale = ckpt.view(src.scale)
        scale_digest = tensor_checksum(scale)
        ids[ckpt.identity(src.scale)] = scale_digest
        digest = f"{digest}+{scale_digest}"
    return src, digest, data, scale, ids


def _read_ahead(ckpt: Checkpoint, sources: list, known: dict, depth: int = READ_AHEAD):
    """Yield `_read_source` results in order while a thread reads and hashes up to `depth` sources ahead."""
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def reader() -> None:
        try:
            for src in sources:
                if stop.is_set():
                    return
                results.put((True, _read_source(ckpt, src, known)))
        except BaseException as exc:  # handed to the consumer, raised there
            results.put((False, exc))

    thread = threading.Thread(target=reader, name="expertd-read", daemon=True)
    thread.start()
    try:
        for _ in sources:
            ok, item = results.get()
            if not ok:
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a reader waiting on a full queue, then let it end
            try:
                results.get(timeout=0.01)
            except queue.Empty:
                pass
        thread.join()


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


def prepare(checkpoint: str) -> tuple[Checkpoint, Plan]:
    """Open and fully validate a checkpoint; nothing is written."""
    ckpt = Checkpoint.open(checkpoint)
    return ckpt, plan_checkpoint(ckpt)


def write_part(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, *, name: str,
               block_size: int, device: torch.device) -> None:
    """One source part into its place: FP8 dequantized (bit-exact reference rounding), anything else copied."""
    if scale is not None:
        from expertd.kernels import weight_dequant  # the daemon needs kernels; the client never imports them

        # bf16 / fp16 scales (Qwen's FP8 releases) widen to float32 exactly: y = bf16(float32(x) * float32(s))
        weight_dequant(data, scale.float(), block_size, out=out, out_dtype=out.dtype, name=name, device=device)
    else:
        out.copy_(data.view(out.shape))


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
    progress: bool = False,
    should_stop=None,
    group: str | None = None,
    on_progress=None,
    shm_dir: str = DEFAULT_SHM_DIR,
) -> Built:
    """Place every planned tensor in shared memory; with `previous`, write only what changed."""
    dev = resolve_device(device)
    arena = Arena(namespace, generation, group=group, shm_dir=shm_dir)
    if previous is None:
        arena.check_space(sum(arena.segment_size(t.nbytes) for t in plan.tensors))
    old = PreviousBytes(previous.index) if previous is not None else None
    started = time.perf_counter()
    entries: list[TensorEntry] = []
    parts: dict[str, list[str]] = {}
    known: dict[tuple, str] = {}
    written = count = 0
    reads = config = None
    try:
        bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="expertd load", disable=not progress)
        reads = _read_ahead(ckpt, [src for planned in plan.tensors for src in planned.sources],
                            previous.known if previous is not None else {})
        for planned in plan.tensors:
            if should_stop is not None and should_stop():
                raise Cancelled("building stopped before it finished")
            n = len(planned.sources)
            prev = old.entries.get(planned.name) if old is not None else None
            prev_parts = previous.parts.get(planned.name) if prev is not None else None
            if prev is not None and (prev.shape != list(planned.shape) or prev.dtype != str(planned.dtype)
                                     or prev_parts is None or len(prev_parts) != n):
                prev = None
            out = chunks = None
            digests = []
            if planned.computed is not None:
                items = [next(reads) for _ in range(n)]
                for _, digest, _, _, ids in items:
                    known.update(ids)
                    digests.append(digest)
                if prev is None or digests != prev_parts:
                    if config is None:
                        from expertd.hf import model_config

                        config = model_config(ckpt.config)
                    tensors = [source_tensor(ckpt.view(src.info) if data is None else data, scale, src.info, planned.dtype,
                                             write_part, block_size=plan.block_size[0], device=dev)
                               for src, _, data, scale, _ in items]
                    result = compute(planned, tensors, config)
                    where = arena.add(planned.nbytes)
                    out = arena.tensor(where, planned.shape, planned.dtype)
                    out.copy_(result)
                    del items, tensors, result
            for k in range(n if planned.computed is None else 0):
                src, digest, data, scale, ids = next(reads)
                known.update(ids)
                digests.append(digest)
                same = prev is not None and digest == prev_parts[k]
                if same and out is None:
                    continue  # unchanged so far: maybe the whole tensor stays where it is
                if out is None:
                    where = arena.add(planned.nbytes)
                    out = arena.tensor(where, planned.shape, planned.dtype)
                    chunks = out.view(n, *planned.source_shape) if n > 1 else out.view(1, *planned.shape)
                    for j in range(k):  # the unchanged parts before the first change
                        chunks[j].view(-1).view(torch.uint8).copy_(old.part(prev, j, n))
                if same:
                    chunks[k].view(-1).view(torch.uint8).copy_(old.part(prev, k, n))
                    continue
                if data is None:
                    data = ckpt.view(src.info)
                write_part(chunks[k], data, scale, name=src.name, block_size=plan.block_size[0], device=dev)
                del data, scale
            if out is None:
                entries.append(prev)  # the new index points at the same bytes
            else:
                entries.append(TensorEntry(
                    planned.name, where.segment, where.offset, planned.nbytes, list(planned.shape), str(planned.dtype),
                    [] if planned.computed is not None else [s.name for s in planned.sources], checksum=tensor_checksum(out),
                ))
                written += planned.nbytes
                count += 1
                del out, chunks
            parts[planned.name] = digests
            bar.update(planned.nbytes)
            if on_progress is not None:
                on_progress(planned.nbytes)
        reads.close()
        bar.close()
        arena.unmap()  # every tensor over the writable mappings is gone by now
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
        )
    except BaseException:
        if reads is not None:
            reads.close()  # stops the read-ahead thread before the arena goes
        arena.unlink()
        raise
    finally:
        ckpt.close()
    elapsed = time.perf_counter() - started
    log.info(
        "built generation %d: %d of %d tensors written (%.1f MiB) in %.2fs",
        generation, count, len(entries), written / 2**20, elapsed,
    )
    return Built(arena, index, parts, known, written, count, elapsed)


def publish(index: TensorIndex, index_path: str | None) -> None:
    """Write a built generation's index JSON (temp + rename): readers see the old index or the new, whole."""
    if index_path is not None:
        os.makedirs(os.path.dirname(index_path) or ".", exist_ok=True)
        write_json_atomic(index_path, index.to_dict())


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
