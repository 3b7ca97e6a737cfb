"""Dtype derived tensors on the worker's side: ask the daemon for the casts this worker's transformers needs, and say
so.

A worker whose transformers loads a tensor in another dtype than the daemon serves it (another release's
keep-in-fp32 rules, or `load_model(dtype=torch.float16)`) binds the daemon's derived tensor of it: cast once per host,
mapped read-only like any segment. Only a daemon that cannot make derived tensors leaves private copies.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from expertd import messages
from expertd.derived import Gather, cast_key
from expertd.errors import DaemonError, DaemonTimeout, GenerationGone, ProtocolError, DerivedRejected
from expertd.extents import from_wire, reach
from expertd.index import SegmentEntry, TensorEntry, TensorIndex, checksum_parts, tensor_checksum
from expertd.procfs import default_threads

log = logging.getLogger("expertd.client")

# A derived tensor of at most this many bytes is checksummed once mapped (xxh3: a few ms); larger ones, and those
# asked as `trusted` (an engine map's layers whose checked layer was compared byte for byte), are trusted by their
# name (a digest of this client's own request over the served bytes' checksums) and their segment (the daemon's own
# file, created O_EXCL, owner-checked when mapped), as served tensors are until verify().
VERIFY_BYTES = 64 << 20
DERIVE_TIMEOUT_S = 600.0  # the longest a cast or gather may stay `building` before the client gives up


def fetch(conn, lease: str, index: TensorIndex, need: dict[str, tuple[str, str]]) -> list[TensorEntry]:
    """The daemon's derived tensors of the served tensors `need` names (model name -> (served name, dtype)), in as few
    requests as `messages.MAX_ITEMS` allows, on the index's generation; [] when the daemon makes none (an older
    daemon: said once, copies follow)."""
    asked = list(dict.fromkeys(need.values()))
    answered = []
    try:
        for at in range(0, len(asked), messages.MAX_ITEMS):  # the most one request names
            items = [messages.CastItem(name=name, dtype=dtype) for name, dtype in asked[at:at + messages.MAX_ITEMS]]
            answered.append(_ask(conn, messages.Cast(client=lease, generation=index.generation, tensors=items)))
    except (DerivedRejected, GenerationGone):
        raise
    except (DaemonError, ProtocolError) as exc:
        log.warning("the daemon made no dtype casts (%s: %s): %d tensor(s) become private copies",
                    type(exc).__name__, exc, len(need))
        return []
    served = {t.name: t for t in index.tensors}
    names = [None if name not in served else "" if served[name].dtype == dtype else cast_key(served[name], dtype)
             for name, dtype in asked]
    entries = []
    for k, reply in enumerate(answered):  # each entry the cast asked for, else refused (not a private copy)
        at = k * messages.MAX_ITEMS
        entries += _entries(reply, names[at:at + messages.MAX_ITEMS], index)
    if [(e.name, e.dtype) for e in entries] != asked:
        raise ProtocolError(f"the daemon's derived {[(e.name, e.dtype) for e in entries][:4]} do not answer the "
                            f"request {asked[:4]}")
    return entries


def log_casts(model, dtype, index: TensorIndex, views, need: dict) -> None:
    """One line per attach for what was not bound as served: which tensors, which dtypes, and why."""
    if not need:
        return
    from expertd.hf_dtypes import dtype_reason

    first = next(iter(need))
    served = views.served[need[first][0]].dtype
    why = dtype_reason(model, dtype, first, views.dtypes[first])
    names = ", ".join(list(need)[:3]) + (f" and {len(need) - 3} more" if len(need) > 3 else "")
    if views.cast:
        log.info("generation %d: %d tensor(s) mapped as dtype casts the daemon cast once for this host (served as "
                 "%s; %s): %s", index.generation, len(views.cast), served, why, names)
    if views.copies:
        log.warning("generation %d: %d tensor(s) are private copies, not shared memory (served as %s; %s): %s",
                    index.generation, len(views.copies), served, why, ", ".join(views.copies[:3]))


def derive(conn, lease: str, index: TensorIndex, items: list[messages.GatherItem]) -> list[TensorEntry]:
    """The derived tensors `items` asks for (`expertd.derived.request`), of the index's generation, in order: made by
    the daemon once per host (DerivedRejected names what it refused), each checked to be the derivation asked for.
    The names this client expects are computed on its threads while the daemon answers."""
    served = {t.name: t for t in index.tensors}
    asked = []
    for item in items:  # what each answer must be: computed from this client's own request and index
        sources = [served.get(n) for n in (item.name, *(item.also or ()))]
        known = all(s is not None for s in sources)
        asked.append((Gather(item, list(sources[0].shape), "", [list(s.shape) for s in sources[1:]]), sources)
                     if known else None)
    with ThreadPoolExecutor(max(1, min(default_threads(), len(items)))) as pool, ThreadPoolExecutor(1) as lead:
        expected = lead.submit(_names, pool, asked)
        reply = _ask(conn, messages.Gather(client=lease, generation=index.generation, tensors=items))
        names = expected.result()
    for item, name in zip(items, names):
        if name is None:
            raise ProtocolError(f"the daemon answered a derivation of {item.name!r}, which this index does not serve")
    entries = _entries(reply, names, index)
    if [(e.name, list(e.shape)) for e in entries] != [(i.name, list(i.shape)) for i in items]:
        raise ProtocolError(f"the daemon's derived tensors {[(e.name, e.shape) for e in entries][:4]} do not answer "
                            f"the request {[i.name for i in items][:4]}")
    return entries


def _names(pool: ThreadPoolExecutor, asked: list) -> list[str | None]:
    """Each gather's name (None where its sources are not served): each distinct index inflated and digested once,
    on `pool`'s threads (inflating and hashing release the GIL), however many items (a model's layers of one kind)
    send it."""
    firsts = list({g.index_key(): g for g, _ in filter(None, asked)}.values())
    digests = dict(zip((g.index_key() for g in firsts), pool.map(lambda g: g.index_digest(), firsts)))
    out = []
    for one in asked:
        if one is not None:
            gather, sources = one
            gather.digest = digests[gather.index_key()]
            out.append(gather.key(sources))
        else:
            out.append(None)
    return out


def _ask(conn, request, timeout_s: float = DERIVE_TIMEOUT_S):
    """Send a cast or gather until the daemon answers it: a large one is made off its request loop meanwhile (the
    reply says `building`), and the same request asked again is answered once made; DaemonTimeout after
    `timeout_s` of `building` (the daemon's derivation job serves readers in turn: a wait this long is not one)."""
    wait, deadline = 0.01, time.monotonic() + timeout_s
    while True:
        reply = conn.send(request, messages.DerivedReply)
        if not reply.building:
            return reply
        if time.monotonic() > deadline:
            raise DaemonTimeout(f"the daemon at {conn.endpoint} was still making {messages.words(request.op)} after "
                                f"{timeout_s:.0f}s (see `expertd status`: derived.job)")
        time.sleep(wait)
        wait = min(wait * 2, 0.05)


def _entries(reply, names: list, index: TensorIndex) -> list[TensorEntry]:
    """The reply's entries, each checked to be the derivation asked for: its `derivation` is the name this client
    computed from its own request and the index's checksums (a served tensor that is its own derived tensor: that
    entry)."""
    try:
        entries = [TensorEntry(t["name"], t["segment"], t["offset"], t["nbytes"], list(t["shape"]), t["dtype"],
                               checksum=t.get("checksum"),
                               extents=from_wire(t["extents"], t["name"], t["nbytes"]) if "extents" in t else None)
                   for t in reply.tensors]  # a derived stack that keeps an older one's blocks: ranges
        got = [t.get("derivation", "") for t in reply.tensors]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"the daemon's reply to a cast or gather: malformed entry ({exc})") from exc
    if len(entries) != len(names):
        raise ProtocolError(f"the daemon answered {len(entries)} derived tensor(s) for {len(names)} asked")
    served = {(t.segment, t.offset, t.nbytes, t.dtype): t for t in index.tensors}
    for k, (entry, name, want) in enumerate(zip(entries, got, names)):
        if want == "" and (entry.segment, entry.offset, entry.nbytes, entry.dtype) in served:
            entries[k] = served[(entry.segment, entry.offset, entry.nbytes, entry.dtype)]  # as the index has it
            continue
        if not want or name != want:
            raise ProtocolError(f"the daemon's {entry.name!r} is derivation {str(name)[:80]!r}, not the "
                                f"{str(want)[:80]!r} this client asked for: refused (nothing of it mapped)")
    return entries


