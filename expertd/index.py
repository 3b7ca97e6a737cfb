"""The tensor index: where every served tensor lives in shared memory.

A versioned, typed structure shared by server and client. The server writes it as JSON
(atomically) and sends the same dict over the control socket; the client reads it back.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field

from .errors import ProtocolError

SCHEMA_VERSION = 1
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
    sources: list[str] = field(default_factory=list)
    base: str | None = None
    checksum: str | None = None  # "xxh3_64:<hex>" of the bytes, or "xxh3_64x<n>:" of n parts (combined_checksum)


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

    def all_views(self) -> list[TensorEntry]:
        """The per-expert views; derived (once) when the index came without them."""
        if self.views is None:
            self.views = derive_views(self.tensors)
        return self.views

    def to_dict(self) -> dict:
        self.all_views()
        return asdict(self)

    def to_wire(self) -> dict:
        """The dict sent to clients: per-expert views left out, since `from_dict` derives them.

        Views are ~90 % of a MoE index (44 k of them for DeepSeek-V3); leaving them out makes
        every attach fetch and decode a fraction of the bytes.
        """
        data = asdict(self)
        data.pop("views")
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "TensorIndex":
        if not isinstance(data, dict):
            raise ProtocolError(f"tensor index must be a mapping, got {type(data).__name__}")
        if data.get("schema") != SCHEMA_VERSION:
            raise ProtocolError(
                f"tensor index schema {data.get('schema')!r} is not supported (expected {SCHEMA_VERSION})"
            )
        try:
            index = cls(
                schema=data["schema"],
                generation=int(data["generation"]),
                namespace=str(data["namespace"]),
                model_type=str(data["model_type"]),
                layout=str(data["layout"]),
                config=dict(data["config"]),
                segments=[SegmentEntry(**s) for s in data["segments"]],
                tensors=[TensorEntry(**t) for t in data["tensors"]],
                views=[TensorEntry(**t) for t in data["views"]] if "views" in data else None,
                shm_dir=str(data.get("shm_dir", DEFAULT_SHM_DIR)),  # indexes written before shm_dir: /dev/shm
            )
        except (KeyError, TypeError, ValueError) as exc:
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


def derive_views(tensors: list[TensorEntry]) -> list[TensorEntry]:
    """Per-expert views of fused tensors: source k of a fused [E, R, ...] tensor is its k-th equal,
    contiguous slice (each expert's sources back to back, in order)."""
    views = []
    for t in tensors:
        n = len(t.sources)
        if not n or t.sources == [t.name]:
            continue  # computed by a conversion (no views), or served under its own checkpoint name
        if n == 1:  # served under the model's name for a renamed checkpoint tensor: the whole of it
            views.append(TensorEntry(t.sources[0], t.segment, t.offset, t.nbytes, list(t.shape), t.dtype, list(t.sources), t.name))
            continue
        if t.nbytes % n or not t.shape or n % t.shape[0] or t.shape[1] % (n // t.shape[0]):
            raise ProtocolError(f"fused tensor {t.name} {t.shape} cannot hold {n} equal sources")
        chunk, per_expert = t.nbytes // n, n // t.shape[0]
        shape = [t.shape[1] // per_expert, *t.shape[2:]]
        views.extend(
            TensorEntry(src, t.segment, t.offset + k * chunk, chunk, shape, t.dtype, [src], t.name)
            for k, src in enumerate(t.sources)
        )
    return views


def checksum(data) -> str:
    """The integrity checksum the index records for a tensor's bytes (any buffer)."""
    import xxhash

    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def combined_checksum(part_checksums: list[str]) -> str:
    """The checksum of a tensor made of n equal, back-to-back parts, from each part's `checksum`:
    `xxh3_64x{n}:` + xxh3-64 of the n part digests (8 bytes each, in order). Each part is then
    hashed by the thread that wrote it; one part is simply its own checksum."""
    import xxhash

    if len(part_checksums) == 1:
        return part_checksums[0]
    h = xxhash.xxh3_64()
    for c in part_checksums:
        h.update(bytes.fromhex(c.rpartition(":")[2]))
    return f"xxh3_64x{len(part_checksums)}:{h.hexdigest()}"


def checksum_parts(recorded: str) -> int:
    """How many equal parts a recorded checksum was combined from (1 for a plain `xxh3_64:`)."""
    kind = recorded.partition(":")[0]
    return int(kind[len("xxh3_64x"):]) if kind.startswith("xxh3_64x") else 1


def tensor_bytes(t):
    """A CPU tensor's bytes as a buffer, without a copy (an empty tensor has none)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def tensor_checksum(t, parts: int = 1) -> str:
    """A tensor's checksum as the index records it: of its bytes, or combined from `parts` equal parts."""
    import torch

    if parts <= 1:
        return checksum(tensor_bytes(t))
    flat = t.reshape(-1).view(torch.uint8)
    step = flat.numel() // parts
    return combined_checksum([checksum(tensor_bytes(flat[k * step: (k + 1) * step])) for k in range(parts)])


def write_json_atomic(path: str, data: dict, indent: int = 1, sort_keys: bool = True) -> None:
    """Write JSON to `path` via a temp file in the same folder and rename, so readers never see half a file.

    The temp file is created like any other (permissions from the umask) and removed on any failure.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x") as f:
            json.dump(data, f, indent=indent, sort_keys=sort_keys)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
