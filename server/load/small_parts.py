"""Small FP8 parts filled together: what DeepSeek-V3's tens of thousands of expert tensors at small dims cost is
Python per part, not bytes. Their sources are read a span at a time, their scales copied into one buffer and
made one table of block results by their format's batched entry point (`ScaledFp8.batch`), and the parts that fit
in L2 filled from it in one compiled call (gather and both hashes, without the GIL); `filling.fill` hands them
here."""

from __future__ import annotations

import array
import ctypes
import itertools

import numpy as np
import torch
import xxhash

from expertd.index import checksum, checksum_text, tensor_bytes

from .checkpoint import Checkpoint
from .layout import check_scale_values
from .parts import HASH_BYTES, Output, Part, memory_at, part_digest


class SpanReader:
    """The bytes of many small tensors, read when it is made and kept until it is dropped: where they lie
    close together in one shard (DeepSeek-V3's experts at small dims, weight and scale side by side), the
    span around them is read with one `preadv`; a tensor outside such a span is read alone."""

    SPREAD = 2  # read a span when it is at most this many times the bytes wanted from it, or at most
    PER_TENSOR = 16 << 10  # this many bytes per tensor wanted (copying them costs less than a call each)...
    SMALL = 64 << 10  # ...and its tensors are this small on average (larger ones cost bytes, not calls)

    def __init__(self, ckpt: Checkpoint, infos: list):
        self.at: dict[tuple[str, int], int] = {}  # (file, offset) -> address of the tensor's bytes
        self.buffers = []
        by_file: dict[str, list] = {}
        for info in infos:
            by_file.setdefault(info.file, []).append(info)
        alone = []
        for file, group in by_file.items():
            start = min(i.offset for i in group)
            end = max(i.offset + i.nbytes for i in group)
            wanted = sum(i.nbytes for i in group)
            if (len(group) > 1 and wanted <= self.SMALL * len(group)
                    and end - start <= max(self.SPREAD * wanted, self.PER_TENSOR * len(group))):
                base = self._read(ckpt, group[0], start - group[0].offset, end - start)  # relative to one tensor
                self.at.update(((file, i.offset), base + i.offset - start) for i in group)
            else:
                alone += group
        if alone:
            base = self._read(None, None, 0, sum(i.nbytes for i in alone))
            for info in alone:
                ckpt.read_into(info, 0, memory_at(base, info.nbytes))
                self.at[info.file, info.offset] = base
                base += info.nbytes

    def _read(self, ckpt, info, offset: int, nbytes: int) -> int:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buf)
        if ckpt is not None:
            ckpt.read_into(info, offset, tensor_bytes(buf))
        return buf.data_ptr()

    def address(self, info) -> int:
        return self.at[info.file, info.offset]

    def bytes(self, info) -> memoryview:
        return memory_at(self.at[info.file, info.offset], info.nbytes)


def int64_rows(rows: list) -> torch.Tensor:
    """Rows of equally many ints as an int64 tensor [rows, columns], made in C (`torch.tensor` of nested lists
    costs ~60 us a table: a batch of small parts makes two)."""
    flat = array.array("q", itertools.chain.from_iterable(rows))
    if not rows:
        return torch.empty(0, 0, dtype=torch.int64)
    return torch.frombuffer(flat, dtype=torch.int64).view(len(rows), -1)


