"""One part made in place by its format's dequant entry points, or its stored bytes copied: the loader's side of
dequantizing — reading the source, placing and hashing the result.

The format (`Source.codec`, a class of `expertd.formats`) says how its bytes become the served ones; this module
says where they come from and go: whole (`write_part`) or a piece at a time (`stream_part`, the format's `stream`
handed this part's `PartPieces`). A source with no codec is stored bytes served as they are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import xxhash

from expertd.formats.codec import Codec
from expertd.index import tensor_bytes

from .checkpoint import Checkpoint
from .layout import Source
from .parts import BATCH_BYTES, CHUNK_BYTES, Output, Part, buffer, memory_at


def write_part(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, *, codec: Codec | None, name: str,
               block: tuple[int, int] | None, device: torch.device, threads: int | None = None) -> None:
    """One source part into its place: dequantized by its format (`codec`), bit-exact to the format's definition;
    stored bytes (no codec) copied."""
    if codec is None:
        out.copy_(data.view(out.shape))
        return
    codec.dequant(out, data, scale, name=name, block=block, device=device, threads=threads)


class PartPieces:
    """One part's source read and its result placed a piece at a time, each hashed while it is in cache: what its
    format's `stream` is handed (`expertd.formats.codec.Pieces`)."""

    def __init__(self, part: Part, output: Output, ckpt: Checkpoint, src: Source, device: torch.device):
        self.part, self.output, self.ckpt, self.info, self.device = part, output, ckpt, src.info, device
        self.chunk, self.most = CHUNK_BYTES, BATCH_BYTES
        self.src_hash, self.out_hash = xxhash.xxh3_64(), xxhash.xxh3_64()

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        piece = buffer(nbytes) if self.device.type != "cuda" else torch.empty(nbytes, dtype=torch.uint8)
        self.ckpt.read_into(self.info, offset, tensor_bytes(piece))
        self.src_hash.update(tensor_bytes(piece))
        return piece

    @contextmanager
    def place(self, offset: int, nbytes: int, dtype: torch.dtype, shape):
        dst = self.output.tensor(self.part, offset, nbytes, dtype, shape)
        yield dst
        self.out_hash.update(tensor_bytes(dst))

    def digests(self) -> tuple[str, str]:
        return "xxh3_64:" + self.src_hash.hexdigest(), "xxh3_64:" + self.out_hash.hexdigest()


def stream_part(part: Part, output: Output, ckpt: Checkpoint, src: Source, scale: torch.Tensor | None, *,
                device: torch.device) -> tuple[str, str]:
    """Write one part chunk by chunk: read (`preadv`), hash the source chunk, dequantize or copy it,
    hash the result while it is in cache: (checksum of the source bytes, checksum of the written bytes)."""
    if src.codec is None:
        return _copy(part, output, ckpt, src)
    pieces = PartPieces(part, output, ckpt, src, device)
    src.codec.stream(pieces, scale, name=src.info.name, shape=src.info.shape, block=src.block,
                     dtype=part.block.dtype, device=device)
    return pieces.digests()


def _copy(part: Part, output: Output, ckpt: Checkpoint, src: Source) -> tuple[str, str]:
    """Stored bytes read straight into place; source and result are the same bytes, hashed once."""
    info, src_hash = src.info, xxhash.xxh3_64()
    for b0 in range(0, info.nbytes, CHUNK_BYTES):
        nbytes = min(CHUNK_BYTES, info.nbytes - b0)
        into = memory_at(output.at(part, b0, nbytes), nbytes)
        ckpt.read_into(info, b0, into)
        src_hash.update(into)
    digest = "xxh3_64:" + src_hash.hexdigest()
    return digest, digest
