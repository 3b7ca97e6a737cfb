"""Dtype variants: a served tensor cast to the dtype another transformers release loads it as, once per host.

The daemon serves every tensor in the dtype its own transformers loads it as (`expertd.hf_dtypes`). A worker
on another release may want another dtype for a few tensors (transformers 5.24 keeps DeepSeek-V3's routers in
float32, 5.23 and 4.57 in bf16). Rather than every such worker making a private copy, it asks the daemon
(`variant`), which casts the served bytes once into a segment of their own (`/{namespace}.{pid}.v{N}.{k}`,
owner and mode as any segment), checksums them and hands out the entry; every later worker maps the same
bytes. A variant belongs to the generation it was asked in: it lives while that generation does (a lease
on it keeps both), is listed in `status`, and is unlinked when the generation retires. A newer generation
whose served tensor is the same bytes (same segment and offset) reuses the variant instead of casting again.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from expertd.errors import VariantRejected
from expertd.index import TensorEntry, tensor_checksum
from expertd.messages import VARIANT_DTYPES

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


    def to_wire(self) -> dict:
        e = self.entry
        return {"name": e.name, "dtype": e.dtype, "segment": e.segment, "offset": e.offset, "nbytes": e.nbytes,
                "shape": list(e.shape), "checksum": e.checksum, "served_dtype": self.of.dtype}

    def status(self) -> dict:
        return {"name": self.entry.name, "dtype": self.entry.dtype, "served_dtype": self.of.dtype,
                "nbytes": self.entry.nbytes, "segment": self.entry.segment}


def wanted(tensors: list[dict], served: dict[str, TensorEntry], generation: int) -> list[tuple[TensorEntry, str]]:
    """The requested (served entry, dtype) pairs, checked: every name served, every dtype a float type, the served
    tensor a float one (VariantRejected naming the tensor and the dtype otherwise)."""
    out = []
    for i, item in enumerate(tensors):
        name, dtype = item.get("name"), item.get("dtype")
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise VariantRejected(f"op 'variant': tensors[{i}] must be a map with a string 'name' and 'dtype'")
        entry = served.get(name)
        if entry is None:
            raise VariantRejected(f"no tensor {name[:200]!r} in generation {generation}: a variant of it in "
                                  f"{dtype[:40]!r} cannot be made (variants are asked by served name)")
        if dtype not in VARIANT_DTYPES:
            raise VariantRejected(f"dtype {dtype[:40]!r} asked for {name!r} is not a float type: a variant is one of "
                                  f"{', '.join(VARIANT_DTYPES)}")
        if entry.dtype not in VARIANT_DTYPES:
            raise VariantRejected(f"{name!r} is served as {entry.dtype}: only float tensors have dtype variants "
                                  f"({dtype!r} asked)")
        out.append((entry, dtype))
    return out


def make(gen, others, tensors: list[dict], group: str | None = None) -> list[Variant]:
    """The variants `tensors` asks of generation `gen`: those it has, those another live generation (`others`)
    made of the same bytes, and the rest cast now into new segments of `gen`. In request order."""
    served = {t.name: t for t in gen.index.tensors}
    asked = wanted(tensors, served, gen.number)
    reusable = {(same_bytes(v.of), v.entry.dtype): v for other in others for v in other.variants.values()}
    out, made = [], []
    try:
        for entry, dtype in asked:
            if entry.dtype == dtype:  # already served so: the served tensor is its own variant
                out.append(Variant(entry, entry))
                continue
            variant = gen.variants.get((entry.name, dtype))
            if variant is None:
                found = reusable.get((same_bytes(entry), dtype))
                variant = Variant(entry, found.entry) if found is not None else _cast(gen, entry, dtype, group)
                if found is None:
                    made.append(variant)
                gen.variants[(entry.name, dtype)] = variant
            out.append(variant)
    except BaseException:
        for variant in made:  # nothing half-made stays: the request fails whole
            gen.variants.pop((variant.entry.name, variant.entry.dtype), None)
            gen.drop_variant(variant)
        raise
    if made:
        log.info("generation %d: %d dtype variant(s) cast once for this host (%s; %.1f MiB)", gen.number, len(made),
                 _summary(made), sum(v.entry.nbytes for v in made) / 2**20)
    return out


def _summary(variants: list[Variant]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for v in variants:
        key = (v.of.dtype.removeprefix("torch."), v.entry.dtype.removeprefix("torch."))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {a} -> {b}" for (a, b), n in counts.items())


def _cast(gen, entry: TensorEntry, dtype: str, group: str | None) -> Variant:
    """Cast one served tensor into a segment of its own (numbered after the generation's variants so far). The
    one step of a variant that needs torch: variants already made are handed out without it."""
    from expertd.shm import map_segment, segment_bytes, to_dtype, view

    shm_dir = gen.index.shm_dir
    arena = Arena(gen.index.namespace, f"v{gen.number}", group=group, shm_dir=shm_dir)
    target = to_dtype(dtype)
    nbytes = math.prod(entry.shape) * target.itemsize
    placement = arena.add(nbytes, gen.next_variant())
    try:
        sizes = {s.name: s.nbytes for s in gen.index.segments}
        source = {entry.segment: segment_bytes(map_segment(entry.segment, sizes[entry.segment], shm_dir=shm_dir))}
        out = arena.tensor(placement, tuple(entry.shape), target)
        out.copy_(view(source, entry))
        checksum = tensor_checksum(out)
        del out, source
        arena.unmap()  # the daemon keeps no writable mapping
    except BaseException:
        arena.unlink()
        raise
    cast = TensorEntry(entry.name, placement.segment, 0, nbytes, list(entry.shape), dtype, [entry.name],
                       checksum=checksum)
    return Variant(entry, cast)