def fill_small(parts: list[Part], output: Output, ckpt: Checkpoint) -> list[tuple[str, dict, str]]:
    """Small FP8 parts at once: every source read into a few buffers, every scale copied into one, one table
    of block results for all of them (their format's batched entry point); then the parts that fit in L2 in one
    compiled call (gather and both hashes, without the GIL), each larger one piece by piece."""
    from expertd.kernels import native

    scale_dtype = parts[0].src.scale.dtype
    if any(p.src.scale.dtype != scale_dtype for p in parts):  # mixed scale dtypes: one kind of table at a time
        return [r for p in parts for r in fill_small([p], output, ckpt)]
    sizes = [p.src.scale.nbytes for p in parts]
    source = SpanReader(ckpt, [info for p in parts for info in (p.src.info, p.src.scale)])
    scale_buf = torch.empty(sum(sizes), dtype=torch.uint8)
    base, ends = scale_buf.data_ptr(), list(itertools.accumulate(sizes))
    desc = int64_rows([(source.address(p.src.scale), base + end - size, size)
                       for p, size, end in zip(parts, sizes, ends)])
    hashes = torch.empty(len(parts), dtype=torch.int64)
    if native.copy_hash(desc, hashes):
        scale_digests = [checksum_text(h) for h in hashes.view(torch.uint64).tolist()]
    else:
        scale_digests = []
        for src_at, dst_at, size in desc.tolist():
            ctypes.memmove(dst_at, src_at, size)
            scale_digests.append(checksum(memory_at(dst_at, size)))
    scales = scale_buf.view(scale_dtype).float()
    values = scales.numpy()  # numpy's checks on a few hundred values cost ~1 us each, torch's ~8
    bad = ~((values > 0) & (values < np.inf))  # NaN fails both, -inf and 0 the first
    if bool(bad.any()):  # name the first part with a bad scale, as planning would
        bad_at, at = int(np.flatnonzero(bad)[0]), 0
        for p, size in zip(parts, sizes):
            at += size // scale_dtype.itemsize
            if bad_at < at:
                check_scale_values(ckpt, p.src.scale)
    table = parts[0].src.codec.batch(scales, torch.bfloat16)  # one checkpoint, one format
    digests: list = [None] * len(parts)  # (source checksum, result checksum) per part
    pending: list[tuple[int, list[int]]] = []  # parts whose results wait in the output buffer for `run`

    def run() -> None:
        """Fill the pending parts (before their bytes leave the output buffer)."""
        if not pending:
            return
        desc = int64_rows([d for _, d in pending])
        hashes = torch.empty(len(pending), 2, dtype=torch.int64)
        if table.parts(desc, hashes):
            for (i, _), (h_in, h_out) in zip(pending, hashes.view(torch.uint64).tolist()):
                digests[i] = (checksum_text(h_in), checksum_text(h_out))
        else:
            for i, (x, y, m, n, first_block, rows, cols) in pending:
                table.rows(x, y, n, (rows, cols), first_block, 0, m)
                digests[i] = (checksum(memory_at(x, m * n)), checksum(memory_at(y, 2 * m * n)))
        pending.clear()

    output.before_flush = run
    try:
        first = 0  # the part's first table row
        for i, p in enumerate(parts):
            info = p.src.info
            m, n = info.shape
            weight_ptr = source.address(info)
            if p.nbytes <= HASH_BYTES:
                pending.append((i, [weight_ptr, output.at(p, 0, p.nbytes), m, n, first, *p.src.block]))
            else:
                out_hash, rows = xxhash.xxh3_64(), max(1, HASH_BYTES // max(1, 2 * n))
                for r0 in range(0, m, rows):  # each piece hashed while it is in L2
                    r1 = min(m, r0 + rows)
                    out_ptr = output.at(p, r0 * n * 2, (r1 - r0) * n * 2)
                    table.rows(weight_ptr, out_ptr - r0 * n * 2, n, p.src.block, first, r0, r1)
                    out_hash.update(memory_at(out_ptr, (r1 - r0) * n * 2))
                digests[i] = (checksum(source.bytes(info)), "xxh3_64:" + out_hash.hexdigest())
            first += sizes[i] // scale_dtype.itemsize
        run()
    finally:
        output.before_flush = None
    results = []
    for p, (digest, out_digest), scale_digest in zip(parts, digests, scale_digests):
        results.append((part_digest(digest, scale_digest),
                        {ckpt.identity(p.src.info): digest, ckpt.identity(p.src.scale): scale_digest}, out_digest))
    return results
