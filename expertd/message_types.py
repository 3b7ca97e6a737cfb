"""Typed fields over msgpack maps: the machinery `expertd.messages` declares the wire contract with.

A message is a dataclass whose fields are made by `F` (wire type, default, bounds, nil, required, list items);
`from_wire` checks a received map field by field (a ProtocolError naming where and the field), `wire` gives the
map to send, in declaration order, without the fields left ABSENT. A field may be a message of its own, or a
list of them: the map becomes that message, and is checked the same way.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any

from .errors import ProtocolError


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()  # a field that is not on the wire (distinct from nil)

_WORDS = {int: "an integer", str: "a string", bool: "a boolean", float: "a number", list: "a list", dict: "a map",
          bytes: "binary data"}


def F(kind=None, default=ABSENT, *, lo: int | None = None, hi: int | None = None, nil: bool = False,
      required: bool = False, items=None, most: int | None = None):
    """A message field: its wire type (None: any), the value a reader takes when it is absent, integer bounds
    [lo, hi) (of a list's items for a list), whether nil is allowed, whether it must be present, the type of
    a list's items (a Message class: maps read as that message), and the most items, characters or bytes a list,
    string or binary may hold. A message built to be sent leaves every field it is not given ABSENT: not on the
    wire."""
    return field(default=ABSENT, metadata={"kind": kind, "default": default, "lo": lo, "hi": hi, "nil": nil,
                                            "required": required, "items": items, "most": most})


def _is(kind, value) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _words(meta: dict) -> str:
    if meta["kind"] is int and meta["lo"] in (0, 1):
        words = "a non-negative integer" if meta["lo"] == 0 else "a positive integer"
        hi = meta["hi"]
        if hi is not None:
            words += f" below 2^{hi.bit_length() - 1}" if hi & (hi - 1) == 0 else f" below {hi}"
        return words
    return "a map" if _message(meta["kind"]) else _WORDS[meta["kind"]]


def _message(kind) -> bool:
    return isinstance(kind, type) and issubclass(kind, Message)


def _fits(meta: dict, value) -> bool:
    kind = dict if _message(meta["kind"]) else meta["kind"]
    if kind is not None and not _is(kind, value):
        return False
    return kind is not int or ((meta["lo"] is None or value >= meta["lo"])
                               and (meta["hi"] is None or value < meta["hi"]))


def _check(where: str, name: str, value, meta: dict):
    if value is None and meta["nil"]:
        return None
    if not _fits(meta, value):
        shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
        raise ProtocolError(f"{where}: '{name}' must be {_words(meta)}{' (or nil)' if meta['nil'] else ''}, "
                            f"got {shown}")
    most = meta.get("most")
    if most is not None and len(value) > most:
        unit = {list: "items", str: "characters", bytes: "bytes"}[meta["kind"]]
        raise ProtocolError(f"{where}: '{name}' holds {len(value)} {unit}; at most {most}")
    if _message(meta["kind"]):  # a map that is a message of its own
        return meta["kind"].from_wire(value, f"{where}: '{name}'")
    items = meta["items"]
    if items is not None:  # a list's items: of a wire type (with the field's bounds), or messages of their own
        each = {"kind": items, "lo": meta["lo"], "hi": meta["hi"]}
        for i, item in enumerate(value):
            if not _fits(each, item):
                shown = repr(item) if _is(dict if _message(items) else items, item) else type(item).__name__
                raise ProtocolError(f"{where}: '{name}'[{i}] must be {_words(each)}, got {shown}")
        if _message(items):
            value = [items.from_wire(item, f"{where}: '{name}'[{i}]") for i, item in enumerate(value)]
    return value


def _wired(value):
    if isinstance(value, Message):
        return value.wire()
    return [_wired(v) for v in value] if isinstance(value, list) else value


class Message:
    """Typed fields over a msgpack map: `from_wire` checks a received map, `wire` gives the map to send."""

    @classmethod
    def from_wire(cls, msg: dict, where: str):
        values = {}
        for f in fields(cls):
            meta = f.metadata
            if "kind" not in meta:
                continue  # not a wire field
            if f.name not in msg or (msg[f.name] is None and not meta["nil"] and not meta["required"]):
                if meta["required"]:
                    raise ProtocolError(f"{where}: '{f.name}' is missing; it must be {_words(meta)}")
                values[f.name] = meta["default"]
                continue
            values[f.name] = _check(where, f.name, msg[f.name], meta)
        return cls(**values)

    def wire(self) -> dict:
        return {f.name: _wired(getattr(self, f.name)) for f in fields(self)
                if "kind" in f.metadata and getattr(self, f.name) is not ABSENT}
