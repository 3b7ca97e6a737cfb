"""The ledger: what a daemon records of each published generation, so that a successor can adopt it.

Per live generation, `{run_dir}/{namespace}.gen{N}.json` holds its index (segments, tensors, checksums),
the part digests and source identities an incremental build compares against, where it came from
(`origin`: load, reload or update) and what it was built under (checkpoint, partition, shm_dir, uid,
expertd's version). It is written atomically when the generation is published and removed when it
retires or the daemon stops cleanly; a crash or a planned handover (`stop --keep`) leaves it. The
bytes themselves stay in their segments: the ledger is how a successor knows what they should be, so
each record is sealed (`sealed`: an HMAC under the run folder's key) and one that fails is never read.
A generation's derived tensors (dtype casts and derived layouts, made after it was published) are recorded beside it,
in `{namespace}.gen{N}.derived.json` (`derived_records`), and go with its record.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass

import expertd
from expertd.index import TensorIndex

from ..shm.heap import collection_paused
from . import sealed

log = logging.getLogger("expertd.ledger")

# A successor adopts only generations recorded in the format it reads (2: sealed records; 3: source identities
# grouped by file, dtype and shape)
LEDGER_VERSION = 3
READABLE = (2, 3)  # what a successor adopts: an upgrade from the release that wrote format 2 keeps its generations


@dataclass
class Record:
    """One published generation as its daemon recorded it."""

    number: int
    index: TensorIndex
    parts: dict[str, list[str]]
    known: dict[tuple, str]
    origin: str  # "load", "reload", "update"
    built_under: dict  # checkpoint, expert_parallel, shm_dir, uid, expertd version


def record_path(run_dir: str, namespace: str, number: int) -> str:
    return os.path.join(run_dir, f"{namespace}.gen{number}.json")


def derived_path(run_dir: str, namespace: str, number: int) -> str:
    """Where generation `number`'s derived tensors are recorded (`derived_records`): small, rewritten as made."""
    return os.path.join(run_dir, f"{namespace}.gen{number}.derived.json")


def build_conditions(checkpoint: str, expert_parallel, shm_dir: str) -> dict:
    """What a generation's bytes depend on besides its index: a successor adopts it only under the same."""
    return {"checkpoint": os.path.abspath(checkpoint), "shm_dir": shm_dir, "uid": os.geteuid(),
            "expert_parallel": None if expert_parallel is None else {
                "size": expert_parallel.size, "ranks": list(expert_parallel.ranks)}}


def purpose(namespace: str, number: int) -> str:
    """What a record's MAC binds it to: this namespace's generation `number` (no record passes for another)."""
    return f"expertd ledger {namespace} generation {number}"


@collection_paused()  # a tuple per source identity made, and the record's text
def write(run_dir: str, built, origin: str, conditions: dict) -> None:
    """Record a published generation, sealed under the run folder's key."""
    index = built.index
    sealed.write(record_path(run_dir, index.namespace, index.generation), {
        "ledger": LEDGER_VERSION, "expertd": expertd.__version__, "generation": index.generation, "origin": origin,
        "built_under": conditions, "index": index.to_dict(), "parts": built.parts,
        "known": pack_known(built.known),
    }, purpose(index.namespace, index.generation), sealed.ensure_key(run_dir, index.namespace))


def pack_known(known: dict[tuple, str]) -> list[list]:
    """Source identities (device, inode, size, mtime, offset, nbytes, dtype, shape) -> digest, as the record holds
    them: per file, dtype and shape, [device, inode, size, mtime, dtype, shape, offsets, nbytes, digests] (at
    DeepSeek-V3's counts ~90k identities in a few hundred groups: a third of the JSON, encoded 3x faster)."""
    groups: dict[tuple, tuple[list, list, list]] = {}
    for (dev, ino, size, mtime, offset, nbytes, dtype, shape), digest in known.items():
        group = groups.get((dev, ino, size, mtime, dtype, shape))
        if group is None:
            group = groups[dev, ino, size, mtime, dtype, shape] = ([], [], [])
        group[0].append(offset)
        group[1].append(nbytes)
        group[2].append(digest)
    return [[*key, *columns] for key, columns in groups.items()]


def unpack_known(groups: list) -> dict[tuple, str]:
    """`pack_known` undone; ValueError for groups whose columns differ in length."""
    known: dict[tuple, str] = {}
    for dev, ino, size, mtime, dtype, shape, offsets, nbytes, digests in groups:
        if not len(offsets) == len(nbytes) == len(digests):
            raise ValueError(f"a group of source identities has {len(offsets)} offsets, {len(nbytes)} sizes and "
                             f"{len(digests)} digests")
        shape = tuple(shape)
        known.update(zip([(dev, ino, size, mtime, offset, n, dtype, shape) for offset, n in zip(offsets, nbytes)],
                         digests))
    return known


def remove(run_dir: str, namespace: str, number: int) -> None:
    """Remove generation `number`'s record and its derived tensors' record."""
    for path in (record_path(run_dir, namespace, number), derived_path(run_dir, namespace, number)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_all(run_dir: str, namespace: str, keep=frozenset()) -> None:
    """Remove this namespace's records (derived tensors' records too) but those of generations `keep`."""
    for path in glob.glob(os.path.join(glob.escape(run_dir), f"{glob.escape(namespace)}.gen*.json")):
        m = re.fullmatch(rf"{re.escape(namespace)}\.gen(\d+)(?:\.derived)?\.json", os.path.basename(path))
        if m and int(m.group(1)) not in keep:
            os.unlink(path)


def read(run_dir: str, namespace: str, number: int) -> Record:
    """The record of generation `number`, its MAC checked; ValueError naming what is wrong with it."""
    with collection_paused():  # ~100k small lists and tuples made
        return _read(run_dir, namespace, number)


def _read(run_dir: str, namespace: str, number: int) -> Record:
    path = record_path(run_dir, namespace, number)
    data = sealed.read_record(path, purpose(namespace, number), run_dir, namespace)
    if not isinstance(data, dict) or data.get("ledger") not in READABLE:
        raise ValueError(f"{path}: ledger format {data.get('ledger') if isinstance(data, dict) else None!r}, "
                         f"this expertd reads {' and '.join(map(str, READABLE))}")
    try:
        index = TensorIndex.from_dict(data["index"])
        known = unpack_known(data["known"]) if data["ledger"] == 3 else \
            {_tuple(identity): digest for identity, digest in data["known"]}  # format 2: [[identity, digest], ...]
        record = Record(int(data["generation"]), index, dict(data["parts"]), known, str(data["origin"]),
                        dict(data["built_under"]))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
    if record.number != number or index.generation != number or index.namespace != namespace:
        raise ValueError(f"{path}: records generation {record.number} of namespace {index.namespace!r}, "
                         f"expected generation {number} of {namespace!r}")
    return record


def _tuple(value: list) -> tuple:
    """A format-2 record's source identity (JSON's lists) back to the tuple it is (its shape the one list inside)."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
