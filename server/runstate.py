"""What a daemon leaves on record so that the next one can clean up after a crash.

- A lock: an abstract unix socket named after the namespace, held for the daemon's life and
  released by the kernel whatever way the process ends. A second daemon on the namespace refuses.
- A manifest `{run_dir}/{namespace}.manifest.json`: pid, process start time, generation, segment
  names per live generation, state, what they were built under and the leases on them. A clean
  stop removes it with everything else the daemon wrote (so generation numbers start again at 1);
  a crash or a handover (`stop --keep`) leaves it, and the successor adopts what it names (see
  `adopt`) or counts up from it.
- Reaping: on start, segments of the namespace whose owner process is dead are unlinked, but for
  those the daemon adopted: every other generation's and any staging segment of an update in
  flight. Segments of a live daemon, or of another namespace, are never touched.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import zmq

import expertd
from expertd.errors import ExpertdError
from expertd.index import write_json_atomic
from expertd import procfs
from expertd.procfs import process_start_time
from expertd.protocol import ipc_path, pack

from .arena import SHM_DIR, segment_pattern, unlink_segment
from .ledger import LEDGER_VERSION

log = logging.getLogger("expertd.runstate")


class NamespaceBusy(ExpertdError, RuntimeError):
    """Another live daemon already serves this namespace."""


class EndpointBusy(ExpertdError, RuntimeError):
    """Another live daemon already answers on this endpoint."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_segments(namespace: str, shm_dir: str = SHM_DIR) -> dict[str, int]:
    """Every segment of this namespace in `shm_dir`: name (with leading /) -> owner pid."""
    pattern = segment_pattern(namespace)
    found = {}
    for entry in os.listdir(shm_dir):
        m = pattern.match(entry)
        if m:
            found["/" + entry] = int(m.group(1))
    return found


class RunState:
    def __init__(self, namespace: str, run_dir: str):
        self.namespace = namespace
        self.run_dir = run_dir
        self.manifest_path = os.path.join(run_dir, f"{namespace}.manifest.json")
        self._lock: socket.socket | None = None

    def acquire(self) -> None:
        """Take the namespace lock; refuse if a live daemon holds it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0expertd.{self.namespace}")
        except OSError as exc:
            sock.close()
            pid = (self.read_manifest() or {}).get("pid")
            who = f" (pid {pid})" if isinstance(pid, int) and pid > 0 and pid_alive(pid) else ""
            raise NamespaceBusy(
                f"another expertd daemon{who} already serves namespace {self.namespace!r}; "
                "stop it first or choose another namespace"
            ) from exc
        self._lock = sock
        self._made_run_dir = not os.path.isdir(self.run_dir)
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if getattr(self, "_made_run_dir", False):
            try:
                os.rmdir(self.run_dir)  # only when empty: a failed start leaves no folder behind either
            except OSError:
                pass

    def remove(self) -> None:
        """A clean stop: drop the manifest (the run folder goes at `release` when this daemon made it)."""
        try:
            os.unlink(self.manifest_path)
        except FileNotFoundError:
            pass

    def read_manifest(self) -> dict | None:
        try:
            with open(self.manifest_path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def next_generation(self) -> int:
        previous = self.read_manifest() or {}
        gen = previous.get("generation", 0)
        return gen + 1 if isinstance(gen, int) and gen >= 0 else 1

    def write_manifest(self, generation: int, segments: dict[int, list[str]], state: str, endpoint: str,
                       staging: list[str] = (), shm_dir: str = SHM_DIR, conditions: dict | None = None,
                       leases: list[dict] = ()) -> None:
        """Record the latest generation, the segments of every live generation (and of staging), what they were
        built under and the leases on them: what a successor needs to adopt them (see `adopt`)."""
        write_json_atomic(self.manifest_path, {
            "pid": os.getpid(), "start_time": process_start_time(os.getpid()), "generation": generation,
            "namespace": self.namespace, "state": state, "endpoint": endpoint, "updated": time.time(),
            "shm_dir": shm_dir, "expertd": expertd.__version__, "ledger": LEDGER_VERSION, "built_under": conditions,
            "segments": sorted({name for names in segments.values() for name in names} | set(staging)),
            "generations": {str(g): names for g, names in sorted(segments.items())},
            "leases": list(leases),
        })

    def reap(self, shm_dir: str = SHM_DIR, keep=frozenset()) -> list[str]:
        """Unlink this namespace's segments whose owner is dead, in `shm_dir` and in the folder the
        manifest of a crashed predecessor names (its config may have had another shm_dir); refuse
        if a live daemon owns some. `keep`: segments this daemon adopted (named with their builder's pid)."""
        before = (self.read_manifest() or {}).get("shm_dir")
        folders = [shm_dir] + ([before] if isinstance(before, str) and before != shm_dir
                               and os.path.isabs(before) and os.path.isdir(before) else [])
        reaped = []
        for folder in folders:
            reaped += self._reap_in(folder, keep if folder == shm_dir else frozenset())
        return reaped

    def _reap_in(self, shm_dir: str, keep=frozenset()) -> list[str]:
        reaped = []
        for name, pid in namespace_segments(self.namespace, shm_dir).items():
            if pid == os.getpid() or name in keep:
                continue
            if pid_alive(pid) and self._is_expertd(pid):
                raise NamespaceBusy(
                    f"segment {name} of namespace {self.namespace!r} belongs to live process {pid}; "
                    "stop that daemon first or choose another namespace"
                )
            if unlink_segment(name, shm_dir):
                reaped.append(name)
        if reaped:
            log.warning("reaped %d segment(s) left by a dead daemon of namespace %r in %s: %s",
                        len(reaped), self.namespace, shm_dir, ", ".join(reaped))
        return reaped

    @staticmethod
    def _is_expertd(pid: int) -> bool:
        """A live pid owns its segments unless the pid was reused by a program that is not expertd."""
        return procfs.runs_expertd(pid) is not False  # cannot tell: never touch what may be live


def endpoint_answers(ctx: zmq.Context, endpoint: str, timeout_ms: int = 500) -> bool:
    """Whether a daemon answers `status` on `endpoint` (a socket file left by a dead one does not)."""
    path = ipc_path(endpoint)
    if path is not None:  # a socket file nobody listens on (a daemon that died) refuses a plain connect at once
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            pass  # cannot tell: ask over ZeroMQ
        finally:
            probe.close()
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
