"""Push tensors to daemons as a new generation: names and shapes over the socket, bytes through shared memory
(or, to a daemon on another host over tcp://, as frames of their own, sent without a copy).

`push` updates one daemon. `push_all` gives a trainer one call for a whole expert-parallel deployment: it
splits the state dict into each daemon's share (dense tensors to all, experts to the daemons that serve
them, a whole fused expert block cut into each daemon's rows), stages and builds everywhere with the
publication held, and publishes only once every daemon has built its share; any refusal aborts all.
"""

from __future__ import annotations

import time

import torch

from expertd import messages, replies
from expertd.connection import Connection
from expertd.errors import DaemonError, DaemonTimeout, ShmError, UpdateRejected
from expertd.index import TensorIndex, tensor_checksum
from expertd.leasing import lease_request
from expertd.protocol import STAGE_FRAME_BYTES, STAGE_MESSAGE_BYTES
from expertd.quantization import quantization_format
from expertd.security import Credentials
from expertd.segments import map_segment
from expertd.shm import segment_bytes

POLL_S = 0.01


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _checked(slot: replies.StagedTensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    raw = _raw(tensors[slot.name])
    if raw.numel() != slot.nbytes:
        raise UpdateRejected(f"tensor {slot.name!r}: {raw.numel()} bytes, the daemon staged {slot.nbytes}")
    return raw


def _write_staged(staging: messages.UpdateReply, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy the pushed bytes into the staging segment the daemon handed out; their checksums, in its order."""
    mapping = map_segment(staging.segment, staging.nbytes, shared_write=True, shm_dir=staging.shm_dir)
    try:
        data = segment_bytes(mapping)
        sums = []
        for slot in staging.tensors:
            raw = _checked(slot, tensors)
            data[slot.offset: slot.offset + slot.nbytes].copy_(raw)
            sums.append(tensor_checksum(raw))
        del data
        return sums
    finally:
        mapping.close()


def _send_staged(conn, lease: str, staging: messages.UpdateReply, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Send the pushed bytes as frames of `stage` requests (no shared memory with a daemon on another host):
    each request carries up to STAGE_MESSAGE_BYTES of one tensor in frames of at most STAGE_FRAME_BYTES."""
    sums = []
    for k, slot in enumerate(staging.tensors):
        raw = _checked(slot, tensors)
        data = memoryview(raw.numpy()) if raw.numel() else memoryview(b"")
        for at in range(0, max(len(data), 1), STAGE_MESSAGE_BYTES):
            piece = data[at: at + STAGE_MESSAGE_BYTES]
            frames = [piece[f: f + STAGE_FRAME_BYTES] for f in range(0, len(piece), STAGE_FRAME_BYTES)]
            if frames:
                conn.send(messages.Stage(client=lease, update=staging.update, tensor=k, at=at), messages.StageReply,
                          frames=frames)
        sums.append(tensor_checksum(raw))
    return sums


def _stage(conn, lease: str, tensors: dict[str, torch.Tensor]) -> tuple[messages.UpdateReply, list[str]]:
    """Ask for a staging area, fill it (shared memory on this host's ipc://, frames over tcp://); on a failure
    the daemon drops it at once instead of when this lease ends."""
    spec = [messages.PushedTensor(name=n, shape=list(t.shape), dtype=str(t.dtype)) for n, t in tensors.items()]
    staging = conn.send(messages.Update(client=lease, tensors=spec), messages.UpdateReply)
    try:
        if conn.endpoint.startswith("tcp://"):
            return staging, _send_staged(conn, lease, staging, tensors)
        try:
            return staging, _write_staged(staging, tensors)
        except ShmError as exc:  # a daemon of another uid whose shm_dir takes no ACL: only it writes the segment
            if not isinstance(exc.__cause__, PermissionError):
                raise
            return staging, _send_staged(conn, lease, staging, tensors)
    except BaseException:
        _abort(conn, lease, staging)
        raise


def _abort(conn, lease: str, staging: messages.UpdateReply) -> None:
    try:
        conn.send(messages.Abort(client=lease, update=staging.update), replies.Done)
    except Exception:  # the first failure is the one to report
        pass


def _wait(conn, job: messages.JobReply, timeout: float, until=("building", "built")) -> messages.JobReply:
    deadline = time.monotonic() + max(timeout, 1.0)
    while job.state in until:
        if time.monotonic() > deadline:
            raise DaemonTimeout(f"the daemon at {conn.endpoint} did not finish update job {job.job} "
                                f"within {timeout:.0f}s")
        time.sleep(POLL_S)
        job = conn.send(messages.Job(job=job.job), messages.JobReply)
    return job


def _failed(conn, job: messages.JobReply) -> DaemonError:
    error = job.error or None  # a failed job names its error; ABSENT otherwise
    cls = UpdateRejected if error == "UpdateRejected" else DaemonError
    return cls(f"the update failed at {conn.endpoint}: {error}: {job.message or None}", error)


def _check(tensors) -> None:
    if not isinstance(tensors, dict) or not tensors:
        raise UpdateRejected("update() needs a non-empty dict of name -> tensor")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise UpdateRejected(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")


def push(conn, lease: str, tensors: dict[str, torch.Tensor], timeout: float) -> int:
    """Stage `tensors`, commit them and wait until the daemon publishes them; returns the generation."""
    _check(tensors)
    staging, sums = _stage(conn, lease, tensors)
    job = conn.send(messages.Commit(client=lease, update=staging.update, checksums=sums), messages.JobReply)
    job = _wait(conn, job, timeout)
    if job.state != "published":
        raise _failed(conn, job)
    return job.generation


def share_of(index: TensorIndex, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The part of a pushed state dict that a daemon serving `index` takes: tensors it serves by served or
    checkpoint name, quantized ones with their aux tensors (the checkpoint's codec names them), a whole fused
    expert block (or its aux) cut to the experts it holds (`ExpertBlock.stack_rows`, the planner's rule)."""
    served = {t.name: t for t in index.tensors}
    names = index.checkpoint_entries()
    out = {}
    for name, (stored, aux) in quantization_format(index.config).logical(tensors).items():
        entry = served.get(name)
        if entry is None and stored not in names:
            continue
        block = entry.experts if entry is not None else None
        for n in (stored, aux) if aux is not None else (stored,):
            t = tensors[n]
            rows = block.stack_rows(t.shape) if block is not None and block.count != block.total else None
            out[n] = torch.cat([t[first: first + count] for first, count in rows]) if rows else t
    return out


def push_all(endpoints: list[str], tensors: dict[str, torch.Tensor], *, token: str | None = None,
             push_token: str | None = None, server_key: str | bytes | None = None, client_key: str | None = None,
             timeout: float = 60.0, admin_token: str | None = None,
             allow_plain_tcp_tokens: bool | None = None) -> dict[str, int]:
    """Push a state dict to every daemon of a deployment, each taking its own share; returns the generation
    each published. Nothing is published anywhere unless every daemon accepted and built its share: a name
    no daemon serves, a daemon that cannot be reached or that refuses, aborts them all. Credentials as for
    `ExpertClient` (a push needs the daemons' `push_token` or `admin_token`, or under CURVE a client key they allow to
    push; over tcp:// without CURVE no token is sent unless `allow_plain_tcp_tokens`)."""
    _check(tensors)
    credentials = Credentials.resolve(token, push_token, server_key, client_key, admin_token, allow_plain_tcp_tokens)
    if not endpoints:
        raise UpdateRejected("push_all() needs at least one endpoint")
    daemons = []  # (connection, lease, its share)
    try:
        for endpoint in endpoints:
            conn = Connection(endpoint, timeout, credentials=credentials)
            daemons.append([conn, None, None])
            daemons[-1][1] = lease_request(conn).client  # a local daemon drops it if we die
            index = TensorIndex.from_dict(conn.send(messages.Index())["index"])
            daemons[-1][2] = share_of(index, tensors)
        taken = {name for _, _, share in daemons for name in share}
        unserved = [name for name in tensors if name not in taken]
        if unserved:
            raise UpdateRejected(f"{len(unserved)} tensor(s) served by none of {', '.join(endpoints)}: "
                                 f"{', '.join(map(repr, unserved))}; nothing was published")
        return _publish_everywhere([(c, lease, share) for c, lease, share in daemons if share], timeout)
    finally:
        for conn, lease, _ in daemons:
            if lease is not None:
                try:
                    conn.send(messages.Release(client=lease))
                except Exception:  # the daemon is gone: its lease goes with it
                    pass
            conn.close()


def _publish_everywhere(daemons, timeout: float) -> dict[str, int]:
    """Stage and build every share with publication held, then publish all; abort all on any failure."""
    staged, jobs = [], []
    try:
        for conn, lease, share in daemons:
            staging, sums = _stage(conn, lease, share)
            staged.append((conn, lease, staging))
            jobs.append(conn.send(messages.Commit(client=lease, update=staging.update, checksums=sums, hold=True),
                                  messages.JobReply))
        jobs = [_wait(conn, job, timeout, until=("building",)) for (conn, _, _), job in zip(staged, jobs)]
        for (conn, _, _), job in zip(staged, jobs):
            if job.state != "built":
                raise _failed(conn, job)
    except BaseException:
        for conn, lease, staging in staged:
            _abort(conn, lease, staging)
        raise
    for (conn, lease, _), job in zip(staged, jobs):
        conn.send(messages.Publish(client=lease, job=job.job), messages.JobReply)
    done = {}
    for (conn, _, _), job in zip(staged, jobs):
        job = _wait(conn, job, timeout)
        if job.state != "published":
            raise _failed(conn, job)
        done[conn.endpoint] = job.generation
    return done
