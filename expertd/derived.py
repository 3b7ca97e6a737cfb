"""Derived tensors: a served tensor rearranged into an engine's own layout, made once per host by the daemon.

A derivation is a gather within blocks. The served tensor [B, ...] is B blocks of n elements (one expert each,
for a stacked expert tensor); the derived tensor is B blocks of m elements, element j of every block being
element `index[j]` of the source block, or zero where `index[j] == -1`. Zero padding and any value-independent
permutation are such gathers, e.g. vLLM's CPU MoE layout: the intermediate size padded, then each expert packed
for the CPU's ISA (`cpu_prepack_moe_weight`).

The daemon makes the bytes from its own served bytes: a client can ask for a rearrangement of what is served,
never put bytes of its own into shared memory. The index travels deflated as int32 differences (a packing's
index is regular: a few kilobytes per expert shape); one request carries each distinct index once.

A derivation is named by a cryptographic digest of its whole canonical request (`key`): its kind, dtype, the
sources' identity (name, dtype, shape and the checksum of their served bytes, as the index carries it), the derived
shape, the blocks and the inflated index, the latter by its own digest (`index_digest`: a model's layers of one kind
share one index, hashed once however many layers ask, and an index is one block's elements: 59 MiB for one of
DeepSeek-V3's experts). Nobody can store other bytes under a name: a name is the digest of what it names, and a
client recomputes it from its own request and index (`client/derived_tensors.py`).

The index is inflated, checked and gathered in chunks of CHUNK entries (`chunks`, `gather_into`): the daemon's
memory beyond the derived bytes stays a few MiB whatever the index's length or the number of sources.

Client-safe: torch is imported by the functions that compute, not by this module (the daemon's control plane
imports it).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import zlib

from .errors import DerivedRejected
from .message_types import ABSENT
from .messages import GatherItem

CHUNK = 1 << 16  # index entries inflated, checked and gathered at a time (256 KiB of int32 differences)
KEY_PREFIX = "blake2b:"
GATHER_VERSION = 2  # "v" of a gather's canonical request: its index as `index_digest`


def source_identity(entry) -> list:
    """What a derivation says of one source (an index entry): name, dtype, shape and its served bytes' checksum."""
    return [entry.name, entry.dtype, [int(s) for s in entry.shape], entry.checksum or ""]


def key(header: dict) -> str:
    """The name of a derivation: BLAKE2b-256 of its canonical header (sorted compact JSON, which holds no NUL)."""
    return KEY_PREFIX + _digest(header).hexdigest()


def index_digest(chunks) -> str:
    """BLAKE2b-256 (personalization `expertd.index`) of an inflated index's bytes (its int32 differences), in hex."""
    digest = _index_hasher()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _index_hasher():
    return hashlib.blake2b(digest_size=32, person=b"expertd.index")


def _digest(header: dict):
    digest = hashlib.blake2b(digest_size=32, person=b"expertd.derive")
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    digest.update(b"\0")
    return digest


def cast_key(source, dtype: str) -> str:
    """The name of served tensor `source` (an index entry) cast to `dtype`."""
    return key({"kind": "cast", "v": 1, "dtype": dtype, "sources": [source_identity(source)]})


