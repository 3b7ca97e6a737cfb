"""The daemon: validate, bind the control socket, build generations in the background, serve until told to stop.

The control socket is a ZeroMQ ROUTER that answers small msgpack requests (see
`expertd.protocol`), each parsed into its request class (`expertd.messages`) and dispatched to the one handler
its components declare for it (`dispatch`). It answers `status` while a
generation is building. Every request gets a reply, errors included; no request can stop or
block the loop except `stop` itself. What is served, and how new generations are built and
published, is decided in `service`.
"""

from __future__ import annotations

import faulthandler
import gc
import grp
import hmac
import logging
import os
import signal
import sys
import threading
import time

import zmq

from expertd import messages, replies
from expertd.errors import AuthError, ExpertdError, ProtocolError
from expertd.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, error_reply, ipc_path, pack, runtime_base, unpack

from ..load.built import Cancelled
from ..restart.runstate import EndpointBusy, RunState, endpoint_answers
from ..serving.curve import Curve
from ..serving.dispatch import Dispatch, handles
from ..serving.peers import Peer, oversized, peer_of
from ..serving.permissions import Permissions
from .config import DaemonConfig
from .service import WeightService

log = logging.getLogger("expertd.daemon")

BURST = 256  # requests answered per wake-up before leases are swept again


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self._stop = threading.Event()
        self._hup = threading.Event()
        self._keep = False  # stopping hands the generations over (`stop --keep`, SIGUSR2) instead of removing them
        self.started = time.time()
        self.runstate = RunState(cfg.namespace, cfg.resolved_run_dir)
        self.weights = WeightService(cfg, self.runstate, self._stop.is_set)
        self.metrics = None  # DaemonMetrics from the socket bind on (load progress included), when metrics_port is set
        self.curve = None  # the CURVE authenticator of a tcp:// endpoint with curve_secret_key
        self._frozen: int | None = None  # the generation after whose publish `_freeze` froze the heap
        self.permissions = Permissions(cfg)  # what each request's credential may do (with `curve` once bound)
        w = self.weights
        self.dispatch = Dispatch(self, w, w.readers, w.pushes)  # one handler per request class, all of them

    # --- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        """Serve in the foreground; returns the process exit code."""
        self.runstate.acquire()
        try:
            return self._run()
        finally:
            self.runstate.release()
            if self.weights.abandoned:  # a build thread stuck past stop_timeout_s: end the process without it
                self.weights.sweep()  # what it made since the first sweep
                failed = sys.exc_info()[0] is not None
                logging.shutdown()
                os._exit(1 if failed else 0)

    def _prepare_first(self):
        """The checkpoint opened and planned for the first build; raises before anything is created."""
        from ..load.loader import prepare

        self.weights.device  # noqa: B018  (resolved now: a device this host lacks is a ConfigError, exit 2)
        ckpt, plan = prepare(self.cfg.checkpoint, self.cfg.expert_parallel, self.cfg.layout_cache)
        log.info("checkpoint %s: %d tensors to serve, %.1f MiB (%s layout, %s)",
                 self.cfg.checkpoint, len(plan.tensors), plan.nbytes / 2**20, plan.layout,
                 "read from the layout cache" if plan.layout_cached else "asked of transformers")
        return ckpt, plan

    def _run(self) -> int:
        self._check_endpoint_free()
        # a predecessor's generations, verified, are served again without reading the checkpoint; else load it
        adopted = self.weights.adopt(self.runstate.predecessor())
        if adopted is None:  # a first build: torch (and transformers, unless the layout is cached) before serving
            ckpt, plan = self._prepare_first()
        self.runstate.reap(self.cfg.shm_dir, keep=adopted.segments if adopted is not None else frozenset())
        if adopted is None:  # what a first build needs, said before the socket, the progress bar and any work
            from ..load.building import first_build_bytes
            from ..shm.arena import check_free
            from ..shm.shmdir import inspect as inspect_shm_dir

            shm = inspect_shm_dir(self.cfg.shm_dir, strict=False)
            check_free(shm, self.cfg.shm_dir, first_build_bytes(plan, shm.unit))
        ctx = zmq.Context()
        try:
            sock = self._bind(ctx)
        except BaseException:
            ctx.term()
            raise
        if self.cfg.metrics_port is not None:
            from .metrics import DaemonMetrics

            try:
                self.metrics = DaemonMetrics(self.cfg.metrics_host, self.cfg.metrics_port)
            except BaseException:
                sock.close(linger=0)
                ctx.term()
                raise
        signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in signals}
        faulthandler.register(signal.SIGQUIT, all_threads=True)  # every thread's Python stack to stderr, and go on
        if adopted is None:
            self.weights.start_load(ckpt, plan)
        else:
            self.weights.serve_adopted(adopted)
        try:
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set() and self.weights.load_error is None:
                if dict(poller.poll(1 if self.weights.deriving else 100)).get(sock):  # a slice ends: next at once
                    for _ in range(BURST):  # drain what is queued before the next poll
                        if not self._serve_one(sock):
                            break
                hup = self._hup.is_set() and self.weights.gens.latest is not None
                if hup:
                    self._hup.clear()
                self.weights.tick(reload_requested=hup)
                self._freeze()
                if self.metrics is not None:
                    self.metrics.refresh(self.weights.snapshot())
        finally:
            self._stop.set()
            if self.metrics is not None:
                self.metrics.close()
            sock.close(linger=0)
            if self.curve is not None:
                self.curve.stop()
            ctx.term()
            self.weights.close(keep=self._keep)
            if ipc_path(self.cfg.endpoint) is not None:
                try:
                    os.unlink(ipc_path(self.cfg.endpoint))
                except FileNotFoundError:
                    pass
            if not self._keep:
                self.runstate.remove()  # nothing of this run is left: segments, index, socket and now the manifest
            for s, h in old_handlers.items():
                signal.signal(s, h)
            faulthandler.unregister(signal.SIGQUIT)
        error = self.weights.load_error
        if error is not None and not isinstance(error, Cancelled):
            raise error
        log.info("stopped")
        return 0

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            log.info("received SIGHUP, reloading %s", self.cfg.checkpoint)
            self._hup.set()
            return
        if signum == signal.SIGUSR2:
            log.info("received SIGUSR2, stopping and leaving the generations for a successor")
            self._keep = True
        else:
            log.info("received %s, stopping", signal.Signals(signum).name)
        self._stop.set()

    def _gid(self) -> int | None:
        """The config's `group:` as a gid (None without one)."""
        return grp.getgrnam(self.cfg.group).gr_gid if self.cfg.group else None

    def _bind(self, ctx: zmq.Context) -> zmq.Socket:
        endpoint = self.cfg.endpoint
        path = ipc_path(endpoint)
        if path is not None:
            self.runstate.own_socket_folder(path, self._gid())  # checked again right before the bind
            if os.path.exists(path):
                if endpoint_answers(ctx, endpoint):
                    raise self._endpoint_busy()
                os.unlink(path)  # a socket file left by a daemon that died
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            self.curve = Curve.serve(ctx, sock, self.cfg) if self.cfg.curve_secret_key else None
            self.permissions = Permissions(self.cfg, self.curve)
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if self.curve is not None:
                self.curve.stop()
            raise ExpertdError(f"cannot bind control socket {endpoint}: {exc}") from exc
        try:
            if path is not None:
                if self.cfg.group:
                    os.chown(path, -1, grp.getgrnam(self.cfg.group).gr_gid)
                os.chmod(path, 0o660 if self.cfg.group else 0o600)
        except BaseException:
            sock.close(linger=0)  # an open socket would make ctx.term() wait forever
            os.unlink(path)
            raise
        log.info("control socket %s", endpoint)
        tokens = [k for k in ("auth_token", "push_token", "admin_token") if getattr(self.cfg, k) is not None]
        if path is None and self.curve is None and tokens:
            log.warning("%s has no CURVE: the %s travel in clear, and a local user who binds this port while the "
                        "daemon is down receives them; set curve_secret_key (clients send no token there unless "
                        "allow_plain_tcp_tokens)", endpoint, " and ".join(tokens))
        return sock

    def _check_endpoint_free(self) -> None:
        """Refuse at once (before a long load) when another daemon answers on our ipc:// endpoint."""
        path = ipc_path(self.cfg.endpoint)
        if path is not None:
            self.runstate.own_socket_folder(path, self._gid())  # someone else's folder or socket: exit 2 at once
        if path is not None and os.path.exists(path):
            ctx = zmq.Context()
            try:
                if endpoint_answers(ctx, self.cfg.endpoint):
                    raise self._endpoint_busy()
            finally:
                ctx.term()

    def _endpoint_busy(self) -> EndpointBusy:
        folder = os.path.dirname(ipc_path(self.cfg.endpoint) or runtime_base() + "/x")
        return EndpointBusy(
            f"another expertd daemon already answers on {self.cfg.endpoint}; each daemon needs its own endpoint: "
            f"set `endpoint:` in this config (e.g. endpoint: ipc://{folder}/{self.cfg.namespace}.sock), "
            "or stop the other daemon first"
        )

    # --- requests --------------------------------------------------------------------------

    def _freeze(self) -> None:
        """Once a generation is published, move every object alive then out of the cyclic collector's reach
        (`gc.freeze`): torch, transformers and a served index are hundreds of thousands of objects that live as long
        as the daemon, and a full collection scanning them stalled the request loop for 250-400 ms every second or two
        under a flood of casts. Objects freed later are still freed by their reference counts."""
        latest = self.weights.gens.latest
        number = latest.number if latest is not None else None
        if number is not None and number != self._frozen:
            self._frozen = number
            gc.collect()
            gc.freeze()

    def _serve_one(self, sock: zmq.Socket) -> bool:
        """Answer one queued request; False when none was queued."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)  # pushed bytes (`stage`) stay in zmq's buffers
        except zmq.Again:
            return False
        if len(frames) < 2:
            return True  # no routing identity: nobody to answer
        identity, data = frames[0].bytes, []
        msg, latest = None, True  # every reply names the latest generation, but one to an unexpected error
        try:
            oversized(frames)  # before anything is decoded; the frames go with the refusal
            if len(frames) >= 3 and frames[1].bytes == b"":  # REQ envelope: message, then a `stage` request's bytes
                payload, data = frames[2].bytes, frames[3:]
            elif len(frames) == 2:
                payload = frames[1].bytes
            else:
                raise ProtocolError("expected one message frame")
            msg = unpack(payload)
            # from the transport, beside the request, whatever the message said: who sent it and the bytes after it
            peer = peer_of(frames[-1], frames[-1].get("User-Id") if self.curve is not None else None, data,
                           self.curve.listed if self.curve is not None else None)
            if data and msg.get("op") != "stage":
                raise ProtocolError(f"op {str(msg.get('op'))[:40]!r} takes one message frame; only 'stage' carries "
                                    "bytes")
            reply = self.handle(msg, peer)
        except ExpertdError as exc:
            reply = error_reply(exc)
        except Exception as exc:  # a bug must not kill the daemon; the caller gets the message
            log.exception("error handling request")
            reply, latest = error_reply(exc), False
        if latest:
            reply["latest"] = self.weights.gens.latest.number if self.weights.gens.latest else 0
        if self.metrics is not None:
            self.metrics.request(msg.get("op") if isinstance(msg, dict) else None,
                                 reply.get("error") if not reply.get("ok", True) else None)
        envelope = [identity, b""] if len(frames) >= 3 else [identity]
        try:
            sock.send_multipart(envelope + [pack(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone
        return True

    def handle(self, msg: dict, peer: Peer) -> dict:
        """Check the token, parse the request (every field typed and bounded), check its permission, then run its
        handler (`dispatch`: its reply checked and made a map); a typed refusal becomes an error reply."""
        if self.cfg.auth_token is not None:
            token = msg.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.cfg.auth_token.encode()):
                raise AuthError("request lacks the daemon's auth token or carries a wrong one")
        try:
            request = messages.parse_request(msg)
            self.permissions.check(request, msg, peer)  # the permission its class declares, or PermissionDenied
            return self.dispatch(request, peer)
        except ExpertdError as exc:
            return error_reply(exc)

    @handles(messages.Hello)
    def op_hello(self, req: messages.Hello, peer: Peer) -> replies.HelloReply:
        return replies.HelloReply(protocol=PROTOCOL_VERSION, ready=self.weights.gens.latest is not None,
                                  generation=self.weights.status_generation(),
                                  lease_timeout_s=self.cfg.lease_timeout_s)

    @handles(messages.Status)
    def op_status(self, req: messages.Status, peer: Peer) -> replies.StatusReply:
        return self.status()

    @handles(messages.Stop)
    def op_stop(self, req: messages.Stop, peer: Peer) -> replies.Done:
        """Stop; with `keep`, leave the live generations in shared memory for a successor to adopt (a handover)."""
        self._keep = req.keep
        self._stop.set()
        return replies.Done()

    def status(self) -> replies.StatusReply:
        """The `status` reply: this daemon's own fields, and the weight service's snapshot (what metrics read too)."""
        snap = self.weights.snapshot()
        return replies.StatusReply(
            state="serving" if snap.latest is not None else "loading",
            pid=os.getpid(),
            namespace=self.cfg.namespace,
            endpoint=self.cfg.endpoint,
            checkpoint=snap.checkpoint,
            generation=snap.generation,
            tensors=snap.tensors,
            views=snap.views,
            segments=snap.segments,
            index_segment=snap.index_segment,
            shm_dir=self.cfg.shm_dir,
            bytes={"total": sum(snap.bytes_by_dtype.values()), **snap.bytes_by_dtype},
            expert_parallel=snap.expert_parallel,
            leases=snap.leases,
            generations=snap.generations,
            derived=snap.derived,
            job=snap.job,
            uptime_s=round(time.time() - self.started, 3),
        )
