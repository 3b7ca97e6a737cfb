"""The tensor index: where every served tensor lives in shared memory.

A versioned, typed structure shared by server and client. The server writes it as compact JSON
(atomically) and places the same dict, msgpack-packed, in a shared-memory segment per generation
(`expertd.index_segment`); the client reads it back with `from_dict`.

Schema 2 (the compact form) leaves out the per-expert views (derived from the fused tensors) and
writes a fused tensor's sources as a pattern (`encode_sources`): at DeepSeek-V3's counts that is
~0.5 MB instead of ~19 MB of JSON. `from_dict` still reads schema 1 files (explicit lists, views).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from .errors import ProtocolError
from .extents import Extent, from_wire, extents_of, split
from .partition import ExpertBlock, ExpertParallel

SCHEMA_VERSION = 2  # written while no tensor has extents; 3 where one has (`EXTENTS_SCHEMA`)
EXTENTS_SCHEMA = 3
READABLE_SCHEMAS = (1, 2, 3)
DEFAULT_SHM_DIR = "/dev/shm"  # where segments live when an index names no `shm_dir` (where shm_open puts them)

@dataclass
class SegmentEntry:
    name: str
    nbytes: int


@dataclass
class TensorEntry:
    """One tensor in a segment: a served tensor, or a checkpoint-named view inside one.

    `sources` lists the checkpoint tensors a served tensor was built from, each a contiguous part of
    it; it is empty for a tensor computed from its sources by another op (no part is a view). `base`
    names the served tensor a view lies inside (None for served tensors).
    """

    name: str
    segment: str
    offset: int
    nbytes: int
    shape: list[int]
    dtype: str
    sources: list[str] | ExpertSources = field(default_factory=list)
    base: str | None = None
    checksum: str | None = None  # "xxh3_64:<hex>" of the bytes, or "xxh3_64x<n>:" of n parts (combined_checksum)
    experts: ExpertBlock | None = None  # a fused expert tensor of a partitioned daemon: which experts it holds
    extents: list[Extent] | None = None  # its bytes as ranges of several segments, in order (`expertd.extents`);
    # `segment` and `offset` are then the first one's


_ENTRY_FIELDS = [f.name for f in fields(TensorEntry) if f.name not in ("experts", "extents")]


@dataclass
class TensorIndex:
    generation: int
    namespace: str
    model_type: str
    layout: str
    config: dict
    segments: list[SegmentEntry]
    tensors: list[TensorEntry]
    views: list[TensorEntry] | None  # None: derived from the fused tensors on first use (the wire form)
    schema: int = SCHEMA_VERSION
    shm_dir: str = DEFAULT_SHM_DIR  # the folder the segments' files are in (a tmpfs or hugetlbfs mount)
    expert_parallel: ExpertParallel | None = None  # set when the daemon serves only some EP ranks' experts

    def view_count(self) -> int:
        """How many per-expert views `all_views` gives, without making them."""
        if self.views is not None:
            return len(self.views)
        return sum(len(t.sources) for t in self.tensors if len(t.sources) > 1 or (t.sources and t.sources[0] != t.name))

    def all_views(self) -> list[TensorEntry]:
        """The per-expert views; derived (once) when the index came without them."""
        if self.views is None:
            self.views = derive_views(self.tensors)
        return self.views

    def to_dict(self) -> dict:
        """The compact form (schema 2; 3 where a tensor has extents), for the published JSON and the wire alike: no
        per-expert views (`from_dict` derives them) and fused tensors' sources as patterns."""
        tensors = []
        for t in self.tensors:
            entry = {f: getattr(t, f) for f in _ENTRY_FIELDS}
            entry["shape"], entry["sources"] = list(t.shape), encode_sources(t.sources)
            if t.experts is not None:  # only on a partitioned daemon's expert blocks: other indexes stay as they were
                entry["experts"] = t.experts.to_dict()
            if t.extents:
                entry["extents"] = [e.to_wire() for e in t.extents]
            tensors.append(entry)
        schema = EXTENTS_SCHEMA if any(t.extents for t in self.tensors) else SCHEMA_VERSION
        out = {"schema": schema, "generation": self.generation, "namespace": self.namespace,
               "model_type": self.model_type, "layout": self.layout, "config": self.config,
               "segments": [{"name": s.name, "nbytes": s.nbytes} for s in self.segments], "tensors": tensors,
               "shm_dir": self.shm_dir}
        if self.expert_parallel is not None:
            out["expert_parallel"] = self.expert_parallel.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "TensorIndex":
        """Read a schema 2 dict (or a schema 1 one: explicit source lists, views written out)."""
        if not isinstance(data, dict):
            raise ProtocolError(f"tensor index must be a mapping, got {type(data).__name__}")
        if data.get("schema") not in READABLE_SCHEMAS:
            raise ProtocolError(f"tensor index schema {data.get('schema')!r} is not supported "
                                f"(this expertd reads {', '.join(map(str, READABLE_SCHEMAS))})")
        try:
            tensors, held = [], [0]  # held: the extents of the entries read so far (MAX_INDEX_EXTENTS bounds them)
            for t in data["tensors"]:
                t = _read_extents(dict(t), held)
                t["sources"] = decode_sources(t.get("sources", []))
                t["experts"] = ExpertBlock.from_dict(t.get("experts"))
                tensors.append(TensorEntry(**t))
            index = cls(
                schema=SCHEMA_VERSION,
                generation=int(data["generation"]),
                namespace=str(data["namespace"]),
                model_type=str(data["model_type"]),
                layout=str(data["layout"]),
                config=dict(data["config"]),
                segments=[SegmentEntry(**s) for s in data["segments"]],
                tensors=tensors,
                views=([TensorEntry(**_read_extents(dict(t), held)) for t in data["views"]]
                       if data.get("views") is not None else None),
                shm_dir=str(data.get("shm_dir", DEFAULT_SHM_DIR)),  # indexes written before shm_dir: /dev/shm
                expert_parallel=ExpertParallel.from_dict(data.get("expert_parallel")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed tensor index: {exc}") from exc
        if not os.path.isabs(index.shm_dir):
            raise ProtocolError(f"tensor index: shm_dir {index.shm_dir!r} must be an absolute path")
        return index

    def checkpoint_entries(self) -> dict[str, TensorEntry]:
        """Every checkpoint tensor name -> where its bytes are (a served tensor or a view)."""
        out = {t.name: t for t in self.tensors if t.sources == [t.name]}
        out.update({v.name: v for v in self.all_views()})
        return out

    def total_bytes_by_dtype(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for t in self.tensors:
            totals[t.dtype] = totals.get(t.dtype, 0) + t.nbytes
        return totals


def _read_extents(entry: dict, held: list[int]) -> dict:
    """`entry` (a dict of the wire) with its `extents`, if any, read and checked (`from_wire`), before anything is
    mapped; `held[0]`, the extents of the index's entries read before it, counts them too."""
    if entry.get("extents") is not None:
        entry["extents"] = from_wire(entry["extents"], str(entry.get("name")), entry.get("nbytes"), held[0])
        held[0] += len(entry["extents"])
    return entry


_NUMBER = re.compile(r"\d+")


def encode_sources(sources: list[str]) -> list[str] | dict:
    """A fused tensor's sources as `{"prefix", "experts": [first, count], "parts"}` where they are
    `prefix + str(e) + part` for e = first .. first + count - 1 and, within an expert, each part in
    order (the storage order of an expert stack, see `derive_views`); any other list as it is.

    `model.layers.3.mlp.experts.{0..255}.{gate,up}_proj.weight` (512 names) becomes
    `{"prefix": "model.layers.3.mlp.experts.", "experts": [0, 256], "parts": [".gate_proj.weight", ".up_proj.weight"]}`.
    A candidate is kept only if it decodes back to exactly `sources`.
    """
    if isinstance(sources, ExpertSources):
        return sources.to_dict()
    if len(sources) < 2:
        return list(sources)
    first, best = sources[0], None
    for m in _NUMBER.finditer(first):
        if str(int(m.group())) != m.group():
            continue  # zero-padded: str(e) would not give it back
        head, last = first[: m.end()], sources[-1]
        if last.startswith(head) and not last[len(head):][:1].isdigit():
            continue  # the last name has the first one's number here: no expert range (a pass over every name saved)
        parts = []
        for name in sources:
            part = name[len(head):]
            if not name.startswith(head) or part[:1].isdigit():
                break
            parts.append(part)
        if len(sources) % len(parts) or len(sources) // len(parts) < 2 or (best and len(parts) >= len(best["parts"])):
            continue
        candidate = {"prefix": first[: m.start()], "experts": [int(m.group()), len(sources) // len(parts)],
                     "parts": parts}
        if decode_sources(candidate) == sources:
            best = candidate
    return best or list(sources)


class ExpertSources(Sequence):
    """A fused tensor's sources given as a pattern, expanded to names on first use.

    Attaching a 5.x model binds served tensors by name and never reads them: decoding 44 k names
    at DeepSeek-V3's counts would be most of an attach's index cost. Equal to the list it stands for.
    """

    __slots__ = ("prefix", "experts", "parts", "_names")

    def __init__(self, prefix: str, experts: tuple[int, int], parts: tuple[str, ...]):
        self.prefix, self.experts, self.parts, self._names = prefix, experts, parts, None

    def names(self) -> list[str]:
        if self._names is None:
            first, count = self.experts
            self._names = [f"{self.prefix}{e}{part}" for e in range(first, first + count) for part in self.parts]
        return self._names

    def to_dict(self) -> dict:
        return {"prefix": self.prefix, "experts": list(self.experts), "parts": list(self.parts)}

    def __len__(self) -> int:
        return self.experts[1] * len(self.parts)

    def __getitem__(self, k):
        return self.names()[k]

    def __iter__(self):
        return iter(self.names())

    def __eq__(self, other) -> bool:
        if isinstance(other, ExpertSources):
            return ((self.prefix, self.experts, self.parts) == (other.prefix, other.experts, other.parts)
                    or self.names() == other.names())
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == len(self) and self.names() == list(other)
        return NotImplemented

    __hash__ = None  # like the list it stands for

    def __repr__(self) -> str:
        return f"ExpertSources({self.to_dict()!r})"


def decode_sources(value) -> list[str] | ExpertSources:
    """The source list an `encode_sources` value stands for (a list is itself; a pattern expands when first read)."""
    if isinstance(value, list):
        return value
    if not isinstance(value, dict):
        raise ProtocolError(f"sources must be a list or a pattern, got {type(value).__name__}")
    prefix, experts, parts = value.get("prefix"), value.get("experts"), value.get("parts")
    if (not isinstance(prefix, str) or not isinstance(parts, list) or not parts
            or not all(isinstance(p, str) for p in parts)
            or not isinstance(experts, list) or len(experts) != 2 or not all(type(n) is int and n >= 0 for n in experts)
            or experts[1] < 1):
        raise ProtocolError(f"malformed sources pattern {value!r}")
    return ExpertSources(prefix, (experts[0], experts[1]), tuple(parts))


def derive_views(tensors: list[TensorEntry]) -> list[TensorEntry]:
    """Per-expert views of fused tensors: source k of a fused [E, R, ...] tensor is its k-th equal,
    contiguous slice (each expert's sources back to back, in order)."""
    views = []
    for t in tensors:
        n = len(t.sources)
        if not n or t.sources == [t.name]:
            continue  # computed by a conversion (no views), or served under its own checkpoint name
        if n == 1:  # served under the model's name for a renamed checkpoint tensor: the whole of it
            views.append(TensorEntry(t.sources[0], t.segment, t.offset, t.nbytes, list(t.shape), t.dtype,
                                     list(t.sources), t.name, extents=t.extents))
            continue
        if t.nbytes % n or not t.shape or n % t.shape[0] or t.shape[1] % (n // t.shape[0]):
            raise ProtocolError(f"fused tensor {t.name} {t.shape} cannot hold {n} equal sources")
        chunk, per_expert = t.nbytes // n, n // t.shape[0]
        shape = [t.shape[1] // per_expert, *t.shape[2:]]
        if not t.extents:
            views.extend(TensorEntry(src, t.segment, t.offset + k * chunk, chunk, shape, t.dtype, [src], t.name)
                         for k, src in enumerate(t.sources))
            continue
        for src, pieces in zip(t.sources, split(t.extents, n)):  # a stack made of several generations' ranges
            views.append(TensorEntry(src, pieces[0].segment, pieces[0].offset, chunk, shape, t.dtype, [src], t.name,
                                     extents=pieces if len(pieces) > 1 else None))
    return views


def moved(before, after) -> list[str]:
    """Names of the entries of `after` that are new or lie elsewhere than in `before`, in `after`'s order: what a
    newer index changed (a tensor with the same bytes keeps its place)."""
    def place(e: TensorEntry) -> tuple:
        return tuple(extents_of(e)), e.nbytes, e.shape, e.dtype

    was = {e.name: place(e) for e in before}
    return [e.name for e in after if was.get(e.name) != place(e)]


def checksum(data) -> str:
    """The integrity checksum the index records for a tensor's bytes (any buffer)."""
    import xxhash

    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def checksum_text(value: int) -> str:
    """`checksum`'s text for an XXH3-64 value computed elsewhere (the compiled loops, a segment header)."""
    return f"xxh3_64:{value:016x}"


def combined_checksum(part_checksums: list[str]) -> str:
    """The checksum of a tensor made of n equal, back-to-back parts, from each part's `checksum`:
    `xxh3_64x{n}:` + xxh3-64 of the n part digests (8 bytes each, in order). Each part is then
    hashed by the thread that wrote it; one part is simply its own checksum."""
    import xxhash

    if len(part_checksums) == 1:
        return part_checksums[0]
    digests = bytes.fromhex("".join(c.rpartition(":")[2] for c in part_checksums))
    return f"xxh3_64x{len(part_checksums)}:{xxhash.xxh3_64_hexdigest(digests)}"


def checksum_parts(recorded: str) -> int:
    """How many equal parts a recorded checksum was combined from (1 for a plain `xxh3_64:`)."""
    kind = recorded.partition(":")[0]
    return int(kind[len("xxh3_64x"):]) if kind.startswith("xxh3_64x") else 1


def tensor_bytes(t):
    """A CPU tensor's bytes as a buffer, without a copy (an empty tensor has none)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def bytes_checksum(data, parts: int = 1) -> str:
    """`tensor_checksum` of a tensor whose bytes are `data` (a buffer), without torch: what adoption verifies."""
    if parts <= 1:
        return checksum(data)
    view = memoryview(data).cast("B")
    step = len(view) // parts
    return combined_checksum([checksum(view[k * step: (k + 1) * step]) for k in range(parts)])


def tensor_checksum(t, parts: int = 1) -> str:
    """A tensor's checksum as the index records it: of its bytes, or combined from `parts` equal parts."""
    return bytes_checksum(tensor_bytes(t), parts)


def json_text(data: dict, indent: int | None = 1, sort_keys: bool = True) -> str:
    """`data` as the index, ledger and manifest write it: compact without an indent, one trailing newline."""
    # dumps, not dump: json.dump always encodes in Python, dumps in C when there is no indent (~6x faster
    # for the ledger's records, ~14 MB at DeepSeek-V3's counts)
    return json.dumps(data, indent=indent, sort_keys=sort_keys,
                      separators=None if indent is not None else (",", ":")) + "\n"


def write_json_atomic(path: str, data: dict, indent: int | None = 1, sort_keys: bool = True) -> None:
    """Write JSON to `path` via a temp file in the same folder and rename, so readers never see half a file."""
    write_text_atomic(path, json_text(data, indent, sort_keys))


def write_text_atomic(path: str, text: str, mode: int | None = None) -> None:
    """Write `text` to `path` via a temp file in the same folder (fsynced) and rename, so readers never see half a
    file. The temp file gets `mode` when given (made exclusively, never through a link), else the umask's; it is
    removed on any failure."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, 0o666 if mode is None else mode), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
