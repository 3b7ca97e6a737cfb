"""The loader's work items and the pool that runs them: reading, dequantizing and first-writing parts.

A served tensor is made of source parts (one checkpoint tensor each: an expert's weight in a fused
block, or the whole tensor). Each part is one work item: reserve its range of the segment, then read
its source (`preadv`), dequantize or copy it into a buffer that stays in cache, hash both sides, and
`pwrite` the result into the segment's file, chunk by chunk (see `Output`: on tmpfs this takes fresh
pages without zeroing them first). Items go to `load_threads` threads in batches of a few MiB, the
threads taking turns among 4 tensors per thread (writes into one file wait on its lock), and results come
back in the order the batches were given: the index comes out the same as a serial load's, whatever
the thread count.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from expertd.index import checksum, tensor_bytes, tensor_checksum

from .arena import Arena
from .layout import Source
from .parts import CHUNK_BYTES, Output, Part, buffer, memory_at, part_digest
from .reader import Checkpoint
from .small_parts import fill_small

BATCH_BYTES = 8 << 20  # output bytes per pool task: small parts go in batches, a large part alone
BATCH_ITEMS = 256


def default_threads() -> int:
    """The cores this process may run on (its affinity mask, which containers' cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def write_part(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, *, name: str,
               block: tuple[int, int] | None, device: torch.device, threads: int | None = None,
               kind: str | None = None) -> None:
    """One source part into its place: dequantized by its format (`kind`: "fp8" when a scale is given and no
    kind; "mxfp4"), bit-exact to the format's definition; plain bytes copied."""
    kind = kind or ("fp8" if scale is not None else "plain")
    if kind == "plain":
        out.copy_(data.view(out.shape))
        return
    from expertd import kernels  # the daemon needs kernels; the client never imports them

    if kind == "mxfp4":
        kernels.dequant_mxfp4(data, scale, out=out, name=name, device=device, threads=threads)
        return
    # bf16 / fp16 scales (Qwen's and llmcompressor's FP8) widen to float32 exactly: y = bf16(float32(x) * float32(s))
    m, n = data.shape
    grid = scale.float().reshape(-(-m // block[0]), -(-n // block[1]))  # a per-tensor scale may be stored as [1]
    kernels.weight_dequant(data, grid, block, out=out, out_dtype=out.dtype, name=name, device=device, threads=threads)


def dequantized(ckpt: Checkpoint, src: Source, device: torch.device | str = "cpu") -> torch.Tensor:
    """One source read whole, as the daemon serves it: dequantized by its format, or as stored (tools: convert,
    inspect, evaluate)."""
    data = ckpt.load(src.info)
    if src.scale is None:
        return data
    out = torch.empty(src.shape, dtype=torch.bfloat16)
    write_part(out, data, ckpt.load(src.scale), name=src.info.name, block=src.block, kind=src.kind,
               device=torch.device(device))
    return out


def row_pieces(m: int, row_bytes: int, block_rows: int, cuda: bool):
    """(r0, r1, rows one scale covers) row ranges of an [m, ...] FP8 weight dequantized a piece at a time:
    whole block rows about CHUNK_BYTES of results each (one block row when that is up to BATCH_BYTES), else
    slices of one block row (a per-tensor scale over a large tensor). On CUDA: the whole tensor."""
    if cuda or m == 0:
        yield 0, m, block_rows
        return
    target = max(1, CHUNK_BYTES // max(1, row_bytes))
    if block_rows <= target or block_rows * row_bytes <= BATCH_BYTES:
        step = max(1, target // block_rows) * block_rows
        for r0 in range(0, m, step):
            yield r0, min(m, r0 + step), block_rows
        return
    for b0 in range(0, m, block_rows):
        b1 = min(m, b0 + block_rows)
        for r0 in range(b0, b1, target):
            yield r0, min(b1, r0 + target), min(b1, r0 + target) - r0


def stream_part(part: Part, output: Output, ckpt: Checkpoint, src: Source, scale: torch.Tensor | None, *,
                device: torch.device) -> tuple[str, str]:
    """Write one part chunk by chunk: read (`preadv`), hash the source chunk, dequantize or copy it,
    hash the result while it is in cache: (checksum of the source bytes, checksum of the written bytes)."""
    info = src.info
    src_hash = xxhash.xxh3_64()
    if scale is None:  # stored bytes: read straight into place; source and result are the same bytes
        for b0 in range(0, info.nbytes, CHUNK_BYTES):
            nbytes = min(CHUNK_BYTES, info.nbytes - b0)
            into = memory_at(output.at(part, b0, nbytes), nbytes)
            ckpt.read_into(info, b0, into)
            src_hash.update(into)
        digest = "xxh3_64:" + src_hash.hexdigest()
        return digest, digest
    if src.kind == "mxfp4":
        return _stream_mxfp4(part, output, ckpt, src, scale, device)
    out_hash = xxhash.xxh3_64()
    m, n = info.shape  # FP8 [M, N], as the plan checked
    item = part.out.element_size()
    rows_per_scale, cols_per_scale = src.block
    grid = scale.float().reshape(-(-m // rows_per_scale), -(-n // cols_per_scale))
    for r0, r1, rows in row_pieces(m, n * item, rows_per_scale, device.type == "cuda"):
        piece = buffer((r1 - r0) * n) if device.type != "cuda" else torch.empty((r1 - r0) * n, dtype=torch.uint8)
        ckpt.read_into(info, r0 * n, tensor_bytes(piece))
        src_hash.update(tensor_bytes(piece))
        dst = output.tensor(part, r0 * n * item, (r1 - r0) * n * item, part.out.dtype, (r1 - r0, n))
        write_part(dst, piece.view(info.dtype).view(r1 - r0, n), grid[r0 // rows_per_scale: -(-r1 // rows_per_scale)],
                   name=info.name, block=(rows, cols_per_scale), device=device, threads=1)
        out_hash.update(tensor_bytes(dst))
    return "xxh3_64:" + src_hash.hexdigest(), "xxh3_64:" + out_hash.hexdigest()


def _stream_mxfp4(part: Part, output: Output, ckpt: Checkpoint, src: Source, scales: torch.Tensor,
                  device: torch.device) -> tuple[str, str]:
    """MXFP4 blocks [..., R, G, 16] decoded a matrix at a time (an expert: its blocks read whole, a quarter of
    its result's bytes), its [G*32, R] result written about CHUNK_BYTES of rows (whole groups) at a time."""
    from expertd.kernels import dequant_mxfp4, dequant_mxfp4_groups

    info = src.info
    *lead, rows, groups, width = info.shape
    matrices = math.prod(lead)
    per_matrix = rows * groups * width
    scales = scales.reshape(matrices, rows, groups)
    out_rows = groups * 32
    step = max(1, CHUNK_BYTES // max(1, 32 * rows * 2)) if device.type != "cuda" else groups
    src_hash, out_hash = xxhash.xxh3_64(), xxhash.xxh3_64()
    for e in range(matrices):
        blocks = buffer(per_matrix) if device.type != "cuda" else torch.empty(per_matrix, dtype=torch.uint8)
        ckpt.read_into(info, e * per_matrix, tensor_bytes(blocks))
        src_hash.update(tensor_bytes(blocks))
        blocks = blocks.view(rows, groups, width)
        for g0 in range(0, groups, step):
            g1 = min(groups, g0 + step)
            offset = (e * out_rows + g0 * 32) * rows * 2
            dst = output.tensor(part, offset, (g1 - g0) * 32 * rows * 2, torch.bfloat16, ((g1 - g0) * 32, rows))
            if device.type == "cuda":
                dst.copy_(dequant_mxfp4(blocks, scales[e], device=device)[g0 * 32: g1 * 32])
            else:
                dequant_mxfp4_groups(blocks, scales[e], g0, g1, dst, threads=1)
            out_hash.update(tensor_bytes(dst))
    return "xxh3_64:" + src_hash.hexdigest(), "xxh3_64:" + out_hash.hexdigest()


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

    Small FP8 parts on the CPU go through `small_parts.fill_small` together (what DeepSeek-V3's tens of thousands
    of tensors at small dims cost is Python per part, not bytes); the rest chunk by chunk."""
    results: list = [None] * len(parts)
    small = []
    native = _native(device)
    output = Output(arena, direct=device.type == "cuda" or not arena.writes)
    _reserve(parts, arena, populate=output.direct)
    for i, part in enumerate(parts):
        if part.old is not None:
            data = tensor_bytes(part.old)
            output.copy(part, data)
            results[i] = (part.digest, {}, checksum(data))
        elif native and part.src.kind == "fp8" and part.src.info.nbytes <= CHUNK_BYTES:
            small.append(i)
        else:
            results[i] = _fill_one(part, output, ckpt, device)
    if small:
        for i, result in zip(small, fill_small([parts[i] for i in small], output, ckpt)):
            results[i] = result
    output.flush()
    return results


def _reserve(parts: list[Part], arena: Arena, populate: bool) -> None:
    """Reserve the parts' ranges, one call for each run of back-to-back parts of one segment."""
    start = end = where = None
    for part in parts:
        if part.where is not where or part.offset != end:
            if where is not None:
                arena.reserve(where, start, end - start, populate)
            where, start = part.where, part.offset
        end = part.offset + part.nbytes
    if where is not None:
        arena.reserve(where, start, end - start, populate)


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
        self.window = 2 * max(1, threads) + 1
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
