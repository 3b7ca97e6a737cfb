"""A served tensor made of byte ranges of several segments: extents, in order.

A new generation that changes k experts of a fused expert stack writes those k experts' bytes and reuses the other
experts' ranges of the older generation's segments: its entry lists the ranges (segment, offset, nbytes) whose
concatenation is the tensor. Ranges at consecutive offsets of one segment are one extent (`merge`). A reader maps
them into one contiguous read-only view (`expertd.shm.view`): every extent but the last is a whole number of pages
and starts on a page boundary of its segment, so each maps where it belongs in one reserved range.

Client-safe: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ProtocolError


# A stack of more ranges than this is written whole again (compaction): a reader maps each range, and a long run of
# generations must not approach the kernel's limit on a process's mappings (`vm.max_map_count`). So a daemon never
# sends a tensor of more, and a reader refuses one (`from_wire`): a hostile index cannot make it map more.
MAX_EXTENTS = 64
# The most ranges a reader takes in one index, all its entries together. Each range is one mapping of the reader's
# (`vm.max_map_count`: 65,530 by default), and a per-tensor cap alone does not bound them: an index may list any
# number of tensors. Only expert stacks have ranges, two per MoE layer as the daemon serves them (gate_up_proj,
# down_proj), each at most MAX_EXTENTS: 16,384 is 256 stacks at their compaction limit all at once, twice the 116 of
# DeepSeek-V3's 58 MoE layers (7,424 ranges; the worker's whole count measured 4,838 after 16 generations,
# BENCHMARKS.md) and above Qwen3-235B's 94 layers (12,032), while one index stays within a quarter of the kernel's
# default limit (a reader holds two generations' views across a refresh). A multiple of the tensor count would not
# bound it: a hostile daemon chooses the count.
MAX_INDEX_EXTENTS = 16384


@dataclass(frozen=True)
class Extent:
    segment: str
    offset: int
    nbytes: int

    def to_wire(self) -> list:
        return [self.segment, self.offset, self.nbytes]


def merge(extents) -> list[Extent]:
    """`extents` with each run of ranges at consecutive offsets of one segment made one extent (empty ones dropped)."""
    out: list[Extent] = []
    for e in extents:
        if not e.nbytes:
            continue
        last = out[-1] if out else None
        if last is not None and last.segment == e.segment and last.offset + last.nbytes == e.offset:
            out[-1] = Extent(last.segment, last.offset, last.nbytes + e.nbytes)
        else:
            out.append(e)
    return out


def from_wire(value, name: str, nbytes: int, held: int = 0) -> list[Extent]:
    """An entry's `extents` as the index carries them ([[segment, offset, nbytes], ...]), checked before anything is
    mapped: at least two and at most MAX_EXTENTS (at most MAX_INDEX_EXTENTS with the `held` of the index's entries
    read before it), each a segment name and non-negative numbers, no two holding a byte of a segment twice, summing to
    the entry's `nbytes`."""
    if not isinstance(value, list) or len(value) < 2:
        raise ProtocolError(f"tensor index: {name}'s extents must be a list of at least two [segment, offset, nbytes]")
    if len(value) > MAX_EXTENTS:
        raise ProtocolError(f"tensor index: {name} has {len(value)} extents, more than the {MAX_EXTENTS} a daemon "
                            f"serves a tensor in (it writes a stack of more ranges whole again)")
    if held + len(value) > MAX_INDEX_EXTENTS:
        raise ProtocolError(f"tensor index: {name}'s {len(value)} extents make the index's {held + len(value)}, more "
                            f"than the {MAX_INDEX_EXTENTS} a reader maps for one index")
    out = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 3 or not isinstance(item[0], str)
                or not all(type(n) is int and n >= 0 for n in item[1:]) or not item[2]):
            raise ProtocolError(f"tensor index: {name}'s extent {item!r} is not [segment, offset, nbytes > 0]")
        out.append(Extent(item[0], item[1], item[2]))
    disjoint(out, name)
    if sum(e.nbytes for e in out) != nbytes:
        raise ProtocolError(f"tensor index: {name}'s extents hold {sum(e.nbytes for e in out)} bytes, not its {nbytes}")
    return out


