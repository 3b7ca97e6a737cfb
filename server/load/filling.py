"""The loader's work items and the pool that runs them: reading, dequantizing and first-writing parts.

A served tensor is made of source parts (one checkpoint tensor each: an expert's weight in a fused
block, or the whole tensor). Each part is one work item: reserve its range of the segment, then read
its source (`preadv`), dequantize or copy it (its format's entry points, `dequant`) into a buffer that
stays in cache, hash both sides, and `pwrite` the result into the segment's file, chunk by chunk (see
`Output`: on tmpfs this takes fresh pages without zeroing them first). Items go to `load_threads`
threads in batches of a few MiB, the threads taking turns among 4 tensors per thread (writes into one
file wait on its lock), and results come back in the order the batches were given: the index comes out
the same as a serial load's, whatever the thread count.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from expertd.index import checksum, tensor_bytes, tensor_checksum

from ..shm.arena import Arena
from . import gpu_parts, native_parts
from .checkpoint import Checkpoint
from .dequant import stream_part, write_part
from .layout import Source
from .parts import BATCH_BYTES, CHUNK_BYTES, Output, Part, part_digest
from .small_parts import fill_small

BATCH_ITEMS = 256
WINDOW_PER_THREAD = 2  # tasks queued per thread: results are taken in order, so a slow task holds up others


def dequantized(ckpt: Checkpoint, src: Source, device: torch.device | str = "cpu") -> torch.Tensor:
    """One source read whole, as the daemon serves it: dequantized by its format, or as stored (tools: convert,
    inspect, evaluate)."""
    data = ckpt.load(src.info)
    if src.scale is None:
        return data
    out = torch.empty(src.shape, dtype=torch.bfloat16)
    write_part(out, data, ckpt.load(src.scale), codec=src.codec, name=src.info.name, block=src.block,
               device=torch.device(device))
    return out


def source_digest(ckpt: Checkpoint, src: Source, known: dict) -> tuple[str, dict]:
    """(digest of a source part, identities learned): the weight's checksum (skipped when its identity
    is known from the last build) joined with its scale's."""
    weight_id = ckpt.identity(src.info)
    digest = known.get(weight_id)
    if digest is None:
        digest = tensor_checksum(ckpt.view(src.info))
    ids, scale_digest = {weight_id: digest}, None
    if src.scale is not None:
        scale_digest = tensor_checksum(ckpt.view(src.scale))
        ids[ckpt.identity(src.scale)] = scale_digest
    return part_digest(digest, scale_digest), ids


def fill(parts: list[Part], ckpt: Checkpoint, arena: Arena, device: torch.device) -> list[tuple[str, dict, str]]:
    """Fill each part; per part (source digest, identities learned, checksum of the written bytes).

    Where the compiled library is, a task's parts go through one compiled call each way (`native_parts` on the
    CPU, `gpu_parts` through the GPU); small parts of a format with a batched entry point (FP8) on the CPU through
    `small_parts.fill_small` together (what DeepSeek-V3's tens of thousands of tensors at small dims cost is Python
    per part, not bytes); the rest (MXFP4, no compiler) chunk by chunk."""
    results: list = [None] * len(parts)
    small, compiled = [], []
    native, whole = _native(device), _whole_calls(device, arena)
    output = Output(arena, direct=(device.type == "cuda" and whole is None) or not arena.writes)
    if output.direct:  # pwrite needs no reservation: it takes the pages it fills, and says ENOSPC where none are left
        _reserve(parts, arena)
    for i, part in enumerate(parts):
        if part.old is not None:
            data = tensor_bytes(part.old)
            output.copy(part, data)
            results[i] = (part.digest, {}, checksum(data))
        elif whole is not None and whole[0](part):
            compiled.append(i)
        elif native and part.src.codec is not None and part.src.codec.batched and part.src.info.nbytes <= CHUNK_BYTES:
            small.append(i)
        else:
            results[i] = _fill_one(part, output, ckpt, device)
    for some, how in ((small, fill_small), (compiled, whole and whole[1])):
        if some:
            for i, result in zip(some, how([parts[i] for i in some], output, ckpt)):
                results[i] = result
    output.flush()
    return results


def _whole_calls(device: torch.device, arena: Arena):
    """(which parts, how to fill them) where a task's parts go through compiled calls on `device` (the GPU's
    pipeline, or the CPU's), else None: they go part by part."""
    if gpu_parts.usable(device):
        return gpu_parts.takes, partial(gpu_parts.fill_gpu, arena=arena, device=device)
    if native_parts.usable(device):
        return native_parts.takes, partial(native_parts.fill_native, arena=arena)
    return None


def _reserve(parts: list[Part], arena: Arena) -> None:
    """Reserve the parts' ranges and map their pages in (results go through the mapping), one call for each run of
    back-to-back parts of one segment."""
    start = end = where = None
    for part in parts:
        if part.where is not where or part.offset != end:
            if where is not None:
                arena.reserve(where, start, end - start, populate=True)
            where, start = part.where, part.offset
        end = part.offset + part.nbytes
    if where is not None:
        arena.reserve(where, start, end - start, populate=True)


def _native(device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    from expertd.kernels import native

    return native.available()


def _fill_one(part: Part, output: Output, ckpt: Checkpoint, device: torch.device) -> tuple[str, dict, str]:
    src = part.src
    scale = ckpt.view(src.scale) if src.scale is not None else None
    digest, out_digest = stream_part(part, output, ckpt, src, scale, device=device)
    ids, scale_digest = {ckpt.identity(src.info): digest}, None
    if scale is not None:
        scale_digest = tensor_checksum(scale)
        ids[ckpt.identity(src.scale)] = scale_digest
    return part_digest(digest, scale_digest), ids, out_digest


def batches(items, size_of):
    """Consecutive runs of `items` of about BATCH_BYTES (or BATCH_ITEMS items): one pool task each."""
    limit, count = BATCH_BYTES, BATCH_ITEMS
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += size_of(item)
        if size >= limit or len(batch) >= count:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class OrderedPool:
    """Runs tasks on `threads` threads, at most a few per thread queued, and hands results back in
    the order the tasks were given (so memory stays bounded and the outcome does not depend on timing)."""

    def __init__(self, threads: int):
        # The pool is the parallelism: torch's own threads would only fight it for the cores (set before
        # the pool's threads first use torch, which is when each takes torch's thread count).
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="expertd-load")
        self.window = WINDOW_PER_THREAD * max(1, threads) + 1
        self.pending: deque[tuple[object, Future]] = deque()

    def submit(self, tag, fn, *args, **kwargs):
        """Queue fn(*args); yields (tag, result) of the oldest tasks while too many are queued."""
        self.pending.append((tag, self.pool.submit(fn, *args, **kwargs)))
        while len(self.pending) > self.window:
            yield self._next()

    def run(self, fn, *args) -> Future:
        """Run fn(*args) on the pool outside the ordered results (housekeeping such as unmapping)."""
        return self.pool.submit(fn, *args)

    def drain(self):
        """(tag, result) of every task still queued, in order."""
        while self.pending:
            yield self._next()

    def _next(self):
        tag, future = self.pending.popleft()
        return tag, future.result()  # a task's exception is raised here, in the caller's thread

    def close(self) -> None:
        """Drop queued tasks and wait for running ones: nothing writes after this returns."""
        for _, future in self.pending:
            future.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
            self._torch_threads = 0
