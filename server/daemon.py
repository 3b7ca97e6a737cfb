"""The daemon: validate, bind the control socket, load in the background, serve until told to stop.

The control socket is a ZeroMQ ROUTER that answers small msgpack requests (see
`expertd.protocol`). It answers `status` while the model is still loading. Every request gets a
reply, errors included; no request can stop or block the loop except `stop` itself.
"""

from __future__ import annotations

import grp
import hmac
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import zmq

from expertd.errors import AuthError, ExpertdError, ProtocolError
from expertd.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, error_reply, pack, unpack

from .config import DaemonConfig
from .loader import Cancelled, Loaded, load, prepare
from .runstate import RunState

log = logging.getLogger("expertd.daemon")

BURST = 256  # requests answered per wake-up before leases are swept again


@dataclass
class Lease:
    client: str
    pid: int
    created: float
    seen: float


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.loaded: Loaded | None = None
        self.load_error: BaseException | None = None
        self.leases: dict[str, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._stop = threading.Event()
        self.started = time.time()
        self.generation = 1
        self.runstate = RunState(cfg.namespace, cfg.resolved_run_dir)
        self._index_reply: bytes | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        """Serve in the foreground; returns the process exit code."""
        self.runstate.acquire()
        try:
            return self._run()
        finally:
            self.runstate.release()

    def _run(self) -> int:
        ckpt, plan = prepare(self.cfg.checkpoint)  # raises before anything is created
        log.info("checkpoint %s: %d tensors to serve, %.1f MiB (%s layout)",
                 self.cfg.checkpoint, len(plan.tensors), plan.nbytes / 2**20, plan.layout)
        self.runstate.reap()
        self.generation = self.runstate.next_generation()
        ctx = zmq.Context()
        try:
            sock = self._bind(ctx)
        except BaseException:
            ctx.term()
            raise
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        loader = threading.Thread(target=self._load, args=(ckpt, plan), name="expertd-loader", daemon=True)
        loader.start()
        try:
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            while not self._stop.is_set():
                if self.load_error is not None:
                    break
                if dict(poller.poll(100)).get(sock):
                    for _ in range(BURST):  # drain what is queued before the next poll
                        if not self._serve_one(sock):
                            break
                self._expire_leases()
        finally:
            self._stop.set()
            loader.join()
            sock.close(linger=0)
            ctx.term()
            self._cleanup()
            for s, h in old_handlers.items():
                signal.signal(s, h)
        if self.load_error is not None and not isinstance(self.load_error, Cancelled):
            raise self.load_error
        log.info("stopped")
        return 0

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self._stop.set()

    def _bind(self, ctx: zmq.Context) -> zmq.Socket:
        endpoint = self.cfg.endpoint
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.stat(folder).st_mode & 0o077 and not self.cfg.group:
                log.warning("socket folder %s is accessible to other users; expertd makes its own folders 0700", folder)
            if os.path.exists(path):
                if _endpoint_answers(ctx, endpoint):
                    raise ExpertdError(f"another daemon already serves {endpoint}")
                os.unlink(path)  # a socket file left by a daemon that died
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ExpertdError(f"cannot bind control socket {endpoint}: {exc}") from exc
        try:
            if endpoint.startswith("ipc://"):
                path = endpoint[len("ipc://"):]
                if self.cfg.group:
                    os.chown(path, -1, grp.getgrnam(self.cfg.group).gr_gid)
                os.chmod(path, 0o660 if self.cfg.group else 0o600)
        except BaseException:
            sock.close(linger=0)  # an open socket would make ctx.term() wait forever
            os.unlink(endpoint[len("ipc://"):])
            raise
        log.info("control socket %s", endpoint)
        return sock

    def _load(self, ckpt, plan) -> None:
        try:
            self.loaded = load(
                ckpt, plan,
                namespace=self.cfg.namespace, generation=self.generation, segment_bytes=self.cfg.segment_bytes,
                device=self.cfg.device, index_path=self.cfg.index_path, progress=self.cfg.progress,
                should_stop=self._stop.is_set, on_placed=self._record_segments, group=self.cfg.group,
            )
            segments = [s.name for s in self.loaded.index.segments]
            self.runstate.write_manifest(self.generation, segments, "serving", self.cfg.endpoint)
            log.info("serving generation %d on %s", self.generation, self.cfg.endpoint)
        except BaseException as exc:  # reported by the main loop, which then exits non-zero
            if not isinstance(exc, Cancelled):
                log.error("loading failed: %s", exc)
            self.load_error = exc

    def _record_segments(self, names: list[str]) -> None:
        self.runstate.write_manifest(self.generation, names, "loading", self.cfg.endpoint)

    def _cleanup(self) -> None:
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None
            try:
                os.unlink(self.cfg.index_path)
            except FileNotFoundError:
                pass
        if self.cfg.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.cfg.endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass
        self.runstate.write_manifest(self.generation, [], "stopped", self.cfg.endpoint)

    # --- requests --------------------------------------------------------------------------

    def _serve_one(self, sock: zmq.Socket) -> bool:
        """Answer one queued request; False when none was queued."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(frames) < 2:
            return True  # no routing identity: nobody to answer
        identity, payload = frames[0], frames[-1]
        try:
            if len(frames) > 3 or (len(frames) == 3 and frames[1] != b""):
                raise ProtocolError("expected one message frame")
            reply = self.handle(unpack(payload))
        except ExpertdError as exc:
            reply = error_reply(exc)
        except Exception as exc:  # a bug must not kill the daemon; the caller gets the message
            log.exception("error handling request")
            reply = error_reply(exc)
        envelope = [identity, b""] if len(frames) == 3 else [identity]
        try:
            sock.send_multipart(envelope + [reply if isinstance(reply, bytes) else pack(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone
        return True

    def handle(self, msg: dict) -> dict | bytes:
        op = msg["op"]
        if self.cfg.auth_token is not None:
            token = msg.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.cfg.auth_token.encode()):
                raise AuthError("request lacks the daemon's auth token or carries a wrong one")
        if op == "hello":
            version = msg.get("protocol")
            if version != PROTOCOL_VERSION:
                raise ProtocolError(f"client speaks protocol {version!r}, daemon speaks {PROTOCOL_VERSION}")
            return {"ok": True, "protocol": PROTOCOL_VERSION, "ready": self.loaded is not None,
                    "generation": self.generation, "lease_timeout_s": self.cfg.lease_timeout_s}
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "stop":
            self._stop.set()
            return {"ok": True}
        if op == "index":
            if self.loaded is None:
                return {"ok": False, "error": "NotReady", "message": "the daemon is still loading"}
            if self._index_reply is None:  # packed once per generation: attach cost stays O(1) here
                self._index_reply = pack({"ok": True, "index": self.loaded.index.to_wire()})
            return self._index_reply
        if op == "lease":
            if "protocol" in msg and msg["protocol"] != PROTOCOL_VERSION:
                raise ProtocolError(f"client speaks protocol {msg['protocol']!r}, daemon speaks {PROTOCOL_VERSION}")
            pid = msg.get("pid", 0)
            if not isinstance(pid, int) or not 0 <= pid < 2**31:
                raise ProtocolError("'pid' must be a non-negative integer")
            now = time.monotonic()
            client = f"c{next(self._lease_ids)}"
            self.leases[client] = Lease(client, pid, now, now)
            return {"ok": True, "client": client, "lease_timeout_s": self.cfg.lease_timeout_s}
        client = msg.get("client")
        if not isinstance(client, str):
            raise ProtocolError(f"op {op!r} needs a string 'client' (the lease id)")
        lease = self.leases.get(client)
        if op == "heartbeat":
            if lease is None:
                return {"ok": False, "error": "LeaseExpired", "message": f"no lease {client!r} (expired or released)"}
            lease.seen = time.monotonic()
            return {"ok": True}
        if op == "release":
            self.leases.pop(client, None)
            return {"ok": True}
        raise ProtocolError(f"op {op!r} is not handled")

    def status(self) -> dict:
        now = time.monotonic()
        index = self.loaded.index if self.loaded else None
        by_dtype = index.total_bytes_by_dtype() if index else {}
        return {
            "state": "serving" if index else "loading",
            "pid": os.getpid(),
            "namespace": self.cfg.namespace,
            "endpoint": self.cfg.endpoint,
            "checkpoint": self.cfg.checkpoint,
            "generation": self.generation,
            "tensors": len(index.tensors) if index else 0,
            "views": len(index.all_views()) if index else 0,
            "segments": [s.name for s in index.segments] if index else [],
            "bytes": {"total": sum(by_dtype.values()), **by_dtype},
            "leases": [
                {"client": l.client, "pid": l.pid, "age_s": round(now - l.created, 3), "idle_s": round(now - l.seen, 3)}
                for l in self.leases.values()
            ],
            "uptime_s": round(time.time() - self.started, 3),
        }

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for client, lease in list(self.leases.items()):
            if now - lease.seen > self.cfg.lease_timeout_s:
                log.info("lease %s (pid %d) expired after %.1fs without heartbeat", client, lease.pid, now - lease.seen)
                del self.leases[client]


def _endpoint_answers(ctx: zmq.Context, endpoint: str, timeout_ms: int = 500) -> bool:
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    try:
        sock.connect(endpoint)
        sock.send(pack({"op": "status"}))
        sock.recv()
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)
