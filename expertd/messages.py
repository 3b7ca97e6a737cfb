"""The wire contract's messages, typed: one class per request op and per reply the clients read.

PROTOCOL.md §3 documents each message; tests/golden/protocol pins their bytes. The daemon turns every request
into its class here (`parse_request`: wrong or missing fields are a ProtocolError naming the op and the field,
another protocol version a VersionMismatch) and builds the replies clients read from the reply classes; the
Python client builds its requests from the same classes and reads those replies through them. A field left
at `ABSENT` is not sent; `None` is sent as nil. `PERMISSIONS` says which permission each op needs: the daemon
checks it on the parsed request, the client sends its push or admin token with the ops that need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import ProtocolError
from .index import DEFAULT_SHM_DIR
from .message_types import ABSENT, F, Message  # noqa: F401  (ABSENT: callers leave a field off the wire with it)
from .protocol import check_version


# --- requests --------------------------------------------------------------------------------------

U31, U64 = 2**31, 2**64


@dataclass
class Request(Message):
    op: ClassVar[str] = ""

    def check(self) -> None:
        """Checks across fields, or beyond types (the protocol version)."""

    @property
    def permission(self) -> str:
        """What a client needs to be granted to send this op (PERMISSIONS)."""
        return PERMISSIONS[self.op]


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
class LeaseRequest(Request):
    """A request on behalf of a lease: `client` names it (the first field of every such op)."""
    client: str = F(str, required=True)


def _plain(op: str, base: type[Request]) -> type[Request]:
    """The request class of an op with no fields beyond its base's (its name: the op's, capitalized)."""
    return dataclass(type(op.capitalize(), (base,), {"op": op, "__module__": __name__, "__doc__": f"op {op!r}"}))


Heartbeat, Refresh, Release = (_plain(op, LeaseRequest) for op in ("heartbeat", "refresh", "release"))  # a lease alone
Status = _plain("status", Request)


@dataclass
class Index(Request):
    op: ClassVar[str] = "index"
    client: str | None = F(str, None)  # the generation this lease reads; else the latest
    segment: bool = F(bool, False)  # only the index segment's descriptor, not the index inline


@dataclass
class Stop(Request):
    op: ClassVar[str] = "stop"
    keep: bool = F(bool, False)  # leave the generations for a successor to adopt


@dataclass
class Reload(Request):
    op: ClassVar[str] = "reload"
    checkpoint: str | None = F(str, None, nil=True)  # a folder; default the configured one


@dataclass
class PushedTensor(Message):
    """One tensor an `update` names; the daemon checks it against what it serves."""
    name: str = F(str, required=True)
    shape: list = F(list, required=True, items=int, lo=0)
    dtype: str = F(str, required=True)  # e.g. "torch.bfloat16"


@dataclass
class Update(LeaseRequest):
    op: ClassVar[str] = "update"
    tensors: list = F(list, required=True, items=PushedTensor)


@dataclass
class UpdateRequest(LeaseRequest):
    """A request about one staged update (`update`, the number the `update` reply gave)."""
    update: int = F(int, required=True)


@dataclass
class Stage(UpdateRequest):
    op: ClassVar[str] = "stage"
    tensor: int = F(int, required=True, lo=0, hi=U31)  # index into the update's tensors
    at: int = F(int, 0, lo=0, hi=U64)  # byte offset in that tensor
    frames: list = field(default_factory=list)  # the data frames after the message (not a msgpack field)


@dataclass
class Commit(UpdateRequest):
    op: ClassVar[str] = "commit"
    checksums: list = F(list, required=True, items=str)  # one "xxh3_64:" per staged tensor, in order
    hold: bool = F(bool, False)  # build, but publish only on `publish`


@dataclass
class Publish(LeaseRequest):
    op: ClassVar[str] = "publish"
    job: int = F(int, required=True)


Abort = _plain("abort", UpdateRequest)  # the staged update alone


@dataclass
class Job(Request):
    op: ClassVar[str] = "job"
    job: int = F(int, required=True)


# the dtypes a served tensor may be cast to for a worker whose transformers loads it so (`variant`)
VARIANT_DTYPES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


@dataclass
class Variant(LeaseRequest):
    op: ClassVar[str] = "variant"
    tensors: list = F(list, required=True, items=dict)  # [{name: served name, dtype: one of VARIANT_DTYPES}] or
    # [{name, gather: {index, length, shape}}] (expertd.derived)
    generation: int | None = F(int, None, lo=1)  # default: the generation the lease reads


REQUESTS: dict[str, type[Request]] = {cls.op: cls for cls in (
    Hello, Index, Lease, Release, Heartbeat, Status, Stop, Refresh, Reload, Update, Stage, Commit, Publish, Abort, Job,
    Variant)}

# The permission each op needs (roles grant verbs, not connections): the daemon checks it on the parsed request
# and a refusal (PermissionDenied; PushDenied for the push ops) names the op and the permission. Three permissions,
# each implying the ones before it: `read` (attach and look), `push` (change the served weights), `admin` (reload
# from a checkpoint, stop the daemon). The client sends its push_token with the push ops and its admin_token with the
# admin ops (and with the push ops when it has no push_token). PROTOCOL.md and client/cpp (wire.h) state this table.
READ, PUSH, ADMIN = "read", "push", "admin"
RANKS = {READ: 0, PUSH: 1, ADMIN: 2}  # a credential granted one permission has every permission of a lower rank
PERMISSIONS: dict[str, str] = {
    "hello": READ, "lease": READ, "index": READ, "heartbeat": READ, "refresh": READ, "release": READ, "variant": READ,
    "status": READ, "job": READ,
    "update": PUSH, "stage": PUSH, "commit": PUSH, "publish": PUSH, "abort": PUSH,  # they change what is served
    "reload": ADMIN, "stop": ADMIN,  # what is read from disk, and whether anything is served at all
}


def grants(granted: str, needed: str) -> bool:
    """Whether a credential granted `granted` may send an op that needs `needed` (admin implies push implies read)."""
    return RANKS[granted] >= RANKS[needed]


def parse_request(msg: dict) -> Request:
    """The typed request of a decoded message (`op` already checked by protocol.unpack); wire fields only:
    `token`, `push_token`, `admin_token` and keys this version does not know are left to the caller and ignored here."""
    cls = REQUESTS[msg["op"]]
    request = cls.from_wire(msg, f"op {msg['op']!r}")
    request.check()
    return request


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
    client: str = F(str, required=True)  # the lease id: 32 hex digits (128 random bits), a bearer secret
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


@dataclass
class StagedTensor(Message):
    """Where an `update` reply puts one pushed tensor in its staging segment."""
    name: str = F(str, required=True)
    offset: int = F(int, required=True, lo=0)
    nbytes: int = F(int, required=True, lo=0)


@dataclass
class UpdateReply(Reply):
    update: int = F(int, required=True)  # the staged update's number: `stage`, `commit` and `abort` name it
    segment: str = F(str, required=True)  # the staging segment to write the pushed bytes into
    nbytes: int = F(int, required=True, lo=0)
    shm_dir: str = F(str, DEFAULT_SHM_DIR)
    tensors: list = F(list, required=True, items=StagedTensor)  # in the order of the update's tensors


@dataclass
class StageReply(Reply):
    written: int = F(int, required=True, lo=0)  # bytes written from the request's frames


@dataclass
class JobState(Message):
    """A build (load, reload, update) as `commit`, `publish`, `reload` and `job` report it, and `status` under `job`.
    `error` and `message` only once failed; the byte counts only once built (a commit may answer still building)."""
    job: int = F(int, required=True)
    kind: str = F(str, required=True)  # "load" | "reload" | "update" | "check"
    state: str = F(str, required=True)  # "building" | "built" | "published" | "failed" | "unchanged"
    generation: int = F(int, required=True)  # the number it publishes as
    hold: bool = F(bool, False)  # built, it waits for `publish`
    error: str | None = F(str, nil=True)
    message: str | None = F(str, nil=True)
    bytes_written: int = F(int)
    tensors_written: int = F(int)
    bytes_read: int = F(int)
    seconds: float = F(float)


@dataclass
class JobReply(Reply, JobState):
    pass


@dataclass
class StatusReply(Reply):
    """What a daemon serves, its leases, generations and latest build (PROTOCOL.md §3 `status`), in the order sent.
    A daemon sends every field; a reader needs only those that say which daemon it is and what it does."""
    state: str = F(str, required=True)  # "serving" | "loading"
    pid: int = F(int, required=True)
    namespace: str = F(str)
    endpoint: str = F(str, required=True)
    checkpoint: str = F(str)
    generation: int = F(int, required=True)  # the latest, or while loading the one being built
    tensors: int = F(int)
    views: int = F(int)
    segments: list = F(list, items=str)
    index_segment: str | None = F(str, nil=True)  # the latest index segment's name (not a descriptor)
    shm_dir: str = F(str, DEFAULT_SHM_DIR)
    bytes: dict = F(dict)  # {total, <dtype>: bytes}
    expert_parallel: dict | None = F(dict, nil=True)
    leases: list = F(list, items=dict)
    generations: list = F(list, items=dict)
    job: JobState | None = F(JobState, nil=True)
    uptime_s: float = F(float)


def read_reply(cls: type[Reply], reply: dict, what: str):
    """A successful reply to `what` (a request, in the user's words) as `cls`: ProtocolError when a field is wrong."""
    return cls.from_wire(reply, f"the daemon's reply to {what}")
