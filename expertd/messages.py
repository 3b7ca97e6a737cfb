"""The wire contract's requests, typed: one class per op, and the one place an op is declared.

A request class declares its op: `class Lease(Request, op="lease", permission=READ, reply=LeaseReply,
words="attach")`. Everything else is derived from those declarations: `REQUESTS` (op -> class, what the
daemon parses with and registers one handler per), `PERMISSIONS` (what the daemon checks, what the client sends
tokens with, what PROTOCOL.md and the C++ `wire.h` state — a test holds them to it), `OPS` and the words errors
and the CLI use (`words`). Adding an op is one class here and one handler in the daemon.

PROTOCOL.md §3 documents each message; tests/golden/protocol pins their bytes. The daemon turns every request into
its class (`parse_request`: an unknown op, a wrong or missing field, a list or string over its bound is a
ProtocolError naming the op and the field, another protocol version a VersionMismatch), so a handler starts
from a request whose every field is typed and bounded. A field left at `ABSENT` is not sent; `None` is sent as
nil. The replies are `expertd.replies`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import ProtocolError, DerivedRejected
from .message_types import ABSENT, F, Message
from .protocol import check_version
from .replies import (Done, HeartbeatReply, HelloReply, IndexReply, IndexSegmentReply, JobReply, LeaseReply, Reply,
                      StageReply, StatusReply, UpdateReply, DerivedReply)

U31, U64, U40 = 2**31, 2**64, 2**40

# Three permissions, each implying the ones before it: `read` (attach and look), `push` (change the served
# weights), `admin` (reload from a checkpoint, stop the daemon). Roles grant verbs, not connections: the daemon
# checks an op's permission on the parsed request and a refusal (PermissionDenied; PushDenied for the push ops)
# names the op and the permission. The client sends its push_token with the push ops and its admin_token with the
# admin ops (and with the push ops when it has no push_token).
READ, PUSH, ADMIN = "read", "push", "admin"
RANKS = {READ: 0, PUSH: 1, ADMIN: 2}  # a credential granted one permission has every permission of a lower rank

REQUESTS: dict[str, type[Request]] = {}  # op -> its request class, filled by the declarations below

NAME_CHARS = 1024  # a served tensor's name at most (a request naming a longer one is refused unread)
MAX_ITEMS = 4096  # tensors one `cast` or `gather` request names at most (the client sends more in several)
MAX_INDEX_BYTES = 512 << 10  # a gather's deflated index at most: well under a request's cap
MAX_ALSO = 64  # further sources of one gather at most
MAX_RANK = 8  # dimensions of a derived shape at most


@dataclass
class Request(Message):
    """A request; a subclass that names `op` declares that op (see the module's docstring)."""

    op: ClassVar[str] = ""
    permission: ClassVar[str] = READ  # what a client needs to be granted to send it
    reply: ClassVar[type[Reply]] = Done  # what a successful reply reads as
    words: ClassVar[str] = ""  # what it is in the user's words (errors and the CLI name these, never the op)

    def __init_subclass__(cls, op: str = "", permission: str = READ, reply: type[Reply] = Done, words: str = "",
                          **kwargs):
        super().__init_subclass__(**kwargs)
        if not op:
            return  # a base of several ops (LeaseRequest, UpdateRequest)
        if op in REQUESTS or permission not in RANKS:
            raise TypeError(f"op {op!r} declared twice or with an unknown permission {permission!r}")
        cls.op, cls.permission, cls.reply, cls.words = op, permission, reply, words or op
        REQUESTS[op] = cls

    def check(self) -> None:
        """Checks across fields, or beyond types (the protocol version)."""

    def reply_class(self) -> type[Reply]:
        """What this request's successful reply is (the daemon checks each handler's against it): its op's `reply`."""
        return self.reply


@dataclass
class Hello(Request, op="hello", reply=HelloReply, words="the handshake"):
    protocol: Any = F(None, None)  # absent counts as nil: another version

    def check(self) -> None:
        check_version(self.protocol)  # a missing version is another version


@dataclass
class Lease(Request, op="lease", reply=LeaseReply, words="attach"):
    pid: int = F(int, 0, lo=0, hi=U31)
    protocol: Any = F(None)  # checked when present: attaching is the handshake
    pid_ns: int | None = F(int, None, lo=0, hi=U64, nil=True)  # the worker's /proc/self/ns/pid inode
    start_time: int | None = F(int, None, lo=0, hi=U64, nil=True)  # field 22 of /proc/PID/stat
    generation: int | None = F(int, None, lo=1, hi=U64)  # resume this generation (after the daemon restarted)

    def check(self) -> None:
        if self.protocol is not ABSENT:
            check_version(self.protocol)


@dataclass
class LeaseRequest(Request):
    """A request on behalf of a lease: `client` names it (the first field of every such op)."""
    client: str = F(str, required=True, most=64)


@dataclass
class Heartbeat(LeaseRequest, op="heartbeat", reply=HeartbeatReply, words="a heartbeat"):
    """Keep a lease alive."""


@dataclass
class Refresh(LeaseRequest, op="refresh", reply=IndexSegmentReply, words="refresh"):
    """Move a lease to the latest generation."""


@dataclass
class Release(LeaseRequest, op="release", words="detach"):
    """End a lease."""


@dataclass
class Status(Request, op="status", reply=StatusReply, words="status"):
    """What the daemon serves, its leases, generations and latest build."""


@dataclass
class Index(Request, op="index", reply=IndexSegmentReply, words="the tensor index"):
    """The index of a lease's generation: its segment's descriptor, or (without `segment`) the index inline."""
    client: str | None = F(str, None, most=64)  # the generation this lease reads; else the latest
    segment: bool = F(bool, False)  # only the index segment's descriptor, not the index inline

    def reply_class(self) -> type[Reply]:
        """The descriptor with `segment`, else the index inline."""
        return self.reply if self.segment else IndexReply


@dataclass
class Stop(Request, op="stop", permission=ADMIN, words="stop"):
    keep: bool = F(bool, False)  # leave the generations for a successor to adopt


@dataclass
class Reload(Request, op="reload", permission=ADMIN, reply=JobReply, words="reload"):
    checkpoint: str | None = F(str, None, nil=True, most=4096)  # a folder; default the configured one


@dataclass
class PushedTensor(Message):
    """One tensor an `update` names; the daemon checks it against what it serves."""
    name: str = F(str, required=True, most=NAME_CHARS)
    shape: list = F(list, required=True, items=int, lo=0, hi=U40, most=MAX_RANK)
    dtype: str = F(str, required=True, most=40)  # e.g. "torch.bfloat16"


@dataclass
class Update(LeaseRequest, op="update", permission=PUSH, reply=UpdateReply, words="an update"):
    tensors: list = F(list, required=True, items=PushedTensor)


@dataclass
class UpdateRequest(LeaseRequest):
    """A request about one staged update (`update`, the number the `update` reply gave)."""
    update: int = F(int, required=True, lo=0, hi=U64)


@dataclass
class Stage(UpdateRequest, op="stage", permission=PUSH, reply=StageReply, words="an update's bytes"):
    """Pushed bytes, as the frames that follow the message (the one op that carries frames)."""
    tensor: int = F(int, required=True, lo=0, hi=U31)  # index into the update's tensors
    at: int = F(int, 0, lo=0, hi=U64)  # byte offset in that tensor


@dataclass
class Commit(UpdateRequest, op="commit", permission=PUSH, reply=JobReply, words="an update"):
    checksums: list = F(list, required=True, items=str)  # one "xxh3_64:" per staged tensor, in order
    hold: bool = F(bool, False)  # build, but publish only on `publish`


@dataclass
class Publish(LeaseRequest, op="publish", permission=PUSH, reply=JobReply, words="publishing an update"):
    job: int = F(int, required=True, lo=0, hi=U64)


@dataclass
class Abort(UpdateRequest, op="abort", permission=PUSH, words="dropping an update"):
    """Drop a staged update, or a held one not yet published."""


@dataclass
class Job(Request, op="job", reply=JobReply, words="build progress"):
    job: int = F(int, required=True, lo=0, hi=U64)


# --- derived tensors: dtype casts and gathers, made by the daemon from its served bytes -------------

# the dtypes a served tensor may be cast to for a worker whose transformers loads it so (`cast`)
DERIVED_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


@dataclass
class CastItem(Message):
    """A served tensor (`name`) cast to `dtype`, one of DERIVED_DTYPES."""
    name: str = F(str, required=True, most=NAME_CHARS)
    dtype: str = F(str, required=True, most=40)

    def check(self, where: str) -> None:
        if self.dtype not in DERIVED_DTYPES:
            raise DerivedRejected(f"{where}: dtype {self.dtype!r} asked for {self.name!r} is not a float type: a "
                                  f"derived tensor is one of {', '.join(DERIVED_DTYPES)}")


@dataclass
class GatherItem(Message):
    """A served tensor (`name`, or it and `also` concatenated as one block) rearranged by a deflated index into
    `shape`: block by block of its first dimension, or as one block (`blocks: 1`). See `expertd.derived`."""
    name: str = F(str, required=True, most=NAME_CHARS)
    index: bytes = F(bytes, required=True, most=MAX_INDEX_BYTES)  # int32 differences, deflated
    length: int = F(int, required=True, lo=1, hi=U40)  # elements of each derived block
    shape: list = F(list, required=True, items=int, lo=1, hi=U40, most=MAX_RANK)
    also: list = F(list, [], items=str, most=MAX_ALSO)  # further sources, concatenated after `name`
    blocks: int | None = F(int, None, lo=1, hi=2)  # 1: the source as one block (else its first dimension)

    def check(self, where: str) -> None:
        if not self.shape:
            raise ProtocolError(f"{where}: 'shape' must name at least one dimension")
        if any(len(n) > NAME_CHARS for n in self.also):
            raise ProtocolError(f"{where}: 'also' names a tensor of over {NAME_CHARS} characters")


@dataclass
class DerivedRequest(LeaseRequest):
    """Derived tensors of one generation: each item checked here, before the daemon looks anything up."""
    generation: int | None = F(int, None, lo=1, hi=U64)  # default: the generation the lease reads

    def check(self) -> None:
        for i, item in enumerate(self.tensors):
            item.check(f"op {self.op!r}: tensors[{i}]")


@dataclass
class Cast(DerivedRequest, op="cast", reply=DerivedReply, words="dtype casts"):
    tensors: list = F(list, required=True, items=CastItem, most=MAX_ITEMS)


@dataclass
class Gather(DerivedRequest, op="gather", reply=DerivedReply, words="derived tensors"):
    tensors: list = F(list, required=True, items=GatherItem, most=MAX_ITEMS)


OPS: tuple[str, ...] = tuple(REQUESTS)
PERMISSIONS: dict[str, str] = {op: cls.permission for op, cls in REQUESTS.items()}


def words(op: str) -> str:
    """What an op is in the user's words (the op itself for one this version does not know)."""
    cls = REQUESTS.get(op)
    return cls.words if cls is not None else op


def grants(granted: str, needed: str) -> bool:
    """Whether a credential granted `granted` may send an op that needs `needed` (admin implies push implies read)."""
    return RANKS[granted] >= RANKS[needed]


def parse_request(msg: dict) -> Request:
    """The typed request of a decoded message (a map, see protocol.unpack); wire fields only: `token`, `push_token`,
    `admin_token` and keys this version does not know are left to the caller and ignored here."""
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError("message has no string 'op'")
    cls = REQUESTS.get(op)
    if cls is None:
        raise ProtocolError(f"unknown op {op[:40]!r}; known ops: {', '.join(OPS)}")
    request = cls.from_wire(msg, f"op {op!r}")
    request.check()
    return request
