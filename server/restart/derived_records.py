"""The ledger's record of each generation's derived tensors (dtype casts and derived layouts), so that a successor
adopts them with their generation instead of every reader waiting for them to be made again.

Per live generation that has derived tensors, `{run_dir}/{namespace}.gen{N}.derived.json` lists each one: its
derivation's name, its entry (segment, offset, bytes, shape, dtype, checksum), what it was made of (`of` and `also`:
names in the generation's index), the reader whose request made it and the bytes its segment takes. A derived stack that
keeps an older layout's blocks (`derived/extents`) has its entry's `extents`, the segment it made and each of its
segments' size, and a gather of one source its form
(`Planned.form`: a successor's next push keeps its unchanged blocks too). It is small beside the
generation's own record (a few hundred bytes a derived tensor) and kept apart from it, so that the multi-MB index record
is written once, at publish. `Recorder.flush` rewrites it between requests, on a thread of its own: at most every
RECORD_EVERY_S, for the generations whose derived tensors changed (grown, or reclaimed). It is
sealed like the ledger (`sealed`, a purpose of its own: it passes for no other record); one that fails is never read,
and its segments are reaped as after any crash. It goes with its generation's record (`ledger.remove`,
`ledger.remove_all`); `adopt` verifies what it names before anything of it is served.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import expertd
from expertd.extents import from_wire
from expertd.index import TensorEntry, TensorIndex
from expertd.segments import segment_path

from ..derived.tensors import DerivedTensor
from ..shm import hostpaths
from . import ledger, sealed

log = logging.getLogger("expertd.ledger")

RECORD_VERSION = 4  # 4: keyed "derived" (3 and older: an older expertd's, discarded)
RECORD_EVERY_S = 0.5  # a generation's record lags its derived tensors by at most this (and a request burst)
ENTRY_FIELDS = ("name", "segment", "offset", "nbytes", "shape", "dtype", "sources", "checksum")


def purpose(namespace: str, number: int) -> str:
    """What a derived tensors record's MAC binds it to: this namespace's generation `number`'s derived tensors."""
    return f"expertd ledger {namespace} generation {number} derived tensors"


def to_record(derived_tensor: DerivedTensor, sizes: dict[str, int]) -> dict:
    e = derived_tensor.entry
    out = {"key": derived_tensor.key, "of": derived_tensor.of.name, "also": [a.name for a in derived_tensor.also],
           "owner": derived_tensor.owner, "placed": derived_tensor.placed,
           "entry": {"name": e.name, "segment": e.segment, "offset": e.offset, "nbytes": e.nbytes,
                     "shape": list(e.shape), "dtype": e.dtype, "sources": list(e.sources), "checksum": e.checksum}}
    if derived_tensor.form:  # what a newer stack's same request matches, to keep this layout's unchanged blocks
        out["form"] = list(derived_tensor.form)  # its shape, a tuple, is written as a list as well
    if e.extents:  # in older derived tensors' segments too: each of them, and its size, for the successor to check
        out["entry"]["extents"] = [x.to_wire() for x in e.extents]
        out["made"], out["sizes"] = derived_tensor.made, {x.segment: sizes[x.segment] for x in e.extents}
    return out


def write(run_dir: str, namespace: str, number: int, derived, shm_dir: str) -> None:
    """Record generation `number`'s derived tensors, sealed under the run folder's key (atomically: whole or not
    at all)."""
    sizes, gone = {}, set()
    for x in (x for v in derived if v.entry.extents for x in v.entry.extents):
        if x.segment not in sizes and x.segment not in gone:
            try:
                sizes[x.segment] = os.stat(segment_path(x.segment, shm_dir)).st_size
            except FileNotFoundError:  # reclaimed since the list was taken: the next write leaves it out
                gone.add(x.segment)
    derived = [v for v in derived if not any(x.segment in gone for x in v.entry.extents or ())]
    sealed.write(ledger.derived_path(run_dir, namespace, number), {
        "derived": RECORD_VERSION, "expertd": expertd.__version__, "generation": number, "namespace": namespace,
        "tensors": [to_record(v, sizes) for v in derived],
    }, purpose(namespace, number), sealed.ensure_key(run_dir, namespace))