def map_derived(segments: dict, entries: list[TensorEntry], shm_dir: str, writable: bool,
                checked: int | None = None) -> None:
    """Map into `segments` those of derived `entries` not mapped yet (every range's), then check the bytes of the
    first `checked` entries (all: None) (`check_bytes`: each the derivation asked for too). One not checked is
    trusted as a served tensor is until `verify()`, and as a derived one over VERIFY_BYTES: by its name and its
    segment (an engine's map: the other layers of a kind whose checked layer was compared byte for byte)."""
    from expertd.shm import map_segments, view

    new = {name: end for name, end in reach(entries).items() if name not in segments}
    segments.update(map_segments([SegmentEntry(name, nbytes) for name, nbytes in new.items()], writable=writable,
                                 shm_dir=shm_dir))
    entries = entries[:checked]
    check_bytes([view(segments, e) for e in entries], entries)


def check_bytes(tensors, entries: list[TensorEntry]) -> None:
    """Each mapped derived tensor of at most VERIFY_BYTES checked against the reply's checksum (see VERIFY_BYTES), on
    the process's threads (xxh3 releases the GIL)."""
    todo = [(t, e) for t, e in zip(tensors, entries) if e.checksum and e.nbytes <= VERIFY_BYTES]
    with ThreadPoolExecutor(max(1, min(default_threads(), len(todo)))) as pool:
        sums = list(pool.map(lambda pair: tensor_checksum(pair[0], checksum_parts(pair[1].checksum)), todo))
    for (_, e), got in zip(todo, sums):
        if got != e.checksum:
            raise ProtocolError(f"the derived tensor {e.name!r} in {e.segment} does not match its checksum "
                                f"{e.checksum}: refused")
