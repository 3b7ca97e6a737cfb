"""Adoption: a starting daemon takes over the generations a dead (or handed-over) predecessor left in shared memory.

The predecessor's manifest names its live generations; the ledger (`ledger`) holds each one's index.
Both are sealed under the run folder's key (`sealed`): a record that fails its MAC is never read. A
generation is adopted when the manifest *and* its own record say it was built under this config (same
checkpoint path, partition, shm_dir, user, ledger format; its index's shm_dir too, the folder every file
operation below uses) and every segment it uses is ours: a regular file of this namespace in shm_dir, owned
by this user, with the mode this daemon gives its segments (never one another user could have written).
Then its bytes are verified against the index: sizes always, and with `adopt_verify: full` every tensor's
xxh3 checksum, on `load_threads` threads. A tensor that fails is rebuilt from the checkpoint in place,
and only if the rebuilt bytes hash to the recorded checksum (a tensor an `update()` wrote exists nowhere
else: its generation is dropped instead, with a log line naming it). Nothing is published and no segment
is touched before the verdict; what is not adopted is reaped as after any crash.

An adopted generation's derived tensors (dtype casts and derived layouts, `derived_records`) are adopted with it: their
sealed record read, each segment checked as the generation's are (ours, its size) and, with `full`, each checksum.
A derived tensor that fails is dropped with a log line (never served, never repaired: a reader asks for it again) and
its segment unlinked.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from expertd.extents import extents_of
from expertd.index import TensorEntry, TensorIndex, bytes_checksum, checksum_parts, combined_checksum, tensor_bytes
from expertd.segments import OPEN_FLAGS, Placed, segment_path

from ..shm.arena import Arena, segment_pattern, unlink_segment
from . import derived_records as derived_records
from . import ledger

log = logging.getLogger("expertd.adopt")

VERIFY_MODES = ("full", "sizes")


@dataclass
class Adopted:
    """Generations taken over from a predecessor, oldest first, each as its ledger record."""

    records: list[ledger.Record] = field(default_factory=list)
    leases: list[dict] = field(default_factory=list)  # the predecessor's leases, re-granted for their generations
    segments: set[str] = field(default_factory=set)  # every segment the adopted generations use (never reaped)
    repaired: list[str] = field(default_factory=list)  # tensors rebuilt from the checkpoint
    derived: dict[int, dict] = field(default_factory=dict)  # generation -> name -> DerivedTensor, those that passed
    rerecord: set[int] = field(default_factory=set)  # generations whose derived tensors record lists more than passed
    sums: dict[int, dict] = field(default_factory=dict)  # generation -> its stacks' parts' checksums (`Built.sums`)
    seconds: float = 0.0


def refusal(manifest: dict, namespace: str, conditions: dict) -> str | None:
    """Why a predecessor's manifest may not be adopted under this config, or None."""
    if manifest.get("namespace") != namespace:
        return f"it is of namespace {manifest.get('namespace')!r}"
    if manifest.get("ledger") not in ledger.READABLE:
        return (f"its ledger format is {manifest.get('ledger')!r}, this expertd reads "
                f"{' and '.join(map(str, ledger.READABLE))}")
    if manifest.get("shm_dir") != conditions.get("shm_dir"):
        return f"its shm_dir was {manifest.get('shm_dir')!r}, this config's is {conditions.get('shm_dir')!r}"
    return _conditions_differ(manifest.get("built_under"), conditions)


def record_refusal(record: ledger.Record, conditions: dict) -> str | None:
    """Why a generation's own ledger record may not be adopted under this config (its build conditions, and the
    shm_dir its index names, where segments would be checked, repaired and unlinked), or None."""
    if record.index.shm_dir != conditions.get("shm_dir"):
        return f"its index's shm_dir is {record.index.shm_dir!r}, this config's is {conditions.get('shm_dir')!r}"
    return _conditions_differ(record.built_under, conditions)


def _conditions_differ(theirs, conditions: dict) -> str | None:
    if not isinstance(theirs, dict):
        return "it records no build conditions"
    for key, ours in conditions.items():
        if theirs.get(key) != ours:
            return f"its {key} was {theirs.get(key)!r}, this config's is {ours!r}"
    return None


