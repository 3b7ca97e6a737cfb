"""Derived tensors: a served tensor cast to the dtype another transformers release loads it as, or rearranged into an
engine's layout (`expertd.derived`), made once per host.

The daemon serves every tensor in the dtype its own transformers loads it as (`expertd.hf_dtypes`). A worker
on another release may want another dtype for a few tensors (transformers 5.24 keeps DeepSeek-V3's routers in
float32, 5.23 and 4.57 in bf16). Rather than every such worker making a private copy, it asks the daemon
(`cast`), which casts the served bytes once into a segment of their own (`/{namespace}.{pid}.v{N}.…`, owner and
mode as any segment), checksums them and hands out the entry; every later worker maps the same bytes. A gather
(`gather`: vLLM's packed experts) rearranges served bytes the same way.

Every derived tensor is named by its derivation (`expertd.derived.key`: a BLAKE2b digest of its canonical request,
sources' checksums included). A derived tensor belongs to the generation it was asked in: it lives while that generation
does (a lease on it keeps both), is listed in `status`, and is unlinked when the generation retires. A newer
generation whose sources are the same bytes reuses it. The request flow, quotas and jobs are `derivations`; this
module plans a request (cheap checks, nothing inflated), checks it whole (`check`: every index inflated chunk by
chunk, every name computed) and makes one derived tensor (`make`: streamed from its sources).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from expertd.derived import Gather, cast_key
from expertd.errors import DerivedLimit, DerivedRejected
from expertd.extents import extents_of
from expertd.index import TensorEntry, tensor_checksum
from expertd.messages import DERIVED_DTYPES, CastItem, GatherItem

from ..shm.arena import Arena

ITEMSIZE = {"torch.float16": 2, "torch.bfloat16": 2, "torch.float32": 4, "torch.float64": 8}


def same_bytes(entry: TensorEntry) -> tuple:
    """What a derived tensor is made from: the same bytes wherever these five agree (a newer generation's
    unchanged tensor)."""
    return tuple(extents_of(entry)), entry.nbytes, entry.dtype, entry.checksum


@dataclass
class DerivedTensor:
    """A served tensor (`of`, an entry of its generation's index; `also`: further sources) made into `entry`."""

    of: TensorEntry
    entry: TensorEntry
    key: str = ""  # the derivation's name; "" for a served tensor that is its own derived tensor (a cast to its dtype)
    also: tuple = ()  # a gather's further sources (entries of the same generation), after `of`
    owner: str = ""  # the reader whose request made it (what its bytes and file count against)
    placed: int = 0  # the bytes its segment takes in shm_dir (whole pages of the folder's unit)
    form: tuple = ()  # a gather's request but for its sources' bytes (`Planned.form`): a newer stack's finds it
    sums: list | None = None  # a gather's blocks' checksums, where its blocks are whole pages (`derived/extents`)
    made: str = ""  # the segment it created, where its entry lies in older derived tensors' ranges too (extents)
    sizes: dict | None = None  # with extents: each segment its ranges lie in -> that segment's size (placed)

    @property
    def created(self) -> str:
        """The segment this derived tensor made (and its failure unlinks): its entry's, or its own extent's
        among others'."""
        return self.made or self.entry.segment

    def made_of(self) -> tuple:
        """What it is made from: the same bytes wherever these agree (a newer generation's unchanged tensors)."""
        return tuple(same_bytes(e) for e in (self.of, *self.also))

    def to_wire(self) -> dict:
        e = self.entry
        return {"name": e.name, "dtype": e.dtype, "segment": e.segment, "offset": e.offset, "nbytes": e.nbytes,
                "shape": list(e.shape), "checksum": e.checksum, "served_dtype": self.of.dtype,
                **({"derivation": self.key} if self.key else {}),
                **({"extents": [x.to_wire() for x in e.extents]} if e.extents else {})}

    def status(self) -> dict:
        return {"name": self.entry.name, "dtype": self.entry.dtype, "served_dtype": self.of.dtype,
                "nbytes": self.entry.nbytes, "segment": self.entry.segment, "derivation": self.key,
                "shape": list(self.entry.shape)}


@dataclass
class Planned:
    """One item of a request, looked up and bounded (nothing inflated): its sources, what it makes and its size."""

    entry: TensorEntry  # the (first) source
    dtype: str  # the derived tensor's dtype
    shape: list
    gather: Gather | None = None
    more: tuple = ()  # a gather's further sources
    key: str = field(default="", init=False)  # its derivation's name, once `check` has run

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE.get(self.dtype, 0) if self.gather is None else \
            math.prod(self.shape) * self.entry.nbytes // max(1, math.prod(self.entry.shape))

    @property
    def form(self) -> tuple:
        """A gather of one source as asked, but for its source's bytes: what a derivation of the same tensor of an
        older generation had, whose blocks it may keep where the source's did not change (`derived/extents`)."""
        if self.gather is None or self.more:
            return ()
        g = self.gather
        return (self.entry.name, self.dtype, tuple(self.shape), g.blocks, g.length,
                hashlib.blake2b(g.deflated, digest_size=16).hexdigest())

    @property
    def served(self) -> bool:
        """A cast to the dtype the tensor is served in: the served tensor is its own derived tensor (nothing made)."""
        return self.gather is None and self.entry.dtype == self.dtype

    @property
    def entries(self) -> int:
        """Index entries this item inflates and checks (its share of the work before anything is made)."""
        return self.gather.length if self.gather is not None else 0


def plan_casts(items: list[CastItem], served: dict[str, TensorEntry], generation: int) -> list[Planned]:
    """The requested casts, checked: every name served and a float tensor (the parser checked each dtype)."""
    out = []
    for item in items:
        entry = served.get(item.name)
        if entry is None:
            raise DerivedRejected(f"no tensor {item.name[:200]!r} in generation {generation}: a derived tensor of it "
                                  f"in {item.dtype!r} cannot be made (derived tensors are asked by served name)")
        if entry.dtype not in DERIVED_DTYPES:
            raise DerivedRejected(f"{item.name!r} is served as {entry.dtype}: only float tensors have dtype casts "
                                  f"({item.dtype!r} asked)")
        out.append(Planned(entry, item.dtype, list(entry.shape)))
    return out


def plan_gathers(items: list[GatherItem], served: dict[str, TensorEntry], generation: int, limit: int) -> list[Planned]:
    """The requested gathers, checked before any index is inflated: every source served and of one dtype, each
    gather well-formed for its sources' shapes and no larger than `limit` bytes."""
    out = []
    for i, item in enumerate(items):
        entry = served.get(item.name)
        if entry is None:
            raise DerivedRejected(f"no tensor {item.name[:200]!r} in generation {generation}: a derived layout of it "
                                  f"cannot be made (derived tensors are asked by served name)")
        more = _also(item, served, entry, generation)
        gather = Gather(item, list(entry.shape), f"tensors[{i}]", [list(e.shape) for e in more])
        planned = Planned(entry, entry.dtype, list(gather.shape), gather, tuple(more))
        if planned.nbytes > limit:  # never made for this reader: DerivedLimit, as the quota check would say
            raise DerivedLimit(f"generation {generation}: deriving {item.name!r} in shape {list(gather.shape)} "
                               f"takes {planned.nbytes} bytes, more than one reader's max_derived_bytes_per_reader="
                               f"{limit} (a quarter of max_derived_bytes, four times the served bytes of the live "
                               "generations, unless the config says otherwise): nothing made")
        out.append(planned)
    return out


def _also(item: GatherItem, served: dict[str, TensorEntry], entry: TensorEntry, generation: int) -> list[TensorEntry]:
    """The further sources of a gather (`also`), served and of the first one's dtype."""
    out = []
    for other in item.also or ():
        found = served.get(other)
        if found is None or found.dtype != entry.dtype:
            raise DerivedRejected(f"the gather of {item.name!r} in generation {generation}: {other[:200]!r} is "
                                  f"{'not served' if found is None else f'served as {found.dtype}'}; a gather's "
                                  f"sources are served tensors of one dtype ({entry.dtype})")
        out.append(found)
    return out


def check(planned: Planned) -> str:
    """The item checked whole (a gather's index inflated chunk by chunk, every entry in range) and named; nothing
    made. Pure: runs on the request loop for small
    requests, in a derivation job for large ones."""
    if planned.served:
        planned.key = ""
    elif planned.gather is None:
        planned.key = cast_key(planned.entry, planned.dtype)
    else:
        planned.key = planned.gather.checked_key([planned.entry, *planned.more])
    return planned.key


def make(gen, planned: Planned, owner: str, placed: int, group: str | None, should_stop=None) -> DerivedTensor:
    """Make one derived tensor into a segment of its own of generation `gen`: the served tensor cast, or gathered by its
    index streamed from the sources where they lie. Touches no table (it may run on a job's thread)."""
    from expertd.derived import gather_into
    from expertd.shm import to_dtype, view

    shm_dir, entry = gen.index.shm_dir, planned.entry
    arena = Arena(gen.index.namespace, f"v{gen.number}", group=group, shm_dir=shm_dir)
    target = to_dtype(planned.dtype)
    nbytes = math.prod(planned.shape) * target.itemsize
    placement = arena.add(nbytes, gen.next_derived())
    try:
        source = mapped_sources(gen, [entry, *planned.more])
        out = arena.tensor(placement, tuple(planned.shape), target)
        if planned.gather is None:
            out.copy_(view(source, entry))
        else:
            gather_into(out, [view(source, e) for e in (entry, *planned.more)], planned.gather, should_stop)
        checksum = tensor_checksum(out)
        sums = block_sums(out, planned, arena.shm.unit)
        del out, source
        arena.unmap()  # the daemon keeps no writable mapping
    except BaseException:
        arena.unlink()
        raise
    made = TensorEntry(entry.name, placement.segment, 0, nbytes, list(planned.shape), planned.dtype, [entry.name],
                       checksum=checksum)
    return DerivedTensor(entry, made, planned.key, tuple(planned.more), owner, placed, planned.form, sums)


def mapped_sources(gen, entries: list[TensorEntry]) -> dict:
    """The segments `entries` (served tensors of generation `gen`) lie in, every range's, mapped read-only as uint8
    tensors: what `expertd.shm.view` reads them from."""
    from expertd.segments import map_segment
    from expertd.shm import segment_bytes

    sizes = {s.name: s.nbytes for s in gen.index.segments}
    return {x.segment: segment_bytes(map_segment(x.segment, sizes[x.segment], shm_dir=gen.index.shm_dir))
            for e in entries for x in extents_of(e)}


def block_sums(out, planned: Planned, unit: int) -> list[str] | None:
    """Each block's checksum of a gather of one source whose blocks are whole pages (a newer stack's derivation may
    keep those blocks), else None."""
    from expertd.index import checksum, tensor_bytes

    blocks = planned.gather.blocks if planned.form else 0
    if blocks < 2 or (planned.nbytes // blocks) % unit:
        return None
    return [checksum(tensor_bytes(out[b])) for b in range(blocks)]


def summary(derived: list[DerivedTensor]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for v in derived:
        key = (v.of.dtype.removeprefix("torch."),
               "derived layout" if v.also or v.entry.shape != v.of.shape else v.entry.dtype.removeprefix("torch."))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {a} -> {b}" for (a, b), n in counts.items())
