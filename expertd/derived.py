"""Derived tensors: a served tensor rearranged into an engine's own layout, made once per host by the daemon.

A derivation is a gather within blocks. The served tensor [B, ...] is B blocks of n elements (one expert each,
for a stacked expert tensor); the derived tensor is B blocks of m elements, element j of every block being
element `index[j]` of the source block, or zero where `index[j] == -1`. Zero padding and any value-independent
permutation are such gathers, e.g. vLLM's CPU MoE layout: the intermediate size padded, then each expert packed
for the CPU's ISA (`cpu_prepack_moe_weight`).

The daemon makes the bytes from its own served bytes: a client can ask for a rearrangement of what is served,
never put bytes of its own into shared memory. The index travels deflated as int32 differences (a packing's
index is regular: a few kilobytes per expert shape); one request carries each distinct index once.

Client-safe: torch is imported by the functions that compute, not by this module (the daemon's control plane
imports it).
"""

from __future__ import annotations

import functools
import math
import zlib

import xxhash

from .errors import VariantRejected
from .message_types import ABSENT
from .messages import GatherItem


def encode(index) -> bytes:
    """Deflate a gather index (an int tensor of m entries in [-1, n)) as little-endian int32 differences."""
    import torch

    index = index.to(torch.int64).flatten()
    deltas = torch.empty_like(index)
    deltas[:1] = index[:1]
    deltas[1:] = index[1:] - index[:-1]
    return zlib.compress(deltas.to(torch.int32).numpy().tobytes(), 6)


def request(name: str, index_bytes: bytes, length: int, shape: tuple[int, ...], also: list[str] | None = None,
            whole: bool = False) -> GatherItem:
    """One item of a `gather` request: served tensor `name` gathered by a deflated index into `shape`, block by
    block of its first dimension; `whole`: as one block (a padded vocabulary); with `also`, the source is `name`
    and those served tensors concatenated (flat) as one block (vLLM's fused q/k/v)."""
    return GatherItem(name=name, index=index_bytes, length=int(length), shape=[int(s) for s in shape],
                      also=list(also) if also else ABSENT, blocks=1 if whole or also else ABSENT)


class Gather:
    """A gather request's item (typed and bounded by the parser) checked against the served tensor it reads
    (`source_shape`), or several concatenated as one block (the shapes of `also`): no torch, nothing inflated yet."""

    def __init__(self, item: GatherItem, source_shape: list[int], where: str, also: list[list[int]] = ()):
        name, length, shape = item.name, item.length, list(item.shape)
        self.also = tuple(item.also or ())
        blocks = 1 if self.also or item.blocks or not source_shape else source_shape[0]  # blocks: 1, nil or absent
        if math.prod(shape) != blocks * length or (blocks > 1 and shape[0] != blocks):
            raise VariantRejected(f"op 'gather': a gather of {name!r} (served as {source_shape}) must keep its "
                                  f"{blocks} block(s) of the first dimension: shape {shape} is not {blocks} blocks "
                                  f"of length {length}")
        self.name, self.length, self.shape, self.blocks = name, length, tuple(shape), blocks
        self.source_block = (math.prod(source_shape) + sum(math.prod(s) for s in also)) // blocks
        self.deflated = item.index
        self._index = None

    def raw(self) -> bytes:
        """The inflated int32 differences, exactly `length` of them (a deflate bomb stops at that size, which is at
        most twice the source block: padding never doubles a block)."""
        if self._index is None:
            if self.length > 2 * self.source_block:
                raise VariantRejected(f"op 'gather': a gather of {self.name!r} into blocks of {self.length} elements: "
                                      f"at most twice the served block's {self.source_block}")
            inflater = zlib.decompressobj()
            try:
                raw = inflater.decompress(self.deflated, 4 * self.length + 1)
            except zlib.error as exc:
                raise VariantRejected(f"op 'gather': the gather index for {self.name!r} is not deflated data "
                                      f"({exc})") from None
            if len(raw) != 4 * self.length or not inflater.eof or inflater.unconsumed_tail:
                raise VariantRejected(f"op 'gather': the gather index for {self.name!r} does not inflate to "
                                      f"{self.length} int32 differences")
            self._index = raw
        return self._index

    @functools.cached_property
    def key(self) -> str:
        """What names this derivation: the inflated index, the derived shape, the further sources and the blocks."""
        digest = xxhash.xxh3_128(self.raw())
        digest.update(repr((self.shape, self.also, self.blocks)).encode())
        return f"gather:{digest.hexdigest()}"

    def index(self):
        """The index as an int64 tensor, checked to lie in [-1, source block) (torch: the daemon's making step)."""
        import torch

        index = torch.frombuffer(bytearray(self.raw()), dtype=torch.int32).to(torch.int64).cumsum(0)
        lo, hi = int(index.min()), int(index.max())
        if lo < -1 or hi >= self.source_block:
            raise VariantRejected(f"op 'gather': the gather index for {self.name!r} holds {lo if lo < -1 else hi}, "
                                  f"outside [-1, {self.source_block}) (the served block's elements)")
        return index


def gather_into(out, source, gather: Gather, chunk_bytes: int = 64 << 20, also=()) -> None:
    """Fill `out` (the derived tensor) from `source` (the served tensor; `also`: the others, concatenated after it)
    by `gather`, a few blocks at a time."""
    import torch

    if also:
        source = torch.cat([source.reshape(-1), *(t.reshape(-1) for t in also)])
    index = gather.index()
    pad = index < 0
    take = index.clamp(min=0)
    src, dst = source.reshape(gather.blocks, -1), out.view(gather.blocks, -1)
    step = max(1, chunk_bytes // max(1, gather.length * source.element_size()))
    for b in range(0, gather.blocks, step):
        part = src[b:b + step].index_select(1, take)
        if bool(pad.any()):
            part[:, pad] = 0
        dst[b:b + step].copy_(part)
