"""Dtype variants on the worker's side: ask the daemon for the casts this worker's transformers needs, and say so.

A worker whose transformers loads a tensor in another dtype than the daemon serves it (another release's
keep-in-fp32 rules, or `load_model(dtype=torch.float16)`) binds the daemon's variant of it: cast once per host,
mapped read-only like any segment. Only a daemon that cannot make variants leaves private copies.
"""

from __future__ import annotations

import logging

from expertd import messages
from expertd.errors import DaemonError, GenerationGone, ProtocolError, VariantRejected
from expertd.index import TensorEntry, TensorIndex

log = logging.getLogger("expertd.client")


def fetch(conn, lease: str, index: TensorIndex, need: dict[str, tuple[str, str]]) -> list[TensorEntry]:
    """The daemon's variants of the served tensors `need` names (model name -> (served name, dtype)), in as few
    requests as `messages.MAX_ITEMS` allows, on the index's generation; [] when the daemon makes none (an older
    daemon: said once, copies follow)."""
    asked = list(dict.fromkeys(need.values()))
    entries = []
    try:
        for at in range(0, len(asked), messages.MAX_ITEMS):  # the most one request names
            items = [messages.CastItem(name=name, dtype=dtype) for name, dtype in asked[at:at + messages.MAX_ITEMS]]
            reply = conn.send(messages.Cast(client=lease, generation=index.generation, tensors=items),
                              messages.VariantReply)
            entries += _entries(reply)
    except (VariantRejected, GenerationGone):
        raise
    except (DaemonError, ProtocolError) as exc:
        log.warning("the daemon made no dtype variants (%s: %s): %d tensor(s) become private copies",
                    type(exc).__name__, exc, len(need))
        return []
    if [(e.name, e.dtype) for e in entries] != asked:
        raise ProtocolError(f"the daemon's variants {[(e.name, e.dtype) for e in entries][:4]} do not answer the "
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
        log.info("generation %d: %d tensor(s) mapped as dtype variants the daemon cast once for this host (served as "
                 "%s; %s): %s", index.generation, len(views.cast), served, why, names)
    if views.copies:
        log.warning("generation %d: %d tensor(s) are private copies, not shared memory (served as %s; %s): %s",
                    index.generation, len(views.copies), served, why, ", ".join(views.copies[:3]))


def derive(conn, lease: str, index: TensorIndex, items: list[messages.GatherItem]) -> list[TensorEntry]:
    """The derived tensors `items` asks for (`expertd.derived.request`), of the index's generation, in order: made by
    the daemon once per host (VariantRejected names what it refused)."""
    reply = conn.send(messages.Gather(client=lease, generation=index.generation, tensors=items), messages.VariantReply)
    entries = _entries(reply)
    if [(e.name, list(e.shape)) for e in entries] != [(i.name, list(i.shape)) for i in items]:
        raise ProtocolError(f"the daemon's derived tensors {[(e.name, e.shape) for e in entries][:4]} do not answer "
                            f"the request {[i.name for i in items][:4]}")
    return entries


def _entries(reply) -> list[TensorEntry]:
    try:
        return [TensorEntry(t["name"], t["segment"], t["offset"], t["nbytes"], list(t["shape"]), t["dtype"],
                            checksum=t.get("checksum")) for t in reply.tensors]
    except (KeyError, TypeError) as exc:
        raise ProtocolError(f"the daemon's reply to a cast or gather: malformed entry ({exc})") from exc