def disjoint(extents: list[Extent], name: str) -> None:
    """Refuse extents of which two hold the same byte of a segment: the daemon writes each byte of a tensor once, and
    one segment's pages mapped again and again would make a view (and mappings) of any size over a few pages."""
    spans = sorted((e.segment, e.offset, e.offset + e.nbytes, k) for k, e in enumerate(extents))
    for (segment, _, end, i), (other, start, stop, j) in zip(spans, spans[1:]):  # sorted: an overlap is adjacent
        if other == segment and start < end:
            a, b = extents[min(i, j)], extents[max(i, j)]  # in the tensor's order
            raise ProtocolError(f"tensor index: {name}'s extents ({a.segment}, {a.offset}, {a.nbytes}) and "
                                f"({b.segment}, {b.offset}, {b.nbytes}) overlap: both hold bytes [{start}, "
                                f"{min(end, stop)}) of segment {segment}; no byte may lie in two extents of a tensor")


def cut(extents: list[Extent], start: int, length: int) -> list[Extent]:
    """The extents of bytes [start, start + length) of the tensor `extents` make (a per-expert view's)."""
    out, at = [], 0
    for e in extents:
        lo, hi = max(start, at), min(start + length, at + e.nbytes)
        if lo < hi:
            out.append(Extent(e.segment, e.offset + lo - at, hi - lo))
        at += e.nbytes
    return out


def extents_of(entry) -> list[Extent]:
    """Where an index entry's bytes lie, in order: its extents, or its one range."""
    return list(entry.extents) if entry.extents else [Extent(entry.segment, entry.offset, entry.nbytes)]


def split(extents: list[Extent], parts: int) -> list[list[Extent]]:
    """`cut` of each of `parts` equal parts of the tensor `extents` make, in one pass over the extents (a stack's
    experts: a cut each would cost experts x extents)."""
    chunk = sum(e.nbytes for e in extents) // max(parts, 1)
    out, i, at = [], 0, 0  # extent i, `at` bytes into it
    for _ in range(parts):
        pieces, need = [], chunk
        while need:
            e = extents[i]
            take = min(e.nbytes - at, need)
            pieces.append(Extent(e.segment, e.offset + at, take))
            need, at = need - take, at + take
            if at == e.nbytes:
                i, at = i + 1, 0
        out.append(pieces)
    return out


def replaced(extents: list[Extent], parts: int, changed: list[int], segment: str, offset: int) -> list[Extent]:
    """The ranges of a tensor of `parts` equal parts lying in `extents`, with parts `changed` (in order) replaced by
    ranges back to back in `segment` from `offset`, merged."""
    chunk = sum(e.nbytes for e in extents) // parts
    pieces, at = [], 0
    for slot, k in sorted(enumerate(changed), key=lambda item: item[1]):  # cut only around the changed parts
        pieces += cut(extents, at, k * chunk - at) + [Extent(segment, offset + slot * chunk, chunk)]
        at = (k + 1) * chunk
    return merge(pieces + cut(extents, at, parts * chunk - at))


def reach(entries) -> dict[str, int]:
    """Each segment the entries' bytes lie in, and how far into it they reach (what must be mapped of it)."""
    out: dict[str, int] = {}
    for x in (x for e in entries for x in extents_of(e)):
        out[x.segment] = max(out.get(x.segment, 0), x.offset + x.nbytes)
    return out


def overlap(extents, others) -> int:
    """How many bytes of `extents` also lie in `others` (ranges of the same segments; each byte counted once)."""
    by_segment: dict[str, list[tuple[int, int]]] = {}
    for o in others:
        by_segment.setdefault(o.segment, []).append((o.offset, o.offset + o.nbytes))
    runs: dict[str, list[tuple[int, int]]] = {}
    for segment, spans in by_segment.items():  # merged, so a byte in several of `others` counts once
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        runs[segment] = merged
    total = 0
    for e in extents:
        for start, end in runs.get(e.segment, ()):
            total += max(0, min(end, e.offset + e.nbytes) - max(start, e.offset))
    return total


def mappable(extents: list[Extent], unit: int) -> bool:
    """Whether the extents map into one contiguous range with pages of `unit` bytes: every extent starts on a page of
    its segment, and every one but the last is whole pages."""
    return all(e.offset % unit == 0 for e in extents) and all(e.nbytes % unit == 0 for e in extents[:-1])


def position(extents: list[Extent], segment: str, offset: int) -> int:
    """Where byte `offset` of `segment` lies in the tensor `extents` make (a view's start within its base)."""
    at = 0
    for e in extents:
        if e.segment == segment and e.offset <= offset < e.offset + e.nbytes:
            return at + offset - e.offset
        at += e.nbytes
    raise ProtocolError(f"tensor index: ({segment}, {offset}) lies in none of the tensor's ranges")
