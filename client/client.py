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
from expertd.protocol import default_endpoint
from expertd.security import Credentials
from expertd.shm import map_segments, view

from .hooks import run_model_hooks
from .parallel import bind_sharded, check_partition
from .quiet import attaching
from .restore import restore
from .variants import derive, fetch, log_casts, map_derived
from .views import IndexViews

log = logging.getLogger("expertd.client")


class ExpertClient:
    """A lease on a daemon's published weights.

    Attaching maps each segment once, read-only; `tensors()` and `load_model()` return views
    into those mappings. Leaving the `with` (or `close()`) releases the lease; views and models
    stay valid while the worker holds them, even if the daemon exits.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float = 30.0, heartbeat: bool = True,
                 copy_on_write: bool = False, token: str | None = None, on_update=None, push_token: str | None = None,
                 server_key: str | bytes | None = None, client_key: str | None = None, admin_token: str | None = None,
                 credentials=None, allow_plain_tcp_tokens: bool | None = None):
        self.endpoint = endpoint or os.environ.get("EXPERTD_ENDPOINT") or default_endpoint()
        self.timeout = timeout
        self.copy_on_write = copy_on_write
        # arguments, else $EXPERTD_TOKEN, _PUSH_TOKEN, _SERVER_KEY, _CLIENT_KEY, _ADMIN_TOKEN, _ALLOW_PLAIN_TCP_TOKENS
        self.credentials = credentials or Credentials.resolve(token, push_token, server_key, client_key, admin_token,
                                                              allow_plain_tcp_tokens)
        self.token = self.credentials.token
        # called with the new number, on the heartbeat thread, when a newer generation appears
        self.on_update = on_update
        self.generation: int | None = None  # the generation this client's lease reads
        self.latest_generation = 0  # the newest generation the daemon serves, from its last reply
        self._announced = 0
        self._conn = Connection(self.endpoint, timeout, credentials=self.credentials,
                                where=None if endpoint else "$EXPERTD_ENDPOINT")
        self._conn.on_reply = self._note_latest
        self._index: TensorIndex | None = None
        self._segments: dict[str, torch.Tensor] | None = None
        self._model_dtypes: dict[int, torch.dtype] = {}  # id(model) -> dtype it was loaded with
        self._closed = threading.Event()
        self._gone: GenerationGone | None = None  # the daemon restarted without the generation this client reads
        self._revoked: list[str] = []  # leases revoked for a push, released once refresh() has moved off them
        try:
            self._connect()
        except BaseException:
            self._conn.close()  # e.g. refused for a wrong token: leave no socket behind
            raise
        self._heartbeat = None
        if heartbeat:
            self._heartbeat = threading.Thread(target=self._beat, name="expertd-heartbeat", daemon=True)
            self._heartbeat.start()

    # --- what users call -------------------------------------------------------------------

    def index(self) -> TensorIndex:
        """The daemon's tensor index, waiting (up to the timeout) while it is still loading.

        Read from the generation's index segment that the lease (or refresh) reply names: mapped
        read-only and decoded here, so attaching workers do not queue behind each other's index bytes
        in the daemon's loop; a truncated or altered segment raises `CorruptIndex`."""
        self._check_gone()
        if self._index is None:
            if self._index_place is None:  # leased while the daemon was loading
                self._index_place = index_place(self._conn, self.lease, self.timeout)
            with attaching():
                self._index = index_segment.read(self._index_place)
            self.generation = self._index.generation
        return self._index

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by its checkpoint name, as a read-only view (bf16 where dequantized)."""
        segments = self._attach()
        return {name: view(segments, entry) for name, entry in self.index().checkpoint_entries().items()}

    def served_tensors(self) -> dict[str, torch.Tensor]:
        """Every served tensor by the model's parameter name (fused experts as whole blocks)."""
        segments = self._attach()
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
        from expertd.hf import empty_model

        index = self.index()
        with attaching(one_thread=True):
            model = empty_model(index.config, dtype)
            ep_rank, ep_size = None, 1
            if distributed_config is not None:
                from expertd.hf_distributed import distribute

                model, ep_rank, ep_size = distribute(model, distributed_config)
            check_partition(index, self.endpoint, ep_rank, ep_size)
            self._bind(model, index, dtype, strict=True)
            model.eval()
        self._model_dtypes[id(model)] = dtype
        # client/hooks.py: on_model_loaded, EXPERTD_MODEL_HOOKS, EXPERTD_CAPTURE_DIR / _SIMULATE_*
        run_model_hooks(model)
        return model

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
        where that differs from the served dtype the parameter maps the daemon's dtype variant of it."""
        dtype = dtype or getattr(model, "dtype", torch.bfloat16)
        self._model_dtypes[id(model)] = dtype
        with attaching():
            return self._bind(model, self.index(), dtype, strict)

    def refresh(self, model=None) -> list[str]:
        """Move to the latest generation; rebind in `model` (same object) only what changed.

        Returns the names of the model's parameters and buffers that were rebound, or without a
        model the served tensors that changed. `tensors()` / `served_tensors()` then return the new
        generation's views; views taken before stay valid and unchanged until they are dropped.
        """
        if self._gone is not None:  # the daemon restarted without our generation: lease the latest afresh
            old = self._index  # what the model holds: its bytes stay valid
            self._take_lease()
        else:
            old = self.index()
        try:
            reply = self._conn.send(messages.Refresh(client=self.lease), messages.IndexSegmentReply)
        except LeaseRevoked:  # our generation made room for a push (no heartbeat thread told us yet)
            self._move_on(self._conn, self.lease)
            reply = self._conn.send(messages.Refresh(client=self.lease), messages.IndexSegmentReply)
        self.generation, self._index_place = reply.generation, reply.index_segment
        self._index = None
        new = self.index()
        changed = moved(old.tensors if old else [], new.tensors)
        self._remap(new)
        done, self._revoked = self._revoked, []
        release(self._conn, done)  # this client no longer maps their generations (views handed out may)
        if model is None:
            return changed
        dtype = self._model_dtypes.get(id(model), getattr(model, "dtype", torch.bfloat16))
        return self._bind(model, new, dtype, strict=False, only=set(changed)).names

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
        generation = with_room(lambda: push(self._conn, self.lease, tensors, self.timeout), wait_for_room, log,
                               lambda: self._move_on(self._conn, self.lease))
        self.latest_generation = max(self.latest_generation, generation)
        return generation

    def reconnect(self) -> None:
        """Attach again, e.g. to a restarted daemon: new lease, fresh index and mappings.

        Views and models taken before stay valid (they keep their old mappings alive) but belong
        to the old generation; take new ones from `tensors()` / `load_model()`.
        """
        if self._closed.is_set():
            raise DaemonError("this client is closed; make a new ExpertClient")
        done, self._revoked = [self.lease, *self._revoked], []
        release(self._conn, done)  # the daemon that granted them may be gone
        self._conn.close()
        self._index = None
        self._segments = None
        self.generation = None
        self._gone = None
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
            release(self._conn, [self.lease, *self._revoked])
        finally:
            self._conn.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.timeout)
        # this client's own mappings go (views already handed out keep theirs): a retired generation's pages
        # are freed once no worker maps them
        self._segments = self._index = None

    def __enter__(self) -> "ExpertClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------

    def _connect(self) -> None:
        reply = lease_request(self._conn)  # handshake + lease
        self.lease = reply.client
        self._index_place = reply.index_segment or None  # none while the daemon is still loading
        self.lease_timeout_s = float(reply.lease_timeout_s)
        self.lease_lost = False
        self.latest_generation = self._announced = reply.latest

    def _take_lease(self, conn=None, generation: int | None = None) -> None:
        """A new lease (on `generation`, else the latest) replacing one the daemon no longer knows."""
        reply = lease_request(conn or self._conn, **({} if generation is None else {"generation": generation}))
        self.lease, self._gone = reply.client, None
        if generation is None:
            self._index_place = reply.index_segment or None
            self._index = None

    def _resume(self, conn, lost: str) -> None:
        """The daemon forgot our lease (it restarted, or we were silent too long): take one on the generation this
        client reads, which a successor that adopted it keeps; if that one is gone, the next call says so."""
        try:
            self._take_lease(conn, self.generation)
            release(conn, [lost])  # its generation no longer counts twice against this client's holder
            log.info("lease %s lost (%s); resumed generation %s as lease %s", lost, self.endpoint, self.generation,
                     self.lease)
        except GenerationGone as exc:
            self._gone = exc
            self.lease_lost = True
            log.warning("lease %s lost and generation %s is gone: %s", lost, self.generation, exc)

    def _move_on(self, conn, revoked: str) -> None:
        """Our generation's leases were revoked to make room for a push: lease the latest generation; what the
        model binds stays mapped (its pages valid) until refresh(), which releases the revoked lease."""
        index = self._index
        self._take_lease(conn)
        self._revoked.append(revoked)  # once the new lease is ours: whoever sees it revoked sees the new lease
        self._index = index
        log.warning("lease on generation %s revoked for a push (%s): leased the latest; refresh() to move the model",
                    self.generation, self.endpoint)

    def _check_gone(self) -> None:
        if self._gone is not None:
            raise self._gone

    def _note_latest(self, reply: dict) -> None:
        latest = reply.get("latest")
        if isinstance(latest, int) and latest > self.latest_generation:
            self.latest_generation = latest

    def _bind(self, model, index: TensorIndex, dtype: torch.dtype, strict: bool, only: set[str] | None = None):
        """Bind an index's views with the dtypes `from_pretrained(dtype=dtype)` gives (a private copy where the
        served dtype differs): transformers 5.x models by served names, 4.x models by checkpoint names."""
        from expertd.hf_dtypes import loaded_dtypes

        want = loaded_dtypes(model, dtype)
        views = IndexViews(index, self._attach(), want, only)
        need = views.mismatched(want)
        if need:
            self._variants(index, need, views)
        from expertd.hf_distributed import is_dtensor, reset_fsdp_shards, reshard

        if getattr(model.config, "distributed_config", None) is not None:
            reshard(model)  # a refresh after forward passes: FSDP2's root holds gathered parameters until then
        sharded = {name for name, p in model.named_parameters() if is_dtensor(p)}
        if not sharded:
            result = restore(model, views, strict=strict, dtypes=want, unexpected=False)
        else:
            # transformers' parallelism made DTensors of the sharded parameters: each gets its rank's shard of the
            # served tensor; the rest (buffers, unsharded parameters) binds as in any model
            shards = bind_sharded(model, views, {e.name: e for e in index.tensors}, only)
            result = restore(model, views, strict=strict, dtypes=want, unexpected=False, skip=sharded)
            result.names += shards
            result.bound += len(shards)
            reset_fsdp_shards(model)
        log_casts(model, dtype, index, views, need)
        return result

    def _variants(self, index: TensorIndex, need: dict[str, tuple[str, str]], views: IndexViews) -> None:
        """Map the dtype variants `need` names, made by the daemon once per host (`variants.fetch`)."""
        entries = fetch(self._conn, self.lease, index, need)
        self._map_entries(entries, index)
        views.variants.update({(e.name, e.dtype): e for e in entries})

    def derived(self, items: list[messages.GatherItem], trusted: int = 0) -> list[torch.Tensor]:
        """Read-only views of derived tensors of the generation this client reads (`expertd.derived.request`
        items: a served tensor gathered into an engine's layout), made by the daemon once per host; the last
        `trusted` of them are not checksummed (`map_derived`)."""
        self._check_gone()
        index = self.index()
        entries = derive(self._conn, self.lease, index, items)
        self._map_entries(entries, index, len(entries) - trusted)
        return [view(self._segments, e) for e in entries]

    def _map_entries(self, entries, index: TensorIndex, checked: int | None = None) -> None:
        self._attach()  # the segments of variant entries not mapped yet
        map_derived(self._segments, entries, index.shm_dir, self.copy_on_write, checked)

    def _remap(self, index: TensorIndex) -> None:
        """Map the segments a new index adds; forget those it no longer uses (views keep theirs alive)."""
        if self._segments is None:
            return
        keep = {s.name: self._segments[s.name] for s in index.segments if s.name in self._segments}
        keep.update(map_segments([s for s in index.segments if s.name not in keep], writable=self.copy_on_write,
                                 shm_dir=index.shm_dir))
        self._segments = keep

    def _attach(self) -> dict[str, torch.Tensor]:
        if self._segments is None:
            index = self.index()
            self._segments = map_segments(index.segments, writable=self.copy_on_write, shm_dir=index.shm_dir)
        return self._segments

    def _announce(self) -> None:
        """Call `on_update` with each newer generation's number, in order, none skipped (on the heartbeat thread:
        the daemon's replies name only the latest, so several published between two beats come at once)."""
        latest = self.latest_generation
        while self._announced < latest:
            self._announced += 1
            if self.on_update is not None:
                try:
                    self.on_update(self._announced)
                except Exception:
                    log.exception("on_update callback failed")

    def _beat(self) -> None:
        conn = None
        try:
            while True:
                lease, timeout_s = self.lease, self.lease_timeout_s  # reconnect() may change both
                if conn is None or conn.timeout_ms != int(min(self.timeout, timeout_s) * 1000):
                    if conn is not None:
                        conn.close()
                    conn = Connection(self.endpoint, timeout=min(self.timeout, timeout_s), credentials=self.credentials)
                if self._closed.wait(max(0.05, timeout_s / 3)):
                    return
                try:
                    self._note_latest(conn.send(messages.Heartbeat(client=lease)))
                    self._announce()
                except LeaseExpired:
                    if lease == self.lease and self._gone is None:
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
