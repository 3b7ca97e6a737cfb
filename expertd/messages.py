"""The wire contract's messages, typed: one class per request op and per reply the clients read.

PROTOCOL.md §3 documents each message; tests/golden/protocol pins their bytes. The daemon turns every request
into its class here (`parse_request`: wrong or missing fields are a ProtocolError naming the op and the field,
another protocol version a VersionMismatch) and builds the replies clients read from the reply classes; the
Python client builds its requests from the same classes and reads those replies through them. A field left
at `ABSENT` is not sent; `None` is sent as nil.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from .errors import ProtocolError
from .protocol import check_version


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()  # a field that is not on the wire (distinct from nil)

_WORDS = {int: "an integer", str: "a string", bool: "a boolean", float: "a number", list: "a list", dict: "a map"}


def F(kind=None, default=ABSENT, *, lo: int | None = None, hi: int | None = None, nil: bool = False,
      required: bool = False, items=None):
    """A message field: its wire type (None: any), the value a reader takes when it is absent, integer bounds
    [lo, hi), whether nil is allowed, whether it must be present, and the type of a list's items. A message
    built to be sent leaves every field it is not given ABSENT: not on the wire."""
    return field(default=ABSENT, metadata={"kind": kind, "default": default, "lo": lo, "hi": hi, "nil": nil,
                                            "required": required, "items": items})


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
    return _WORDS[meta["kind"]]


def _check(where: str, name: str, value, meta: dict):
    kind = meta["kind"]
    if value is None and meta["nil"]:
        return None
    nil = " (or nil)" if meta["nil"] else ""
    shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
    wrong = kind is not None and not _is(kind, value)
    if wrong or (kind is int and ((meta["lo"] is not None and value < meta["lo"])
                                  or (meta["hi"] is not None and value >= meta["hi"]))):
        raise ProtocolError(f"{where}: '{name}' must be {_words(meta)}{nil}, got {shown}")
    if meta["items"] is not None:
        for i, item in enumerate(value):
            if not _is(meta["items"], item):
                raise ProtocolError(f"{where}: '{name}'[{i}] must be {_WORDS[meta['items']]}, got {type(item).__name__}")
    return value


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
        return {f.name: getattr(self, f.name) for f in fields(self)
                if "kind" in f.metadata and getattr(self, f.name) is not ABSENT}


# --- requests --------------------------------------------------------------------------------------

U31, U64 = 2**31, 2**64


@dataclass
class Request(Message):
    op: ClassVar[str] = ""

    def check(self) -> None:
        """Checks across fields, or beyond types (the protocol version)."""


@dataclass
class Hello(Request):
    op: ClassVar[str] = "hello"
    protocol: Any = F(None, None)  # absent counts as nil: another version

    def check(self) -> None:
        check_version(self.protocol)  # a missing version is another version


@dataclass
class Lease(Request):
    op: ClassVar[str] = "lease"
    pid: int = F(int, 0, lo=0, hi=U31)
    protocol: Any = F(None)  # checked when present: attaching is the handshake
    pid_ns: int | None = F(int, None, lo=0, hi=U64, nil=True)  # the worker's /proc/self/ns/pid inode
    start_time: int | None = F(int, None, lo=0, hi=U64, nil=True)  # field 22 of /proc/PID/stat
    generation: int | None = F(int, None, lo=1)  # resume this generation (after the daemon restarted)

    def check(self) -> None:
        if self.protocol is not ABSENT:
            check_version(self.protocol)


@dataclass
class Heartbeat(Request):
    op: ClassVar[str] = "heartbeat"
    client: str = F(str, required=True)


@dataclass
class Index(Request):
    op: ClassVar[str] = "index"
    client: str | None = F(str, None)  # the generation this lease reads; else the latest
    segment: bool = F(bool, False)  # only the index segment's descriptor, not the index inline


@dataclass
class Refresh(Request):
    op: ClassVar[str] = "refresh"
    client: str = F(str, required=True)


@dataclass
class Release(Request):
    op: ClassVar[str] = "release"
    client: str = F(str, required=True)


@dataclass
class Status(Request):
    op: ClassVar[str] = "status"


@dataclass
class Stop(Request):
    op: ClassVar[str] = "stop"
    keep: bool = F(bool, False)  # leave the generations for a successor to adopt


@dataclass
class Reload(Request):
    op: ClassVar[str] = "reload"
    checkpoint: str | None = F(str, None, nil=True)  # a folder; default the configured one


@dataclass
class Update(Request):
    op: ClassVar[str] = "update"
    client: str = F(str, required=True)
    tensors: list = F(list, required=True, items=dict)  # [{name, shape, dtype}]: checked against the served generation


@dataclass
class Stage(Request):
    op: ClassVar[str] = "stage"
    client: str = F(str, required=True)
    update: int = F(int, required=True)
    tensor: int = F(int, required=True, lo=0, hi=U31)  # index into the update's tensors
    at: int = F(int, 0, lo=0, hi=U64)  # byte offset in that tensor
    frames: list = field(default_factory=list)  # the data frames after the message (not a msgpack field)


@dataclass
class Commit(Request):
    op: ClassVar[str] = "commit"
    client: str = F(str, required=True)
    update: int = F(int, required=True)
    checksums: list = F(list, required=True, items=str)  # one "xxh3_64:" per staged tensor, in order
    hold: bool = F(bool, False)  # build, but publish only on `publish`


@dataclass
class Publish(Request):
    op: ClassVar[str] = "publish"
    client: str = F(str, required=True)
    job: int = F(int, required=True)


@dataclass
class Abort(Request):
    op: ClassVar[str] = "abort"
    client: str = F(str, required=True)
    update: int = F(int, required=True)


@dataclass
class Job(Request):
    op: ClassVar[str] = "job"
    job: int = F(int, required=True)


# the dtypes a served tensor may be cast to for a worker whose transformers loads it so (`variant`)
VARIANT_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


@dataclass
class Variant(Request):
    op: ClassVar[str] = "variant"
    client: str = F(str, required=True)
    tensors: list = F(list, required=True, items=dict)  # [{name: served name, dtype: one of VARIANT_DTYPES}]
    generation: int | None = F(int, None, lo=1)  # default: the generation the lease reads


REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in (
    Hello, Index, Lease, Release, Heartbeat, Status, Stop, Refresh, Reload, Update, Stage, Commit, Publish, Abort, Job,
    Variant)}


def parse_request(msg: dict) -> Request:
    """The typed request of a decoded message (`op` already checked by protocol.unpack); wire fields only:
    `token`, `push_token` and keys this version does not know are left to the caller and ignored here."""
    cls = REQUESTS[msg["op"]]
    request = cls.from_wire(msg, f"op {msg['op']!r}")
    request.check()
    return request


def request_fields(request: Request) -> dict:
    """The fields to send for `request` (without `op`), in declaration order."""
    return request.wire()


# --- replies the clients read ----------------------------------------------------------------------

@dataclass
class Reply(Message):
    latest: int = F(int, 0, lo=0)  # on every reply: the newest generation served (the daemon's loop adds it)

    def wire(self) -> dict:
        return {"ok": True, **super().wire()}


@dataclass
class HelloReply(Reply):
    protocol: int = F(int, required=True)
    ready: bool = F(bool, required=True)  # a generation is published
    generation: int = F(int, required=True)  # the latest, or while loading the one being built
    lease_timeout_s: float = F(float, required=True)


@dataclass
class LeaseReply(Reply):
    client: str = F(str, required=True)  # the lease id, "c<N>"
    lease_timeout_s: float = F(float, required=True)
    generation: int | None = F(int, None, nil=True)  # nil while the first generation is still loading
    index_segment: dict = F(dict)  # absent while loading: then poll `index` with segment


@dataclass
class HeartbeatReply(Reply):
    generation: int | None = F(int, None, nil=True)


@dataclass
class IndexSegmentReply(Reply):  # `index` with segment, and `refresh`
    generation: int = F(int, required=True)
    index_segment: dict = F(dict, required=True)


@dataclass
class VariantReply(Reply):
    generation: int = F(int, required=True)
    tensors: list = F(list, required=True, items=dict)  # one index entry per requested variant, in request order


@dataclass
class Done(Reply):  # release, stop, abort: nothing but ok
    pass


def read_reply(cls: type[Reply], reply: dict, what: str):
    """A successful reply to `what` (a request, in the user's words) as `cls`: ProtocolError when a field is wrong."""
    return cls.from_wire(reply, f"the daemon's reply to {what}")
