"""ExpertClient: attach to a running daemon and get zero-copy views and a ready transformers model."""

from __future__ import annotations

import logging
import os
import threading

import torch
import zmq

from expertd import index_segment, messages
from expertd.connection import Connection
from expertd.errors import DaemonError, ExpertdError, GenerationGone, LeaseExpired, LeaseRevoked
from expertd.index import TensorIndex, moved
from expertd.leasing import corrupted_tensors, index_place, lease_request, release, with_room
from expertd.option_words import CLI, OptionWords
from expertd.protocol import default_endpoint
from expertd.security import Credentials
from expertd.shm import view

from .binder import ModelBinder
from .lease_state import LeaseState
from .quiet import attaching

log = logging.getLogger("expertd.client")


class ExpertClient:
    """A lease on a daemon's published weights.

    Attaching maps each segment once, read-only; `tensors()` and `load_model()` return views
    into those mappings. Leaving the `with` (or `close()`) releases the lease; views and models
    stay valid while the worker holds them, even if the daemon exits.

    The lease and what hangs on it (its generation, index, revoked leases) live in a `LeaseState`, which the
    heartbeat thread changes under its lock; binding views into models is the composed `ModelBinder`'s.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float = 30.0, heartbeat: bool = True,
                 copy_on_write: bool = False, token: str | None = None, on_update=None, push_token: str | None = None,
                 server_key: str | bytes | None = None, client_key: str | None = None, admin_token: str | None = None,
                 credentials=None, allow_plain_tcp_tokens: bool | None = None, words: OptionWords = CLI):
        self.endpoint = endpoint or os.environ.get("EXPERTD_ENDPOINT") or default_endpoint()
        self.timeout = timeout
        self.copy_on_write = copy_on_write
        # arguments, else $EXPERTD_TOKEN, _PUSH_TOKEN, _SERVER_KEY, _CLIENT_KEY, _ADMIN_TOKEN, _ALLOW_PLAIN_TCP_TOKENS
        self.credentials = credentials or Credentials.resolve(token, push_token, server_key, client_key, admin_token,
                                                              allow_plain_tcp_tokens)
        self.token = self.credentials.token
        # called with the new number, on the heartbeat thread, when a newer generation appears
        self.on_update = on_update
        self.words = words  # how its hints name the options (an engine's keys: `expertd.option_words`)
        self._lease_state = LeaseState()
        self._conn = Connection(self.endpoint, timeout, credentials=self.credentials,
                                where=None if endpoint else "$EXPERTD_ENDPOINT", words=words)
        self._conn.on_reply = self._note_latest
        self._binder = ModelBinder(self._conn, self.endpoint, lambda: self.lease, self.index, copy_on_write)
        self._closed = threading.Event()
        try:
            self._connect()
        except BaseException:
            self._conn.close()  # e.g. refused for a wrong token: leave no socket behind
            raise
        self._heartbeat = None
        if heartbeat:
            self._heartbeat = threading.Thread(target=self._beat, name="expertd-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def lease(self) -> str | None:
        """The id of the lease this client holds (the heartbeat may replace it: a lost lease resumed, a revoked one
        moved on from)."""
        return self._lease_state.snapshot().lease

    @property
    def generation(self) -> int | None:
        """The generation this client's lease reads (None until its index is read)."""
        return self._lease_state.snapshot().generation

    @property
    def latest_generation(self) -> int:
        """The newest generation the daemon serves, from its last reply."""
        return self._lease_state.snapshot().latest

    @property
    def lease_timeout_s(self) -> float:
        """How long the daemon keeps a lease without a heartbeat (it beats every third of that)."""
        return self._lease_state.snapshot().timeout_s

    @property
    def lease_lost(self) -> bool:
        """A lease was lost and the generation it read is gone (the next call raises GenerationGone)."""
        return self._lease_state.snapshot().lost

    # --- what users call -------------------------------------------------------------------

    def index(self) -> TensorIndex:
        """The daemon's tensor index, waiting (up to the timeout) while it is still loading.

        Read from the generation's index segment that the lease (or refresh) reply names: mapped
        read-only and decoded here, so attaching workers do not queue behind each other's index bytes
        in the daemon's loop; a truncated or altered segment raises `CorruptIndex`."""
        self._check_gone()
        while True:
            state = self._lease_state.snapshot()
            if state.index is not None:
                return state.index
            place = state.place or index_place(self._conn, state.lease, self.timeout)  # none: leased while loading
            with attaching():
                index = index_segment.read(place)
            if self._lease_state.install_index(state.epoch, place, index):  # else the lease moved meanwhile: again
                return index

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by its checkpoint name, as a read-only view (bf16 where dequantized)."""
        segments = self._binder.attach()
        return {name: view(segments, entry) for name, entry in self.index().checkpoint_entries().items()}

    def served_tensors(self) -> dict[str, torch.Tensor]:
        """Every served tensor by the model's parameter name (fused experts as whole blocks)."""
        segments = self._binder.attach()
        return {entry.name: view(segments, entry) for entry in self.index().tensors}

    def load_model(self, dtype: torch.dtype = torch.bfloat16, distributed_config=None):
        """The transformers model for the served config, in eval mode, every weight a shared view.

        The model is built under accelerate's `init_empty_weights`, then each parameter is bound to
        its view with the dtype `from_pretrained(dtype=dtype)` would give it (fp32 where
        transformers keeps a module in fp32, such as DeepSeek-V3's `e_score_correction_bias`).

        With `distributed_config` (a transformers `DistributedConfig`, inside an initialised
        torch.distributed process group, e.g. under torchrun) the model is the one
        `from_pretrained(..., distributed_config=...)` returns — transformers' own expert parallelism
        and FSDP2, same modules, hooks and DTensor placements — and each rank's local shards are views
        of this host's shared memory. A daemon that serves only some EP ranks' experts (`expert_parallel`
        in its config) accepts only workers of those ranks and of its EP size (`PartitionError`).

        Last, the model hooks run once on the model (`expertd.client.hooks`: `on_model_loaded(fn)`,
        `EXPERTD_MODEL_HOOKS`, and the tools' capture / simulation when `EXPERTD_CAPTURE_DIR` / `EXPERTD_SIMULATE_*`
        are set).
        """
        return self._binder.load_model(dtype, distributed_config)

    def private_tensors(self, model) -> list[str]:
        """Names of `model`'s parameters and loaded buffers that are not in this daemon's shared memory (read-only
        shared mappings of its segments): [] for a model `load_model()` gave."""
        from .residency import private_tensors

        return private_tensors(model, self.index().shm_dir)

    def status(self) -> dict:
        """The daemon's status map (PROTOCOL.md `status`), read through messages.StatusReply: checked field by field."""
        self._check_gone()
        return self._conn.send(messages.Status(), messages.StatusReply).wire()

    def restore(self, model, dtype: torch.dtype | None = None, strict: bool = True):
        """Bind this client's views into a model you built (transformers 4.x per-expert or 5.x fused
        modules), with the dtypes `from_pretrained(dtype=dtype)` gives (default: the model's dtype);
        where that differs from the served dtype the parameter maps the daemon's dtype cast of it."""
        return self._binder.restore(model, dtype, strict)

    def refresh(self, model=None) -> list[str]:
        """Move to the latest generation; rebind in `model` (same object) only what changed.

        Returns the names of the model's parameters and buffers that were rebound, or without a
        model the served tensors that changed. `tensors()` / `served_tensors()` then return the new
        generation's views; views taken before stay valid and unchanged until they are dropped.
        """
        state = self._lease_state.snapshot()
        if state.gone is not None:  # the daemon restarted without our generation: lease the latest afresh
            old = state.index  # what the model holds: its bytes stay valid
            self._take_lease(state.lease)
        else:
            old = self.index()
        self._refresh_lease()
        new = self.index()
        changed = moved(old.tensors if old else [], new.tensors)
        self._binder.remap(new)
        # this client no longer maps their generations (views handed out may)
        release(self._conn, self._lease_state.take_revoked())
        if model is None:
            return changed
        return self._binder.rebind(model, new, changed)

    def update(self, tensors: dict[str, torch.Tensor], wait_for_room: float = 120.0) -> int:
        """Publish a new generation in which `tensors` have these values and everything else is shared.

        Names are checkpoint names (per-expert) or served names (fused blocks); values in the served
        dtype are taken as they are; a quantized weight is pushed in the checkpoint's format (FP8 with its
        `*_scale_inv` or `*_scale`, MXFP4 `*_blocks` with `*_scales`) and dequantized as at load. The bytes
        go through a staging segment, not the socket. Returns the new generation. While readers pin the old
        generations (`max_generations`) it waits up to `wait_for_room` seconds for the daemon to revoke the oldest
        one's leases (`revoke_after_s`), then proceeds (its own lease revoked too: it leases the latest, as a
        heartbeat would, and pushes); else the GenerationLimit is raised. A daemon building (a reload, a successor's
        check, another pusher's update) is waited for within the same time, else Busy is raised.
        """
        from .push import push

        self._check_gone()
        pushed = []  # the lease each try pushed with: the one a refusal revoked

        def push_once():
            pushed.append(self.lease)
            return push(self._conn, pushed[-1], tensors, self.timeout)

        generation = with_room(push_once, wait_for_room, log, lambda: self._move_on(self._conn, pushed[-1]))
        self._lease_state.note_latest(generation)
        return generation

    def reconnect(self) -> None:
        """Attach again, e.g. to a restarted daemon: new lease, fresh index and mappings.

        Views and models taken before stay valid (they keep their old mappings alive) but belong
        to the old generation; take new ones from `tensors()` / `load_model()`.
        """
        if self._closed.is_set():
            raise DaemonError("this client is closed; make a new ExpertClient")
        release(self._conn, self._lease_state.detach())  # the daemon that granted them may be gone
        self._conn.close()
        self._binder.forget()
        self._connect()

    def verify(self) -> list[str]:
        """Names of served tensors whose bytes in shared memory no longer match the index checksums."""
        return corrupted_tensors(self.index())

    def close(self) -> None:
        """Release the lease. Views already handed out stay valid."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:  # a daemon gone, or that dropped us already, has nothing to release
            release(self._conn, self._lease_state.close())  # a lease the heartbeat takes after this, it releases
        finally:
            self._conn.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.timeout)
        # this client's own mappings go (views already handed out keep theirs): a retired generation's pages
        # are freed once no worker maps them
        self._binder.forget()

    def __enter__(self) -> "ExpertClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------

    def _connect(self) -> None:
        reply = lease_request(self._conn)  # handshake + lease
        # the index place is none while the daemon is still loading
        self._lease_state.attach(reply.client, reply.index_segment or None, float(reply.lease_timeout_s), reply.latest)

    def _take_lease(self, old: str, conn=None, generation: int | None = None) -> bool:
        """A new lease (on `generation`, else the latest) replacing `old`, which the daemon no longer knows; False
        (the new one released) when `old` was replaced meanwhile by the other thread, or the client let it go."""
        conn = conn or self._conn
        reply = lease_request(conn, **({} if generation is None else {"generation": generation}))
        if generation is None:
            taken = self._lease_state.lease_latest(old, reply.client, reply.index_segment or None)
        else:
            taken = self._lease_state.resume(old, reply.client)
        if not taken:
            release(conn, [reply.client])
        return taken

    def _refresh_lease(self) -> None:
        """Move the lease to the latest generation (the daemon's `refresh`), on whichever lease is current."""
        revoked = False
        while True:
            lease = self.lease
            try:
                reply = self._conn.send(messages.Refresh(client=lease), messages.IndexSegmentReply)
            except LeaseRevoked:  # our generation made room for a push (no heartbeat thread told us yet)
                if revoked:
                    raise
                revoked = True
                self._move_on(self._conn, lease)
                continue
            if self._lease_state.refreshed(lease, reply.generation, reply.index_segment):
                return  # else the heartbeat replaced the lease meanwhile: refresh that one

    def _resume(self, conn, lost: str) -> None:
        """The daemon forgot our lease (it restarted, or we were silent too long): take one on the generation this
        client reads, which a successor that adopted it keeps; if that one is gone, the next call says so."""
        generation = self.generation
        try:
            if not self._take_lease(lost, conn, generation):
                return
            release(conn, [lost])  # its generation no longer counts twice against this client's holder
            log.info("lease %s lost (%s); resumed generation %s as lease %s", lost, self.endpoint, generation,
                     self.lease)
        except GenerationGone as exc:
            if self._lease_state.mark_gone(lost, exc):
                log.warning("lease %s lost and generation %s is gone: %s", lost, generation, exc)

    def _move_on(self, conn, revoked: str) -> None:
        """Our generation's leases were revoked to make room for a push: lease the latest generation; what the
        model binds stays mapped (its pages valid) until refresh(), which releases the revoked lease."""
        reply = lease_request(conn)
        if not self._lease_state.move_on(revoked, reply.client, reply.index_segment or None):
            release(conn, [reply.client])  # the other thread moved on first, or the client let the lease go
            return
        log.warning("lease on generation %s revoked for a push (%s): leased the latest; refresh() to move the model",
                    self.generation, self.endpoint)

    def _check_gone(self) -> None:
        gone = self._lease_state.snapshot().gone
        if gone is not None:
            raise gone

    def _note_latest(self, reply: dict) -> None:
        latest = reply.get("latest")
        if isinstance(latest, int):
            self._lease_state.note_latest(latest)

    def derived(self, items: list[messages.GatherItem], trusted: int = 0) -> list[torch.Tensor]:
        """Read-only views of derived tensors of the generation this client reads (`expertd.derived.request`
        items: a served tensor gathered into an engine's layout), made by the daemon once per host; the last
        `trusted` of them are not checksummed (`map_derived`)."""
        self._check_gone()
        return self._binder.derived(items, trusted)

    def _attach(self) -> dict[str, torch.Tensor]:
        return self._binder.attach()

    def _announce(self) -> None:
        """Call `on_update` with each newer generation's number, in order, none skipped (on the heartbeat thread:
        the daemon's replies name only the latest, so several published between two beats come at once)."""
        while (number := self._lease_state.next_announcement()) is not None:
            if self.on_update is not None:
                try:
                    self.on_update(number)
                except Exception:
                    log.exception("on_update callback failed")

    def _beat(self) -> None:
        conn = None
        try:
            while True:
                state = self._lease_state.snapshot()  # reconnect() may change the lease and its timeout
                lease, timeout_s = state.lease, state.timeout_s
                if conn is None or conn.timeout_ms != int(min(self.timeout, timeout_s) * 1000):
                    if conn is not None:
                        conn.close()
                    conn = Connection(self.endpoint, timeout=min(self.timeout, timeout_s), credentials=self.credentials,
                                      words=self.words)
                if self._closed.wait(max(0.05, timeout_s / 3)):
                    return
                try:
                    self._note_latest(conn.send(messages.Heartbeat(client=lease)))
                    self._announce()
                except LeaseExpired:
                    now = self._lease_state.snapshot()
                    if lease == now.lease and now.gone is None:
                        self._resume(conn, lease)
                except LeaseRevoked:
                    if lease == self.lease:
                        self._move_on(conn, lease)
                except DaemonError as exc:
                    log.warning("heartbeat refused: %s", exc)
                except (ExpertdError, zmq.ZMQError) as exc:  # the thread must outlive any one failed beat
                    log.warning("heartbeat failed: %s", exc)
        finally:
            if conn is not None:
                conn.close()