def read(run_dir: str, index: TensorIndex) -> dict[str, DerivedTensor]:
    """The derived tensors recorded for the generation of `index` (derivation name -> DerivedTensor, their sources
    entries of `index`), once the record's MAC checks out; {} when there is none (a generation without derived tensors,
    or recorded by a daemon before derived tensors were); ValueError naming what is wrong with it. Their bytes are not
    checked here."""
    namespace, number = index.namespace, index.generation
    path = ledger.derived_path(run_dir, namespace, number)
    if not os.path.lexists(path):
        return {}
    data = sealed.read_record(path, purpose(namespace, number), run_dir, namespace)
    if data.get("derived") != RECORD_VERSION:  # an older expertd's: discarded (the adopter says so, once)
        raise ValueError(f"{path}: derived tensors record format {data.get('derived')!r} (this expertd reads "
                         f"{RECORD_VERSION} only); its derived tensors are made again when asked")
    if data.get("generation") != number or data.get("namespace") != namespace:
        raise ValueError(f"{path}: records generation {data.get('generation')!r} of namespace "
                         f"{data.get('namespace')!r}, expected generation {number} of {namespace!r}")
    served = {t.name: t for t in index.tensors}
    try:
        derived = [from_record(item, served) for item in data["tensors"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
    return {v.key: v for v in derived}


def from_record(item: dict, served: dict[str, TensorEntry]) -> DerivedTensor:
    """One recorded derived tensor back as the DerivedTensor it was; ValueError for one that is not well-formed or
    whose sources
    its generation does not serve."""
    e = item["entry"]
    entry = TensorEntry(**{f: e[f] for f in ENTRY_FIELDS})
    sizes = made = None
    if e.get("extents") is not None:
        entry.extents = from_wire(e["extents"], str(entry.name), entry.nbytes)
        sizes, made = item["sizes"], item["made"]
        if not (isinstance(sizes, dict) and made in sizes and all(
                isinstance(sizes.get(x.segment), int) and x.offset + x.nbytes <= sizes[x.segment]
                for x in entry.extents) and (entry.segment, entry.offset) == (entry.extents[0].segment,
                                                                              entry.extents[0].offset)):
            raise ValueError(f"derived tensor {str(item.get('key'))[:80]!r} of {entry.name!r}: bad extents")
    if not (isinstance(item["key"], str) and item["key"] and isinstance(entry.segment, str)
            and isinstance(entry.dtype, str) and isinstance(entry.offset, int) and entry.offset >= 0
            and isinstance(entry.nbytes, int) and entry.nbytes >= 0 and isinstance(item["placed"], int)
            and (entry.extents or entry.offset + entry.nbytes <= item["placed"]) and isinstance(entry.shape, list)
            and all(isinstance(d, int) and d >= 0 for d in entry.shape)
            and (entry.checksum is None or isinstance(entry.checksum, str))):
        raise ValueError(f"derived tensor {str(item.get('key'))[:80]!r} of {entry.name!r}: a bad entry")
    sources = [served.get(name) for name in (item["of"], *item["also"])]
    if any(s is None for s in sources):
        raise ValueError(f"derived tensor {item['key'][:80]!r}: made of tensors this generation does not serve")
    return DerivedTensor(sources[0], entry, item["key"], tuple(sources[1:]), str(item["owner"]), item["placed"],
                   form=form_of(item, entry), made=made or "", sizes=sizes)


def form_of(item: dict, entry: TensorEntry) -> tuple:
    """A recorded derived tensor's form (`Planned.form`), checked against its entry: () where none was recorded (format
    1,
    a cast, a gather of several sources)."""
    form = item.get("form")
    if form is None:
        return ()
    if not (isinstance(form, list) and len(form) == 6 and form[0] == item["of"] and not item["also"]
            and form[1] == entry.dtype and form[2] == entry.shape and isinstance(form[3], int) and form[3] > 0
            and isinstance(form[4], int) and form[4] > 0 and isinstance(form[5], str)):
        raise ValueError(f"derived tensor {item['key'][:80]!r} of {entry.name!r}: a bad form")
    return form[0], form[1], tuple(form[2]), form[3], form[4], form[5]


class Recorder:
    """Keeps each live generation's derived tensors record current: rewritten when its derived tensors changed, at most
    every RECORD_EVERY_S, on a thread of its own (a record of thousands of derived tensors takes a while to seal and
    write: the request loop only takes the list)."""

    def __init__(self, run_dir: str, namespace: str):
        self.run_dir, self.namespace = run_dir, namespace
        self.recorded: dict[int, int] = {}  # generation -> how many derived tensors its record lists (-1: to rewrite)
        self._written = 0.0
        self._failing = False  # a write failed: said once, until one succeeds again
        self._lock = threading.Lock()  # a write and a retired generation's removal never interleave
        self._retired: set[int] = set()  # generations whose records went: a write in flight skips them
        self._writer: threading.Thread | None = None

    def adopted(self, number: int, count: int) -> None:
        """Generation `number`'s record, as a predecessor left it, lists `count` derived tensors (-1: rewrite it)."""
        self.recorded[number] = count

    def remove(self, number: int) -> None:
        """Generation `number` retired: its records go (`ledger.remove`), and no write in flight brings them back."""
        with self._lock:
            self._retired.add(number)
            ledger.remove(self.run_dir, self.namespace, number)

    def wait(self) -> None:
        """Until the write in flight, if any, is done."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def flush(self, gens, force: bool = False) -> None:
        """Rewrite the records of live generations `gens` whose derived tensors changed since last recorded: on the
        writer thread, or here and now with `force` (the daemon hands over)."""
        if self._writer is not None and self._writer.is_alive() and not force:
            return
        self.wait()
        if not force and time.monotonic() - self._written < RECORD_EVERY_S:
            return
        live = {g.number: g for g in gens}
        for number in [n for n in self.recorded if n not in live]:  # retired: its record went with it
            del self.recorded[number]
        todo = [(n, list(g.derived.values()), g.index.shm_dir) for n, g in live.items()
                if len(g.derived) != self.recorded.get(n, 0)]
        if not todo:
            return
        self._written = time.monotonic()
        if force:
            self._write(todo)
        else:
            self._writer = threading.Thread(target=self._write, args=(todo,), name="expertd-records", daemon=True)
            self._writer.start()

    def _write(self, todo: list[tuple[int, list, str]]) -> None:
        numbers = ", ".join(str(n) for n, _, _ in todo)
        try:
            with self._lock:
                hostpaths.check_folder(self.run_dir, "run folder")  # still the daemon's own, through no new link
                for number, derived, shm_dir in todo:
                    if number not in self._retired:
                        write(self.run_dir, self.namespace, number, derived, shm_dir)
                        self.recorded[number] = len(derived)
        except OSError as exc:
            if not self._failing:
                log.error("cannot record the derived tensors of generation(s) %s in %s (%s): serving on; a successor "
                          "makes them again rather than adopts them", numbers, self.run_dir, exc)
            self._failing = True
            return
        if self._failing:
            log.info("the derived tensors of generation(s) %s are recorded again", numbers)
        self._failing = False