def segment_problem(name: str, nbytes: int, namespace: str, shm_dir: str, gid: int | None) -> str | None:
    """Why segment `name` may not be adopted as ours (None if it may), or "missing"/"size" for a damaged one."""
    if not segment_pattern(namespace).match(name.lstrip("/")):
        return f"segment {name} is not of namespace {namespace!r}"
    try:
        st = os.lstat(segment_path(name, shm_dir))
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return f"segment {name} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"segment {name} is owned by uid {st.st_uid}, not this daemon's {os.geteuid()}"
    want = 0o600 if gid is None else 0o640
    if stat.S_IMODE(st.st_mode) & ~want or (gid is not None and st.st_gid != gid):
        return f"segment {name} has mode {stat.S_IMODE(st.st_mode):o} (gid {st.st_gid}); this daemon makes {want:o}"
    if st.st_size != nbytes:
        return "size"
    return None


def damaged(index: TensorIndex, mode: str, threads: int, gid: int | None,
            sums: dict[str, list[str]]) -> tuple[list[str], str | None]:
    """(names of tensors whose bytes are missing, short or — with mode "full" — fail their checksum; why the
    generation may not be adopted at all, or None). With mode "full", `sums` gets each verified tensor's parts'
    checksums where its checksum is combined of several (`Built.sums`: the first push into a stack after the
    handover then hashes only the parts it changes)."""
    bad_segments = set()
    for seg in index.segments:
        problem = segment_problem(seg.name, seg.nbytes, index.namespace, index.shm_dir, gid)
        if problem in ("missing", "size"):
            bad_segments.add(seg.name)
        elif problem is not None:
            return [], problem
    bad = [t.name for t in index.tensors if any(x.segment in bad_segments for x in extents_of(t))]
    if mode != "full":
        return bad, None
    sizes = {s.name: s.nbytes for s in index.segments}
    todo = [t for t in index.tensors if t.name not in bad and t.checksum is not None]

    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="expertd-adopt")
    with _placed(sizes, index.shm_dir) as placed, pool:
        for t, each in zip(todo, pool.map(placed.part_sums, todo)):
            if combined_checksum(each) != t.checksum:
                bad.append(t.name)
            elif len(each) > 1:
                sums[t.name] = each
    return bad, None


def _placed(sizes: dict[str, int], shm_dir: str) -> Placed:
    """Entries' bytes where they lie, each segment opened by the daemon itself (no owner check: adoption checked
    every segment's owner and mode first) and mapped read-only at its recorded size."""
    def opened(name: str) -> mmap.mmap:
        fd = os.open(segment_path(name, shm_dir), os.O_RDONLY | OPEN_FLAGS)
        try:
            return mmap.mmap(fd, sizes[name], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    return Placed(opened)


def repair(entry: TensorEntry, data, segment_size: int, shm_dir: str, gid: int | None) -> bool:
    """Write `data` (a tensor rebuilt from the checkpoint) over `entry` in its segment — made anew, or back to its
    size, if it went — when it hashes to the recorded checksum; False (nothing written) when it does not."""
    if entry.extents:  # ranges of older generations' segments too: never rewritten in place (not adopted)
        return False
    raw = tensor_bytes(data.contiguous())
    if entry.checksum is None or len(raw) != entry.nbytes or \
            bytes_checksum(raw, checksum_parts(entry.checksum)) != entry.checksum:
        return False
    path = segment_path(entry.segment, shm_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o600)
    try:
        if os.fstat(fd).st_uid != os.geteuid():  # planted since it was checked: another user's file is never written
            return False
        if gid is not None:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o640)
        if os.fstat(fd).st_size != segment_size:
            os.ftruncate(fd, segment_size)
        written = os.pwrite(fd, raw, entry.offset)
        if written != entry.nbytes:
            raise OSError(f"short write into {path}: {written} of {entry.nbytes} bytes")
    finally:
        os.close(fd)
    return True


