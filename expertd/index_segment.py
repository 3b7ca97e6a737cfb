"""A generation's tensor index, pre-packed in a read-only shared-memory segment.

The daemon packs the index once when it publishes a generation and names the segment in the
lease (and refresh) reply: {"segment", "nbytes", "checksum", "generation"}. A worker maps it and
decodes locally, so 64 workers attaching at once cost the daemon 64 small replies, not 64 copies
of the index through its request loop.

Layout: a 32-byte header (magic, generation, payload length, xxh3_64 of the payload) and the
msgpack of `TensorIndex.to_dict()`. The reader checks all four against the reply before decoding:
a truncated, torn or stale segment is a `CorruptIndex`, never garbage. The daemon writes the
segment whole before its name is handed out and never writes it again.
"""

from __future__ import annotations

import mmap
import os
import struct

import msgpack
import xxhash

from .errors import CorruptIndex, ProtocolError, ShmError
from .index import DEFAULT_SHM_DIR, TensorIndex, checksum_text
from .segments import OPEN_FLAGS, segment_path
from .trust import check_owner

MAGIC = b"EXPDIDX\x01"
HEADER = struct.Struct("<8sQQQ")  # magic, generation, payload bytes, xxh3_64 of the payload


def pack(index: TensorIndex) -> tuple[bytes, dict]:
    """The segment's bytes and the descriptor a lease reply carries (its `segment` filled in by the caller)."""
    payload = msgpack.packb(index.to_dict(), use_bin_type=True)
    digest = xxhash.xxh3_64_intdigest(payload)
    blob = HEADER.pack(MAGIC, index.generation, len(payload), digest) + payload
    return blob, {"nbytes": len(blob), "checksum": checksum_text(digest), "generation": index.generation,
                  "shm_dir": index.shm_dir}


def _descriptor(desc) -> tuple[str, int, str, int]:
    if not isinstance(desc, dict):
        raise ProtocolError(f"index segment descriptor must be a map, got {type(desc).__name__}")
    name, nbytes, digest, generation = (desc.get(k) for k in ("segment", "nbytes", "checksum", "generation"))
    if (not isinstance(name, str) or not name.startswith("/") or type(nbytes) is not int or nbytes < HEADER.size
            or not isinstance(digest, str) or type(generation) is not int):
        raise ProtocolError(f"malformed index segment descriptor {desc!r}")
    return name, nbytes, digest, generation


def unpack(blob, desc: dict) -> dict:
    """The index dict in a segment's bytes, after checking them against the reply's descriptor."""
    name, nbytes, digest, generation = _descriptor(desc)
    if len(blob) < nbytes:
        raise CorruptIndex(f"index segment {name} is truncated: {len(blob)} bytes, the daemon announced {nbytes}")
    magic, stamped, length, checksum = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptIndex(f"index segment {name} does not start with an expertd index header")
    if stamped != generation:
        raise CorruptIndex(f"index segment {name} holds generation {stamped}, the daemon announced {generation}")
    if HEADER.size + length != nbytes:
        raise CorruptIndex(f"index segment {name} announces {length} payload bytes, the daemon {nbytes - HEADER.size}")
    if checksum_text(checksum) != digest:
        raise CorruptIndex(f"index segment {name}: header checksum {checksum_text(checksum)}, the daemon announced "
                           f"{digest}")
    with memoryview(blob) as whole, whole[HEADER.size:nbytes] as payload:  # released before the mapping closes
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise CorruptIndex(f"index segment {name} fails its checksum {digest}: its bytes were changed")
        try:
            return msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types on bad input
            raise CorruptIndex(f"index segment {name} is not a valid packed index: {exc}") from exc


def read(desc: dict) -> TensorIndex:
    """Map the index segment a lease reply names, read-only, and decode it into the index."""
    index = TensorIndex.from_dict(read_dict(desc))
    if index.generation != desc["generation"]:
        raise CorruptIndex(f"index segment {desc['segment']} holds generation {index.generation}, "
                           f"the daemon announced {desc['generation']}")
    return index


def read_dict(desc: dict) -> dict:
    """The index dict in the segment a lease reply names (mapped read-only, checked, unpacked, unmapped)."""
    name, nbytes, _, generation = _descriptor(desc)
    shm_dir = desc.get("shm_dir", DEFAULT_SHM_DIR)
    if not isinstance(shm_dir, str) or not os.path.isabs(shm_dir):
        raise ProtocolError(f"malformed index segment descriptor {desc!r}: shm_dir must be an absolute path")
    path = segment_path(name, shm_dir)
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise ShmError(f"index segment {name} ({path}) does not exist (generation {generation} retired, or the daemon "
                       "gone?)") from exc
    except PermissionError as exc:
        raise ShmError(f"no permission to open index segment {name} ({path})") from exc
    except OSError as exc:
        raise ShmError(f"cannot open index segment {name} ({path}): {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        check_owner(path, st, "index segment")
        size = st.st_size
        if size < nbytes:  # mapping past the end would SIGBUS on the first read
            raise CorruptIndex(f"index segment {name} is truncated: {size} bytes, the daemon announced {nbytes}")
        # the whole file: on hugetlbfs an unmap must cover whole huge pages (a shorter one fails with EINVAL,
        # which mmap.close() ignores, and the mapping would stay for the life of the process)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return unpack(mapping, desc)
    finally:
        mapping.close()
