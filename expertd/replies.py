"""The replies clients read, typed: one class per reply shape (`expertd.messages` names which op answers with which).

PROTOCOL.md §3 documents each; tests/golden/protocol pins their bytes. The daemon builds its replies from these
classes, the Python client reads them through the same classes (`read_reply`: a wrong field is a ProtocolError).
"""

from __future__ import annotations

from dataclasses import dataclass

from .index import DEFAULT_SHM_DIR
from .message_types import ABSENT, F, Message


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
class IndexReply(Reply):  # `index` without segment: the whole index inline, for tools that ask over the socket
    index: dict = F(dict, required=True)  # TensorIndex.to_dict()


@dataclass
class DerivedReply(Reply):
    generation: int = F(int, required=True)
    tensors: list = F(list, required=True, items=dict)  # one index entry per requested derived tensor, in request order
    building: bool = F(bool, ABSENT)  # true: a large request being made off the request loop: ask again (tensors: [])


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
    derived: dict = F(dict)  # derived tensors: bytes and files (in pages), limits, per reader, the derivation job
    job: JobState | None = F(JobState, nil=True)
    uptime_s: float = F(float)


def read_reply(cls: type[Reply], reply: dict, what: str):
    """A successful reply to `what` (a request, in the user's words) as `cls`: ProtocolError when a field is wrong."""
    return cls.from_wire(reply, f"the daemon's reply to {what}")