def adopt(manifest: dict | None, *, namespace: str, run_dir: str, conditions: dict, mode: str, threads: int,
          gid: int | None, rebuild) -> Adopted | None:
    """The predecessor's generations this daemon can serve again, verified (and repaired), or None (reap all).

    `rebuild(names)` returns {name: tensor} rebuilt from the checkpoint for the tensors it can make (it is
    called only when something failed verification)."""
    if manifest is None or not manifest.get("generations"):
        return None
    started = time.perf_counter()
    why = refusal(manifest, namespace, conditions)
    if why is not None:
        log.warning("not adopting what pid %s left in namespace %r: %s; reaping it", manifest.get("pid"), namespace,
                    why)
        return None
    records = []
    for number in sorted(int(n) for n, names in manifest["generations"].items() if not any("*" in x for x in names)):
        try:
            records.append(ledger.read(run_dir, namespace, number))
        except ValueError as exc:
            log.warning("not adopting generation %d: %s", number, exc)
    out = Adopted()
    damage: dict[int, list[str]] = {}
    for record in records:
        problem = record_refusal(record, conditions)
        sums = out.sums.setdefault(record.number, {})
        bad, problem = ([], problem) if problem is not None else damaged(record.index, mode, threads, gid, sums)
        if problem is not None:
            log.warning("not adopting generation %d: %s", record.number, problem)
            continue
        damage[record.number] = bad
        out.records.append(record)
    broken = sorted({name for bad in damage.values() for name in bad})
    if broken:
        log.warning("%d tensor(s) failed verification: %s; rebuilding them from the checkpoint", len(broken),
                    ", ".join(broken[:8]) + (" ..." if len(broken) > 8 else ""))
        fixed = _repair(out.records, damage, rebuild(broken), gid)
        out.repaired = sorted(fixed)
        for record in list(out.records):
            lost = [name for name in damage[record.number] if (record.number, name) not in fixed]
            if lost:
                what = "an update()'s bytes, which exist nowhere else" if record.origin == "update" else \
                    "the checkpoint no longer makes the same bytes"
                log.error("dropping adopted generation %d (%s): %d tensor(s) cannot be restored (%s): %s",
                          record.number, record.origin, len(lost), what, ", ".join(lost[:8]))
                out.records.remove(record)
    if not out.records:
        return None
    numbers = {r.number for r in out.records}
    out.leases = [lease for lease in manifest.get("leases") or []
                  if isinstance(lease, dict) and lease.get("generation") in numbers]
    out.derived, out.rerecord = _adopted_derived(out.records, run_dir, mode, threads, gid)
    out.segments = {s.name for r in out.records for s in r.index.segments} | {
        name for mine in out.derived.values() for v in mine.values() for name in _sizes(v)}
    out.seconds = time.perf_counter() - started
    return out


def _repair(records: list[ledger.Record], damage: dict[int, list[str]], rebuilt: dict,
            gid: int | None) -> set[tuple[int, str]]:
    """Write rebuilt tensors into place; the (generation, name) pairs restored. A tensor shared by generations
    lives in one place: restoring it once restores it for all."""
    fixed: set[tuple[int, str]] = set()
    done: dict[tuple[str, int], bool] = {}
    for record in records:
        sizes = {s.name: s.nbytes for s in record.index.segments}
        entries = {t.name: t for t in record.index.tensors}
        for name in damage[record.number]:
            entry = entries[name]
            place = (entry.segment, entry.offset)
            if place not in done:
                data = rebuilt.get(name)
                done[place] = data is not None and repair(entry, data, sizes[entry.segment], record.index.shm_dir, gid)
            if done[place]:
                fixed.add((record.number, name))
    return fixed