def encode(index) -> bytes:
    """Deflate a gather index (an int tensor of m entries in [-1, n)) as little-endian int32 differences."""
    import torch

    index = index.to(torch.int64).flatten()
    deltas = torch.empty_like(index)
    deltas[:1] = index[:1]
    deltas[1:] = index[1:] - index[:-1]
    raw = deltas.to(torch.int32).numpy().tobytes()
    fast = zlib.compress(raw, 1)  # an engine's layout repeats its differences: level 1 is small and twice as fast
    return fast if len(fast) <= 64 << 10 else zlib.compress(raw, 6)


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
            raise DerivedRejected(f"op 'gather': a gather of {name!r} (served as {source_shape}) must keep its "
                                  f"{blocks} block(s) of the first dimension: shape {shape} is not {blocks} blocks "
                                  f"of length {length}")
        self.name, self.length, self.shape, self.blocks = name, length, tuple(shape), blocks
        self.source_block = (math.prod(source_shape) + sum(math.prod(s) for s in also)) // blocks
        self.deflated = item.index
        self.form = None  # (sizes, strides, offset) where the checked index is a strided view (`checked_key`)
        self.digest: str | None = None  # the inflated index's `index_digest`, once computed

    def differences(self, chunk: int = CHUNK):
        """The inflated int32 differences, `chunk` at a time (bytes of 4 * chunk at most), exactly `length` of them:
        a deflate bomb stops at that size, one short or over is refused."""
        if self.length > 2 * self.source_block:
            raise DerivedRejected(f"op 'gather': a gather of {self.name!r} into blocks of {self.length} elements: "
                                  f"at most twice the served block's {self.source_block}")
        inflater, data, left, carry = zlib.decompressobj(), self.deflated, 4 * self.length, b""
        try:
            while left:
                raw = inflater.decompress(data, min(left, 4 * chunk))
                data = inflater.unconsumed_tail
                if not raw:
                    break
                left -= len(raw)
                raw, cut = carry + raw, (len(carry) + len(raw)) // 4 * 4
                carry = raw[cut:]
                yield raw[:cut]
            more = inflater.decompress(data, 1) if not inflater.eof else b""
        except zlib.error as exc:
            raise DerivedRejected(f"op 'gather': the gather index for {self.name!r} is not deflated data "
                                  f"({exc})") from None
        if left or more or not inflater.eof or inflater.unconsumed_tail:
            raise DerivedRejected(f"op 'gather': the gather index for {self.name!r} does not inflate to "
                                  f"{self.length} int32 differences")

    def index_key(self) -> tuple:
        """What decides the inflated index and its checks: its bytes as sent, its length and the source block."""
        return self.deflated, self.length, self.source_block

    def request_header(self, sources: list) -> dict:
        """The canonical request but for its index (`sources`: the index entries of `name`, then of `also`)."""
        return {"kind": "gather", "v": GATHER_VERSION, "dtype": sources[0].dtype,
                "sources": [source_identity(e) for e in sources], "shape": list(self.shape), "blocks": self.blocks,
                "length": self.length}

    def header(self, sources: list, digest: str) -> dict:
        """The canonical request this gather is: `request_header` and its index's `index_digest`."""
        return {**self.request_header(sources), "index": digest}

    def index_digest(self) -> str:
        """The inflated index's digest (inflating it once, chunk by chunk; kept: items alike share it)."""
        if self.digest is None:
            self.digest = index_digest(self.differences())
        return self.digest

    def key(self, sources: list) -> str:
        """This derivation's name (no torch)."""
        return key(self.header(sources, self.index_digest()))

    def chunks(self, check: bool = False, digest=None):
        """(start, int64 tensor of entries) for each chunk of the index; with `check`, every entry checked to lie in
        [-1, source block) (entry by entry: a running sum cannot wrap past a check); `digest` is fed the raw bytes."""
        import torch

        at, carry = 0, 0
        for raw in self.differences():
            if digest is not None:
                digest.update(raw)
            index = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64).cumsum(0).add_(carry)
            if check:
                lo, hi = int(index.min()), int(index.max())
                if lo < -1 or hi >= self.source_block:
                    raise DerivedRejected(f"op 'gather': the gather index for {self.name!r} holds "
                                          f"{lo if lo < -1 else hi}, outside [-1, {self.source_block}) (the served "
                                          f"block's elements)")
            carry = int(index[-1])
            yield at, index
            at += index.numel()

    def checked_key(self, sources: list) -> str:
        """Check every entry of the index (chunk by chunk) and return the name: the one pass before anything is made
        (which also finds whether the index is a strided view of its source block: `strided`)."""
        from .strided import Strides

        digest, form = _index_hasher(), Strides(self.length)
        for at, index in self.chunks(check=True, digest=digest):
            form.feed(at, index)
        self.form = form.form() if len(sources) == 1 else None
        self.digest = digest.hexdigest()
        return self.key(sources)


def gather_into(out, sources: list, gather: Gather, should_stop=None) -> None:
    """Fill `out` (the derived tensor) from `sources` (the served tensors: the first, then `also`, read where they
    lie, never concatenated) by `gather`, one index chunk at a time; `should_stop()` is asked between chunks."""
    import torch

    if gather.form is not None and len(sources) == 1:  # proven entry by entry when the index was checked
        from .strided import copy_strided

        copy_strided(out, sources[0], gather.blocks, gather.form, should_stop)
        return
    m, flat = gather.length, out.view(-1)
    if gather.blocks > 1:
        pieces, starts = [sources[0].reshape(gather.blocks, -1)], [0]
    else:
        pieces = [s.reshape(-1) for s in sources]
        starts = [0]
        for p in pieces[:-1]:
            starts.append(starts[-1] + p.numel())
    for at, index in gather.chunks():
        if should_stop is not None and should_stop():
            raise InterruptedError("the daemon is stopping")
        pad = index < 0
        take = index.clamp_(min=0)
        padded = bool(pad.any())
        for b in range(gather.blocks):
            dst = flat[b * m + at: b * m + at + take.numel()]
            if gather.blocks > 1:
                torch.index_select(pieces[0][b], 0, take, out=dst)
            else:
                _from_pieces(dst, pieces, starts, take)
            if padded:
                dst.masked_fill_(pad, 0)


def _from_pieces(dst, pieces: list, starts: list[int], take) -> None:
    """dst[j] = the concatenation of `pieces` (starting at `starts`) at take[j], reading each piece where it lies."""
    import torch

    lo, hi = int(take.min()), int(take.max())
    k = bisect.bisect_right(starts, lo) - 1
    if hi < starts[k] + pieces[k].numel():  # the chunk reads one piece (a regular index: the usual case)
        torch.index_select(pieces[k], 0, take - starts[k], out=dst)
        return
    which = torch.bucketize(take, torch.tensor(starts[1:], dtype=torch.int64), right=True)
    order = torch.argsort(which, stable=True)
    at = 0
    for k, count in enumerate(torch.bincount(which, minlength=len(pieces)).tolist()):
        if count:
            sel = order[at:at + count]
            dst[sel] = pieces[k][take[sel] - starts[k]]
            at += count
