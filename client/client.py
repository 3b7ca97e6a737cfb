"""ExpertClient: attach to a running daemon and get zero-copy views and a ready transformers model."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time

import torch
import zmq

from expertd.errors import DaemonError, DaemonTimeout, ExpertdError
from expertd.index import TensorIndex
from expertd.protocol import DEFAULT_ENDPOINT, PROTOCOL_VERSION

from .connection import Connection
from .restore import restore
from expertd.shm import map_segment, segment_bytes, view

log = logging.getLogger("expertd.client")



@contextlib.contextmanager
def _gc_paused():
    """No cyclic GC while attach allocates its many small objects.

    In a worker that has torch and transformers loaded, one full collection walks millions of
    objects (~0.25 s here) and attach would pay it at random; it runs after, at a time that is ours.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ExpertClient:
    """A lease on a daemon's published weights.

    Attaching maps each segment once, read-only; `tensors()` and `load_model()` return views
    into those mappings. Leaving the `with` (or `close()`) releases the lease; views and models
    stay valid while the worker holds them, even if the daemon exits.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float = 30.0, heartbeat: bool = True,
                 copy_on_write: bool = False, token: str | None = None):
        self.endpoint = endpoint or os.environ.get("EXPERTD_ENDPOINT", DEFAULT_ENDPOINT)
        self.timeout = timeout
        self.copy_on_write = copy_on_write
        self.token = token
        self._conn = Connection(self.endpoint, timeout, token=token)
        self._index: TensorIndex | None = None
        self._segments: dict[str, torch.Tensor] | None = None
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

    # --- what users call -------------------------------------------------------------------

    def index(self) -> TensorIndex:
        """The daemon's tensor index, waiting (up to the timeout) while it is still loading."""
        if self._index is None:
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    with _gc_paused():
                        self._index = TensorIndex.from_dict(self._conn.request("index", client=self.lease)["index"])
                    break
                except DaemonError as exc:
                    if getattr(exc, "kind", None) != "NotReady":
                        raise
                    if time.monotonic() > deadline:
                        raise DaemonTimeout(f"daemon at {self.endpoint} still loading after {self.timeout:.0f}s") from exc
                    time.sleep(0.05)
        return self._index

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by its checkpoint name, as a read-only view (bf16 where dequantized)."""
        segments = self._attach()
        return {name: view(segments, entry) for name, entry in self.index().checkpoint_entries().items()}

    def served_tensors(self) -> dict[str, torch.Tensor]:
        """Every served tensor by the model's parameter name (fused experts as whole blocks)."""
        segments = self._attach()
        return {entry.name: view(segments, entry) for entry in self.index().tensors}

    def load_model(self, dtype: torch.dtype = torch.bfloat16):
        """The transformers model for the served config, in eval mode, every weight a shared view.

        The model is built under accelerate's `init_empty_weights`, then each parameter is bound to
        its view with the dtype `from_pretrained(dtype=dtype)` would give it (fp32 where
        transformers keeps a module in fp32, such as DeepSeek-V3's `e_score_correction_bias`).
        """
        from expertd.hf import empty_model, loaded_dtypes

        index = self.index()
        with _gc_paused():
            model = empty_model(index.config, dtype)
            want = loaded_dtypes(model, dtype)
            views = self.served_tensors()
            for name, tensor in views.items():
                if name in want and tensor.dtype != want[name]:
                    log.warning("%s is served as %s but the model needs %s: using a private copy", name, tensor.dtype, want[name])
                    views[name] = tensor.to(want[name])
            restore(model, views, strict=True, dtypes=want)
            model.eval()
        from .capture import capture_from_env  # EXPERTD_CAPTURE_DIR set: capture activations, no code changes

        capture_from_env(model)
        return model

    def status(self) -> dict:
        return self._conn.request("status")

    def reconnect(self) -> None:
        """Attach again, e.g. to a restarted daemon: new lease, fresh index and mappings.

        Views and models taken before stay valid (they keep their old mappings alive) but belong
        to the old generation; take new ones from `tensors()` / `load_model()`.
        """
        if self._closed.is_set():
            raise DaemonError("this client is closed; make a new ExpertClient")
        try:
            self._conn.request("release", client=self.lease)
        except (DaemonError, DaemonTimeout):
            pass  # the daemon that granted it is gone
        self._conn.close()
        self._index = None
        self._segments = None
        self._connect()

    def verify(self) -> list[str]:
        """Names of served tensors whose bytes in shared memory no longer match the index checksums."""
        from expertd.index import checksum

        segments = self._attach()
        bad = []
        for entry in self.index().tensors:
            if entry.checksum is None:
                continue
            data = view(segments, entry).reshape(-1).view(torch.uint8)
            if checksum(memoryview(data.numpy()) if data.numel() else b"") != entry.checksum:
                bad.append(entry.name)
        return bad

    def close(self) -> None:
        """Release the lease. Views already handed out stay valid."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._conn.request("release", client=self.lease)
        except (DaemonError, DaemonTimeout):
            pass  # the daemon is gone or already dropped us: nothing to release
        finally:
            self._conn.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.timeout)

    def __enter__(self) -> "ExpertClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------

    def _connect(self) -> None:
        reply = self._conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)  # handshake + lease
        self.lease = reply["client"]
        self.lease_timeout_s = float(reply["lease_timeout_s"])
        self.lease_lost = False

    def _attach(self) -> dict[str, torch.Tensor]:
        if self._segments is None:
            index = self.index()
            self._segments = {
                s.name: segment_bytes(map_segment(s.name, s.nbytes, writable=self.copy_on_write)) for s in index.segments
            }
        return self._segments

    def _beat(self) -> None:
        conn = None
        try:
            while True:
                lease, timeout_s = self.lease, self.lease_timeout_s  # reconnect() may change both
                if conn is None or conn.timeout_ms != int(min(self.timeout, timeout_s) * 1000):
                    if conn is not None:
                        conn.close()
                    conn = Connection(self.endpoint, timeout=min(self.timeout, timeout_s), token=self.token)
                if self._closed.wait(max(0.05, timeout_s / 3)):
                    return
                try:
                    conn.request("heartbeat", client=lease)
                except DaemonError as exc:
                    if getattr(exc, "kind", None) != "LeaseExpired":
                        log.warning("heartbeat refused: %s", exc)
                    elif lease == self.lease and not self.lease_lost:
                        # the daemon forgot us: it restarted, or we were silent too long
                        log.warning("lease %s lost (%s); call reconnect() to attach again", lease, exc)
                        self.lease_lost = True
                except (ExpertdError, zmq.ZMQError) as exc:  # the thread must outlive any one failed beat
                    log.warning("heartbeat failed: %s", exc)
        finally:
            if conn is not None:
                conn.close()
