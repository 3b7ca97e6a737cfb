"""Variants: a served tensor cast to the dtype another transformers release loads it as, or rearranged into an
engine's layout (`expertd.derived`), made once per host.

The daemon serves every tensor in the dtype its own transformers loads it as (`expertd.hf_dtypes`). A worker
on another release may want another dtype for a few tensors (transformers 5.24 keeps DeepSeek-V3's routers in
float32, 5.23 and 4.57 in bf16). Rather than every such worker making a private copy, it asks the daemon
(`cast`), which casts the served bytes once into a segment of their own (`/{namespace}.{pid}.v{N}.{k}`,
owner and mode as any segment), checksums them and hands out the entry; every later worker maps the same
bytes. A variant belongs to the generation it was asked in: it lives while that generation does (a lease
on it keeps both), is listed in `status`, and is unlinked when the generation retires. A newer generation
whose served tensor is the same bytes (same segment and offset) reuses the variant instead of casting again.

A derived variant (`gather`: vLLM's packed experts) is named by its index and shape instead of a dtype. The
derived bytes of a generation may total at most its served bytes: a reader cannot fill the host's memory.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from expertd.derived import Gather
from expertd.errors import VariantRejected
from expertd.index import TensorEntry, tensor_checksum
from expertd.messages import VARIANT_DTYPES, CastItem, GatherItem

from .arena import Arena

log = logging.getLogger("expertd.variants")


def same_bytes(entry: TensorEntry) -> tuple:
    """What a cast is made from: the same bytes wherever these five agree (a newer generation's unchanged tensor)."""
    return entry.segment, entry.offset, entry.nbytes, entry.dtype, entry.checksum


@dataclass
class Variant:
    """A served tensor (`of`, an entry of its generation's index) cast into `entry`."""

    of: TensorEntry
    entry: TensorEntry
    key: str = ""  # "" for a dtype cast; the derivation's name (`Gather.key`) for a derived tensor
    also: tuple = ()  # a derived tensor's further sources (entries of the same generation), after `of`

    def made_of(self) -> tuple:
        """What it is made from: the same bytes wherever these agree (a newer generation's unchanged tensors)."""
        return tuple(same_bytes(e) for e in (self.of, *self.also))

    def to_wire(self) -> dict:
        e = self.entry
        return {"name": e.name, "dtype": e.dtype, "segment": e.segment, "offset": e.offset, "nbytes": e.nbytes,
                "shape": list(e.shape), "checksum": e.checksum, "served_dtype": self.of.dtype,
                **({"derivation": self.key} if self.key else {})}

    def status(self) -> dict:
        return {"name": self.entry.name, "dtype": self.entry.dtype, "served_dtype": self.of.dtype,
                "nbytes": self.entry.nbytes, "segment": self.entry.segment,
                **({"derivation": self.key, "shape": list(self.entry.shape)} if self.key else {})}


def _casts(items: list[CastItem], served: dict[str, TensorEntry], generation: int) -> list[tuple]:
    """The requested (served entry, dtype, None) triples, checked: every name served and a float tensor (the parser
    has checked each dtype is a float type)."""
    out = []
    for item in items:
        entry = served.get(item.name)
        if entry is None:
            raise VariantRejected(f"no tensor {item.name[:200]!r} in generation {generation}: a variant of it in "
                                  f"{item.dtype!r} cannot be made (variants are asked by served name)")
        if entry.dtype not in VARIANT_DTYPES:
            raise VariantRejected(f"{item.name!r} is served as {entry.dtype}: only float tensors have dtype variants "
                                  f"({item.dtype!r} asked)")
        out.append((entry, item.dtype, None))
    return out


def _gathers(items: list[GatherItem], served: dict[str, TensorEntry], generation: int, limit: int) -> list[tuple]:
    """The requested (served entry, key, (Gather, further sources)) triples, checked whole before anything is made:
    every source served and of one dtype, each gather well-formed for its sources' shapes and no larger than
    `limit` bytes (checked before its index is inflated)."""
    out = []
    for i, item in enumerate(items):
        entry = served.get(item.name)
        if entry is None:
            raise VariantRejected(f"no tensor {item.name[:200]!r} in generation {generation}: a derived layout of it "
                                  f"cannot be made (derived tensors are asked by served name)")
        more = _also(item, served, entry, generation)
        gather = Gather(item, list(entry.shape), f"tensors[{i}]", [list(e.shape) for e in more])
        if _size(gather, entry) > limit:
            raise VariantRejected(f"generation {generation}: deriving {item.name!r} in shape {list(gather.shape)} "
                                  f"takes {_size(gather, entry)} bytes, more than its {limit} served bytes (the "
                                  f"most a generation derives)")
        out.append((entry, gather.key, (gather, more)))
    return out


def _also(item: GatherItem, served: dict[str, TensorEntry], entry: TensorEntry, generation: int) -> list[TensorEntry]:
    """The further sources of a gather (`also`), served and of the first one's dtype."""
    out = []
    for other in item.also or ():
        found = served.get(other)
        if found is None or found.dtype != entry.dtype:
            raise VariantRejected(f"the gather of {item.name!r} in generation {generation}: {other[:200]!r} is "
                                  f"{'not served' if found is None else f'served as {found.dtype}'}; a gather's "
                                  f"sources are served tensors of one dtype ({entry.dtype})")
        out.append(found)
    return out


def _size(gather: Gather, entry: TensorEntry) -> int:
    return math.prod(gather.shape) * entry.nbytes // max(1, math.prod(entry.shape))


def _what(variant: Variant) -> str:
    return variant.key or variant.entry.dtype


def cast(gen, others, items: list[CastItem], group: str | None = None) -> list[Variant]:
    """The dtype casts `items` asks of generation `gen` (see `_make_all`)."""
    served = {t.name: t for t in gen.index.tensors}
    return _make_all(gen, others, _casts(items, served, gen.number), group)


def gather(gen, others, items: list[GatherItem], group: str | None = None) -> list[Variant]:
    """The gathers `items` asks of generation `gen` (see `_make_all`)."""
    served = {t.name: t for t in gen.index.tensors}
    return _make_all(gen, others, _gathers(items, served, gen.number, sum(t.nbytes for t in gen.index.tensors)), group)


def _make_all(gen, others, asked: list[tuple], group: str | None) -> list[Variant]:
    """The variants `asked` names of generation `gen`: those it has, those another live generation (`others`)
    made of the same bytes, and the rest made now into new segments of `gen`. In request order."""
    limit = sum(t.nbytes for t in gen.index.tensors)
    reusable = {(v.made_of(), _what(v)): v for other in others for v in other.variants.values()}
    budget = limit - sum(v.entry.nbytes for v in gen.variants.values() if v.key)
    out, made, added = [], [], []
    try:
        for entry, what, derivation in asked:
            spec, more = derivation or (None, [])
            if spec is None and entry.dtype == what:  # already served so: the served tensor is its own variant
                out.append(Variant(entry, entry))
                continue
            variant = gen.variants.get((entry.name, what))
            if variant is None:
                found = reusable.get((tuple(same_bytes(e) for e in (entry, *more)), what))
                if found is not None:
                    variant = Variant(entry, found.entry, found.key, tuple(more))
                elif spec is None:
                    variant = _make(gen, entry, list(entry.shape), what, group, None)
                else:
                    budget -= _size(spec, entry)
                    if budget < 0:
                        raise VariantRejected(f"generation {gen.number}: deriving {entry.name!r} in shape "
                                              f"{list(spec.shape)} would take its derived tensors past its served "
                                              f"bytes (the most a generation derives)")
                    variant = _make(gen, entry, list(spec.shape), entry.dtype, group, spec, more)
                if found is None:
                    made.append(variant)
                gen.variants[(entry.name, what)] = variant
                added.append((entry.name, what))
            out.append(variant)
    except BaseException:
        for key in added:  # nothing of a refused request stays listed: the request fails whole
            gen.variants.pop(key, None)
        for variant in made:  # and what it made is unlinked
            gen.drop_variant(variant)
        raise
    if made:
        log.info("generation %d: %d variant(s) made once for this host (%s; %.1f MiB)", gen.number, len(made),
                 _summary(made), sum(v.entry.nbytes for v in made) / 2**20)
    return out


def _summary(variants: list[Variant]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for v in variants:
        key = (v.of.dtype.removeprefix("torch."), "derived layout" if v.key else v.entry.dtype.removeprefix("torch."))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {a} -> {b}" for (a, b), n in counts.items())


def _make(gen, entry: TensorEntry, shape: list[int], dtype: str, group: str | None, gather, more=()) -> Variant:
    """Make one variant into a segment of its own (numbered after the generation's variants so far): the served
    tensor cast to `dtype`, or gathered by `gather`. The one step of a variant that needs torch: variants already
    made are handed out without it."""
    from expertd.derived import gather_into
    from expertd.segments import map_segment
    from expertd.shm import segment_bytes, to_dtype, view

    shm_dir = gen.index.shm_dir
    arena = Arena(gen.index.namespace, f"v{gen.number}", group=group, shm_dir=shm_dir)
    target = to_dtype(dtype)
    nbytes = math.prod(shape) * target.itemsize
    placement = arena.add(nbytes, gen.next_variant())
    try:
        sizes = {s.name: s.nbytes for s in gen.index.segments}
        source = {e.segment: segment_bytes(map_segment(e.segment, sizes[e.segment], shm_dir=shm_dir))
                  for e in (entry, *more)}
        out = arena.tensor(placement, tuple(shape), target)
        if gather is None:
            out.copy_(view(source, entry))
        else:
            gather_into(out, view(source, entry), gather, also=[view(source, e) for e in more])
        checksum = tensor_checksum(out)
        del out, source
        arena.unmap()  # the daemon keeps no writable mapping
    except BaseException:
        arena.unlink()
        raise
    made = TensorEntry(entry.name, placement.segment, 0, nbytes, shape, dtype, [entry.name], checksum=checksum)
    return Variant(entry, made, gather.key if gather is not None else "", tuple(more))
