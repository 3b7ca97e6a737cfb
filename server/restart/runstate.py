"""What a daemon leaves on record so that the next one can clean up after a crash.

- A lock: `{run_dir}/{namespace}.lock`, flock'd for the daemon's life (the kernel releases it whatever way the
  process ends) in the run folder, which only the daemon's uid may write: no other uid can hold a namespace (an
  abstract socket name could be bound by anyone first). A second daemon on the run folder refuses; one of the same
  namespace elsewhere finds the first one's live segments when it reaps (NamespaceBusy too).
- A manifest `{run_dir}/{namespace}.manifest.json`: pid, process start time, generation, segment
  names per live generation, state, what they were built under and the leases on them. A clean
  stop removes it with everything else the daemon wrote (so generation numbers start again at 1);
  a crash or a handover (`stop --keep`) leaves it, and the successor adopts what it names (see
  `adopt`) or counts up from it.
- Reaping: on start, segments of the namespace whose owner process is dead are unlinked, but for
  those the daemon adopted: every other generation's and any staging segment of an update in
  flight. Segments of a live daemon, of another namespace, or of another user, are never touched.
- Trust (`hostpaths`, `sealed`): the run folder must be the daemon's own and writable by nobody else,
  and the manifest is sealed with the run folder's key; one that fails is not read at all.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import socket
import stat
import time

import zmq

import expertd
from expertd import procfs
from expertd.errors import ExpertdError
from expertd.procfs import process_start_time
from expertd.protocol import ipc_path, pack
from expertd.segments import segment_path

from ..shm import hostpaths
from ..shm.arena import SHM_DIR, segment_pattern, unlink_segment
from . import sealed
from .ledger import LEDGER_VERSION

log = logging.getLogger("expertd.runstate")

SHOWN = 5  # names a log line shows of the files of other users it leaves alone (anyone may plant thousands)


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
        self.lock_path = os.path.join(run_dir, f"{namespace}.lock")
        self._lock: int | None = None  # the flock'd lock file's descriptor
        self._manifest_failing = False  # a manifest write failed: said once, until one succeeds again
        self._made: list[str] = []  # folders this daemon, or the predecessor it follows, created (removed when empty)
        self._made_key = False  # whether this daemon created the run folder's key (see `release`)
        self.manifest_problem: str | None = None  # why the manifest there was not read, when one was
        self.handover_from: int | None = None  # the pid that handed its generations over (`stop --keep`), if one did

    def acquire(self) -> None:
        """Make or check the run folder (UnsafePath, exit 2, when it is not the daemon's own), take the namespace
        lock in it (NamespaceBusy when a live daemon holds it), then check the records in it and its key."""
        try:
            self._made = hostpaths.ensure_private_dir(self.run_dir, "run folder")
            self._take_lock()
            for path in [self.manifest_path] + glob.glob(os.path.join(glob.escape(self.run_dir),
                                                                      f"{glob.escape(self.namespace)}.gen*.json")):
                hostpaths.check_file(path, "manifest" if path == self.manifest_path else "ledger record")
            self._made_key = sealed.load_key(self.run_dir, self.namespace) is None
            sealed.ensure_key(self.run_dir, self.namespace)
        except BaseException:
            self.release()
            raise

    def _take_lock(self) -> None:
        """flock the lock file (made O_NOFOLLOW in the checked run folder), again when the file found was unlinked
        by a daemon that was releasing it meanwhile: the lock held is always the one on the file at its path."""
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                hostpaths.check_file(self.lock_path, "namespace lock")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                pid = (self.read_manifest() or {}).get("pid")
                who = f" (pid {pid})" if isinstance(pid, int) and pid > 0 and pid_alive(pid) else ""
                raise NamespaceBusy(f"another expertd daemon{who} already serves namespace {self.namespace!r} from "
                                    f"{self.run_dir}; stop it first or choose another namespace") from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same and stat.S_ISREG(os.fstat(fd).st_mode):
                self._lock = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self._lock is not None:
            try:
                os.unlink(self.lock_path)  # while still held: a daemon waiting on this file tries the path again
            except FileNotFoundError:
                pass
            os.close(self._lock)
            self._lock = None
        if self._made_key and not os.path.exists(self.manifest_path):  # a start that failed before recording anything
            sealed.remove_key(self.run_dir, self.namespace)
            self._made_key = False
        hostpaths.remove_created(self._made, self.run_dir)  # only when empty: a failed start leaves no folder either
        self._made = []

    def remove(self) -> None:
        """A clean stop: drop the manifest and the key that sealed it (the run folder goes at `release` when this
        daemon made it)."""
        try:
            os.unlink(self.manifest_path)
        except FileNotFoundError:
            pass
        sealed.remove_key(self.run_dir, self.namespace)

    @property
    def purpose(self) -> str:
        """What the manifest's MAC binds it to (no ledger record passes for it)."""
        return f"expertd manifest {self.namespace}"

    def read_manifest(self) -> dict | None:
        """The manifest, once its MAC checks out under the run folder's key; None when there is none or it fails
        (then `manifest_problem` says why)."""
        self.manifest_problem = None
        if not os.path.lexists(self.manifest_path):
            return None
        try:
            data = sealed.read(self.manifest_path, self.purpose, sealed.load_key(self.run_dir, self.namespace))
        except (OSError, ValueError) as exc:  # Unsealed, unreadable, malformed, a key file that is not ours
            self.manifest_problem = str(exc)
            return None
        return data

    def predecessor(self) -> dict | None:
        """The manifest a dead or handed-over predecessor left, to adopt from; one that fails its checks is not
        adopted (what it names is reaped as after any crash), with one log line saying why."""
        manifest = self.read_manifest()
        if manifest is None and self.manifest_problem is not None:
            log.warning("not adopting anything in namespace %r: %s; reaping what this user left there",
                        self.namespace, self.manifest_problem)
        if manifest is not None:
            self.handover_from = manifest.get("pid") if manifest.get("state") == "handover" else None
            made = manifest.get("made")  # the folders it made are this daemon's to remove at a clean stop
            made = made if isinstance(made, list) else []
            self._note_made([f for f in made if isinstance(f, str) and os.path.isabs(f)])
        return manifest

    def _note_made(self, folders: list[str]) -> None:
        self._made = sorted(set(self._made) | set(folders), key=len)  # outermost first

    def next_generation(self) -> int:
        previous = self.read_manifest() or {}
        gen = previous.get("generation", 0)
        return gen + 1 if isinstance(gen, int) and gen >= 0 else 1

    def write_manifest(self, generation: int, segments: dict[int, list[str]], state: str, endpoint: str,
                       staging: list[str] = (), shm_dir: str = SHM_DIR, conditions: dict | None = None,
                       leases: list[dict] = ()) -> None:
        """Record the latest generation, the segments of every live generation (and of staging), what they were
        built under and the leases on them: what a successor needs to adopt them (see `adopt`). A write that fails
        (the run folder gone, swapped or full) is logged once and skipped: the daemon serves on, and a successor
        that finds no current manifest reaps and rebuilds instead of adopting."""
        try:
            hostpaths.check_folder(self.run_dir, "run folder")  # still the daemon's own, reached through no new link
            self._write_manifest(generation, segments, state, endpoint, staging, shm_dir, conditions, leases)
        except OSError as exc:
            if not self._manifest_failing:
                log.error("cannot write the manifest %s (%s): serving on without it; a successor will rebuild rather "
                          "than adopt", self.manifest_path, exc)
            self._manifest_failing = True
            return
        if self._manifest_failing:
            log.info("the manifest %s is written again", self.manifest_path)
        self._manifest_failing = False

    def _write_manifest(self, generation, segments, state, endpoint, staging, shm_dir, conditions, leases) -> None:
        sealed.write(self.manifest_path, {
            "pid": os.getpid(), "start_time": process_start_time(os.getpid()), "generation": generation,
            "namespace": self.namespace, "state": state, "endpoint": endpoint, "updated": time.time(),
            "shm_dir": shm_dir, "expertd": expertd.__version__, "ledger": LEDGER_VERSION, "built_under": conditions,
            "segments": sorted({name for names in segments.values() for name in names} | set(staging)),
            "generations": {str(g): names for g, names in sorted(segments.items())},
            "leases": list(leases), "made": self._made,
        }, self.purpose, sealed.ensure_key(self.run_dir, self.namespace), indent=1, sort_keys=True)

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
        reaped, foreign = [], []
        for name, pid in namespace_segments(self.namespace, shm_dir).items():
            if pid == os.getpid() or name in keep:
                continue
            if hostpaths.owned(segment_path(name, shm_dir)) is False:
                foreign.append(name)  # another user's file: never ours to judge or unlink
                continue
            if pid_alive(pid) and self._is_expertd(pid):
                raise NamespaceBusy(
                    f"segment {name} of namespace {self.namespace!r} belongs to live process {pid}; "
                    "stop that daemon first or choose another namespace"
                )
            if unlink_segment(name, shm_dir):
                reaped.append(name)
        if foreign:
            more = f" and {len(foreign) - SHOWN} more" if len(foreign) > SHOWN else ""
            log.warning("leaving %d file(s) named like segments of namespace %r in %s alone: another user owns "
                        "them (this daemon runs as uid %d): %s%s", len(foreign), self.namespace, shm_dir, os.geteuid(),
                        ", ".join(foreign[:SHOWN]), more)
        if reaped and self.handover_from is not None:  # a planned restart: what is not served again (index segments)
            log.info("handover from pid %s: removed %d segment(s) it left that this daemon makes anew or does not "
                     "serve: %s", self.handover_from, len(reaped), ", ".join(reaped))
        elif reaped:
            log.warning("reaped %d segment(s) left by a dead daemon of namespace %r in %s: %s",
                        len(reaped), self.namespace, shm_dir, ", ".join(reaped))
        return reaped

    def own_socket_folder(self, path: str, gid: int | None = None) -> None:
        """Make (0700) or check the folder of the ipc socket `path` and what is at `path`: both must be this
        daemon's, or someone else could answer its clients (UnsafePath, exit 2). With `gid` (the config's
        `group:`), the folder is that group's and 0750, so the group's readers reach the socket; still nobody's
        but the daemon's to write."""
        folder = os.path.dirname(path) or "."
        self._note_made(hostpaths.ensure_private_dir(folder, "socket folder"))
        if gid is not None:
            os.chown(folder, -1, gid)
            os.chmod(folder, 0o750)
        hostpaths.check_socket(path)

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
