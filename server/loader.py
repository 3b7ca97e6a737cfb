"""The one place the stages meet: checkpoint → plan → dequant → shared memory → tensor index."""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from expertd.index import TensorEntry, TensorIndex, checksum, write_json_atomic

from .arena import Arena
from .layout import Plan, plan_checkpoint
from .reader import Checkpoint

log = logging.getLogger("expertd.loader")


class Cancelled(Exception):
    """Loading was interrupted by a stop request or a signal."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class Loaded:
    """A published model: its arena (segments to unlink at exit) and its index."""

    def __init__(self, arena: Arena, index: TensorIndex):
        self.arena = arena
        self.index = index

    def close(self) -> None:
        self.arena.unlink()


def tensor_checksum(t: torch.Tensor) -> str:
    return checksum(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")


READ_AHEAD = 2  # tensors read ahead of the one being dequantized: memory stays a few tensors


def _read_source(ckpt: Checkpoint, src) -> tuple:
    """Read a source tensor (and its scale) and fault its pages in, off the dequant thread."""
    data = ckpt.read(src.name)
    flat = data.reshape(-1).view(torch.uint8) if data.numel() else None
    if flat is not None:
        flat[::4096].sum()  # one byte per page: safetensors maps lazily, so this pulls the file in here
    return src, data, ckpt.read(src.scale.name) if src.scale is not None else None


def _read_ahead(ckpt: Checkpoint, sources: list, depth: int = READ_AHEAD):
    """Yield (source, data, scale) in order while a thread reads the next `depth` sources."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="expertd-read")
    pending = collections.deque()
    upcoming = iter(sources)
    try:
        for src in itertools.islice(upcoming, depth):
            pending.append(pool.submit(_read_source, ckpt, src))
        while pending:
            done = pending.popleft().result()
            nxt = next(upcoming, None)
            if nxt is not None:
                pending.append(pool.submit(_read_source, ckpt, nxt))
            yield done
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True)


def prepare(checkpoint: str) -> tuple[Checkpoint, Plan]:
    """Open and fully validate a checkpoint; nothing is written."""
    ckpt = Checkpoint.open(checkpoint)
    return ckpt, plan_checkpoint(ckpt)


def load(
    ckpt: Checkpoint,
    plan: Plan,
    *,
    namespace: str,
    generation: int,
    segment_bytes: int = 1 << 32,
    device: str = "auto",
    index_path: str | None = None,
    progress: bool = False,
    should_stop=None,
    on_placed=None,
    group: str | None = None,
) -> Loaded:
    """Place every planned tensor in fresh shared memory; publish the index only once all are written."""
    from expertd.kernels import weight_dequant  # the daemon needs kernels; the client never imports them

    dev = resolve_device(device)
    arena = Arena(namespace, generation, segment_bytes, group=group)
    placements = arena.place([t.nbytes for t in plan.tensors])
    if on_placed is not None:
        on_placed([s.name for s in arena.segments])  # on record before anything exists
    started = time.perf_counter()
    tensors = []
    reads = None
    try:
        arena.create()
        bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="expertd load", disable=not progress)
        reads = _read_ahead(ckpt, [src for planned in plan.tensors for src in planned.sources])
        for planned, where in zip(plan.tensors, placements):
            if should_stop is not None and should_stop():
                raise Cancelled("loading stopped before it finished")
            out = arena.tensor(where, planned.shape, planned.dtype)
            fused = [s.name for s in planned.sources] != [planned.name]
            chunks = out.view(len(planned.sources), *planned.source_shape) if fused else out.view(1, *planned.shape)
            for k in range(len(planned.sources)):
                src, data, scale = next(reads)
                if scale is not None:
                    weight_dequant(
                        data, scale, plan.block_size[0], out=chunks[k], out_dtype=planned.dtype, name=src.name, device=dev,
                    )
                else:
                    chunks[k].copy_(data.view(chunks[k].shape))
                del data, scale
            tensors.append(
                TensorEntry(planned.name, where.segment, where.offset, planned.nbytes, list(planned.shape),
                            str(planned.dtype), [s.name for s in planned.sources], checksum=tensor_checksum(out))
            )
            del out, chunks
            bar.update(planned.nbytes)
        reads.close()
        bar.close()
        arena.unmap()  # every tensor over the mappings is gone by now
        index = TensorIndex(
            generation=generation,
            namespace=namespace,
            model_type=plan.model_type,
            layout=plan.layout,
            config=ckpt.config,
            segments=list(arena.segments),
            tensors=tensors,
            views=None,  # derived from the fused tensors' sources: one rule for server and client
        )
        if index_path is not None:
            os.makedirs(os.path.dirname(index_path) or ".", exist_ok=True)
            write_json_atomic(index_path, index.to_dict())
    except BaseException:
        if reads is not None:
            reads.close()  # stops the read-ahead thread before the arena goes
        arena.unlink()
        raise
    finally:
        ckpt.close()
    elapsed = time.perf_counter() - started
    log.info(
        "published generation %d: %d tensors, %.1f MiB in %d segment(s) in %.2fs (%.2f GB/s)",
        generation, len(tensors), arena.nbytes / 2**20, len(arena.segments), elapsed, plan.nbytes / max(elapsed, 1e-9) / 1e9,
    )
    return Loaded(arena, index)