def _adopted_derived(records: list[ledger.Record], run_dir: str, mode: str, threads: int,
              gid: int | None) -> tuple[dict[int, dict], set[int]]:
    """Each adopted generation's recorded derived tensors that pass, and the generations whose record lists more than
    passed (rewritten once serving). The segments of those dropped that are ours (a wrong size or checksum) are
    unlinked; one another user owns is left alone, as the reaper leaves it."""
    found: dict[int, dict] = {}
    rerecord: set[int] = set()
    for record in records:
        try:
            found[record.number] = derived_records.read(run_dir, record.index)
        except ValueError as exc:  # Unsealed too: a record planted or rewritten without the key is never read
            log.warning("not adopting the derived tensors of generation %d: %s; their segments are reaped",
                        record.number, exc)
            found[record.number] = {}
            rerecord.add(record.number)
    verdict = _verify_derived([(v, r.index) for r in records for v in found[r.number].values()], mode, threads, gid)
    kept: dict[int, dict] = {}
    dropped: dict[str, str] = {}  # segment -> its shm_dir
    for record in records:
        mine = kept[record.number] = {}
        bad = []
        for key, v in found[record.number].items():
            problem = verdict[_place(v)]
            if problem is None:
                mine[key] = v
                continue
            bad.append(f"{v.of.name} as {v.entry.dtype} {list(v.entry.shape)} in {v.entry.segment} "
                       f"({DERIVED_PROBLEMS.get(problem, problem)})")
            if problem in ("size", "checksum"):
                dropped[v.created] = record.index.shm_dir
        if bad:
            rerecord.add(record.number)
            log.warning("generation %d: %d derived tensor(s) dropped (made again when a reader asks): %s",
                        record.number, len(bad), "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
    in_use = {name for mine in kept.values() for v in mine.values() for name in _sizes(v)} | {
        s.name for r in records for s in r.index.segments}
    for name, shm_dir in dropped.items():
        if name not in in_use:
            unlink_segment(name, shm_dir)
    return kept, rerecord


DERIVED_PROBLEMS = {"missing": "its segment is missing", "size": "its segment is not the size recorded",
                    "checksum": "its bytes fail their checksum", "unsummed": "it records no checksum"}


def _place(derived_tensor) -> tuple:
    """What verifying a derived tensor checks: derived tensors shared by generations (same bytes) are checked once."""
    e = derived_tensor.entry
    return e.segment, e.offset, e.nbytes, e.checksum, derived_tensor.placed, tuple(e.extents or ())


def _sizes(derived_tensor) -> dict[str, int]:
    """Each segment a derived tensor's bytes lie in -> its size: its own, or (with extents) each range's as recorded."""
    return derived_tensor.sizes or {derived_tensor.entry.segment: derived_tensor.placed}


def _verify_derived(todo: list, mode: str, threads: int, gid: int | None) -> dict[tuple, str | None]:
    """Each (derived tensor, its generation's index)'s place -> why it may not be adopted (`segment_problem`'s words,
    "checksum" or "unsummed"), or None."""
    verdict: dict[tuple, str | None] = {}
    summed = []
    for derived_tensor, index in todo:
        place = _place(derived_tensor)
        if place in verdict:
            continue
        sizes = _sizes(derived_tensor)
        problem = next((p for p in (segment_problem(name, size, index.namespace, index.shm_dir, gid)
                                    for name, size in sizes.items()) if p is not None), None)
        if problem is None and mode == "full":
            if derived_tensor.entry.checksum is None:
                problem = "unsummed"
            else:
                summed.append((place, derived_tensor.entry, sizes, index.shm_dir))
        verdict[place] = problem

    def check(item) -> tuple[tuple, str | None]:
        place, entry, sizes, shm_dir = item
        try:
            with _placed(sizes, shm_dir) as placed:
                return place, None if placed.checksum(entry) == entry.checksum else "checksum"
        except OSError:  # gone or truncated since it was checked
            return place, "missing"

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="expertd-adopt") as pool:
        verdict.update(pool.map(check, summed))
    return verdict


def matches(ckpt, plan, built) -> bool:
    """Whether a checkpoint, as planned now, is what `built` (an adopted generation) was made from: the same
    served tensors, and every source's file identity (device, inode, size, mtime, place) one its builds recorded."""
    entries = {t.name: t for t in built.index.tensors}
    if len(entries) != len(plan.tensors):
        return False
    for planned in plan.tensors:
        entry = entries.get(planned.name)
        if entry is None or entry.shape != list(planned.shape) or entry.dtype != str(planned.dtype):
            return False
        for src in planned.sources:
            if ckpt.identity(src.info) not in built.known or (
                    src.scale is not None and ckpt.identity(src.scale) not in built.known):
                return False
    return True


def arena_of(record: ledger.Record, group: str | None) -> Arena:
    """An Arena owning the segments a generation's build created (named with its number), as its builder's did:
    retiring the generation, or a clean stop, unlinks them."""
    index = record.index
    arena = Arena(index.namespace, index.generation, group=group, shm_dir=index.shm_dir)
    for seg in index.segments:
        m = segment_pattern(index.namespace).match(seg.name.lstrip("/"))
        if m and m.group(2) == str(index.generation):
            arena.segments.append(seg)
            arena._maps[seg.name] = None  # unlink() removes it; nothing is mapped
    return arena
