"""A task's parts filled by one compiled call (`kernels/fill_batch.c`): Python plans, the thread then reads,
dequantizes, hashes and writes every part of the task without the GIL.

What the loader's threads must not do at many cores is take turns on the GIL: a 16-core host loaded slower with
16 threads than with 4 while Python read, dequantized, hashed and wrote each MiB in calls of its own, and still
stopped at ~4 GB/s while each part's scales went through torch ops. Here Python's work is per task (a few MiB of
parts): one row of plain integers per part. The compiled call reads each FP8 part's scales, hashes and checks
them and makes its table of block results (float32 product, torch's bf16 rounding and NaN bits), then reads,
dequantizes, hashes and writes the part; stored (plain) parts are read, hashed and written. `filling.fill` hands
parts here on the CPU where the compiled library and the xxhash library's functions are; `gpu_parts` uses the
same call for its reading and writing; MXFP4 keeps its own way.
"""

from __future__ import annotations

import os
from array import array
from itertools import chain

import torch
from expertd.kernels import native

from expertd.errors import ScaleError, ShardFormatError
from expertd.formats.scaled_fp8 import ScaledFp8
from expertd.index import checksum_text

from ..shm.arena import Arena
from .checkpoint import Checkpoint
from .layout import check_scale_values
from .parts import CHUNK_BYTES, HASH_BYTES, Output, Part, buffer_at, part_digest

# A part whose result is at most this is filled by small_parts with others like it (a span read for all of them:
# DeepSeek-V3's counts at small dims); larger parts come here, their per-part cost a small share of their bytes.
SMALL_RESULT = HASH_BYTES


def usable(device: torch.device) -> bool:
    """Whether parts can be filled here: on the CPU, where the compiled library and XXH3's streaming functions are."""
    return device.type == "cpu" and native.can_fill_batch()


def copy_row(src_fd: int, src_at: int, nbytes: int, dst_fd: int, dst_at: int) -> tuple:
    """A descriptor row of stored bytes copied, hashed once: from a file (or from memory, `src_fd` -1) to a file (or
    to memory, `dst_fd` -1)."""
    return native.FILL_COPY, src_fd, src_at, nbytes, 1, dst_fd, dst_at, -1, 0, 1, 1, 0, 0, 0


def scale_count(src) -> int | None:
    """How many scales an FP8 source's blocks have, where its scale tensor holds exactly those in a dtype the compiled
    table is made from (float32, bf16, fp16); else None."""
    m, n = src.info.shape
    count = -(-m // src.block[0]) * -(-n // src.block[1])
    dtype = src.scale.dtype
    return count if dtype in native.FILL_SCALE_DTYPES and src.scale.nbytes == count * dtype.itemsize else None


def takes(part: Part) -> bool:
    """Whether `part` is filled here: stored bytes, or FP8 made bf16 (the 16-bit table), of more than SMALL_RESULT."""
    codec = part.src.codec
    if codec is None:
        return True
    return (isinstance(codec, ScaledFp8) and part.block.dtype == torch.bfloat16 and part.nbytes > SMALL_RESULT
            and scale_count(part.src) is not None)


def results(parts: list[Part], ckpt: Checkpoint, hashes, scale_digests: list) -> list:
    """Per part (source digest, identities learned, checksum of the written bytes) from its XXH3 values (`hashes`:
    3 per part, source, result, scales), as `filling.fill` gives them."""
    out = []
    for k, (part, scale_digest) in enumerate(zip(parts, scale_digests)):
        digest = checksum_text(hashes[3 * k])
        ids = {ckpt.identity(part.src.info): digest}
        if part.src.scale is not None:
            ids[ckpt.identity(part.src.scale)] = scale_digest
        out.append((part_digest(digest, scale_digest), ids, checksum_text(hashes[3 * k + 1])))
    return out


def destination(part: Part, output: Output, arena: Arena) -> tuple[int, int]:
    """(fd, offset in its file) where `part`'s result goes, or (-1, address) where the output writes through the
    daemon's mapping."""
    if output.direct:
        return -1, part.out.data_ptr()
    return arena.fd(part.where), part.where.offset + part.offset


def check(done: int, parts: list[Part], table, arena: Arena, ckpt: Checkpoint) -> None:
    """Raise for the part a compiled call stopped at (`done` < all; `table` its descriptor rows): its shard and tensor
    named, or its segment."""
    if done >= len(parts):
        return
    part, row = parts[done], table[native.FILL_FIELDS * done: native.FILL_FIELDS * (done + 1)]
    what, code, info = row[12], row[13], part.src.info
    if what == native.FILL_ERR_SCALE:
        check_scale_values(ckpt, part.src.scale)  # names the tensor and what is wrong
        raise ScaleError(f"scale {code} is not finite and positive", file=part.src.scale.file,
                         tensor=part.src.scale.name)
    if what in (native.FILL_ERR_SHORT, native.FILL_ERR_READ) and code == native.FILL_SCALE_FILE:
        info = part.src.scale
        raise ShardFormatError(f"cannot read its {info.nbytes} bytes (truncated since opened?)", file=info.file,
                               tensor=info.name)
    if what == native.FILL_ERR_SHORT:
        raise ShardFormatError(f"data ends before its {info.nbytes} bytes (truncated since opened?)",
                               file=info.file, tensor=info.name)
    if what == native.FILL_ERR_READ:
        raise ShardFormatError(f"cannot read shard: {os.strerror(code)}", file=info.file, tensor=info.name)
    raise arena.write_error(part.where, part.offset, part.nbytes, code)


def fill_native(parts: list[Part], output: Output, ckpt: Checkpoint, arena: Arena) -> list[tuple[str, dict, str]]:
    """Fill `parts` (each `takes`) in one compiled call, scales read, checked and made tables there too; per part
    (source digest, identities learned, checksum of the written bytes), as `filling.fill` gives them."""
    output.flush()  # nothing of the output's buffer may be pending: the compiled loop writes through it
    desc, longest, most, nbytes = [], CHUNK_BYTES, 1, 0
    for part in parts:
        info, src = part.src.info, part.src
        dst_fd, dst_at = destination(part, output, arena)
        if src.scale is None:
            desc.append(copy_row(ckpt.fd(info), info.offset, info.nbytes, dst_fd, dst_at))
        else:
            m, n = info.shape
            longest, most = max(longest, 2 * n), max(most, scale_count(src))
            scale = src.scale
            desc.append((native.FILL_LUT16, ckpt.fd(info), info.offset, m, n, dst_fd, dst_at, ckpt.fd(scale),
                         scale.offset, *src.block, native.FILL_SCALE_DTYPES[scale.dtype], 0, 0))
            nbytes += scale.nbytes
        nbytes += info.nbytes
    table = array("q", chain.from_iterable(desc))
    hashes = array("Q", bytes(24 * len(parts)))
    done = native.fill_batch(table, buffer_at(longest, "read"), buffer_at(longest, "out"),
                             buffer_at(8 * most, "scales"), buffer_at(512 * most, "table"), CHUNK_BYTES, hashes)
    check(done, parts, table, arena, ckpt)
    ckpt.counted(nbytes)
    scale_digests = [checksum_text(hashes[3 * k + 2]) if p.src.scale is not None else None
                     for k, p in enumerate(parts)]
    return results(parts, ckpt, hashes, scale_digests)
