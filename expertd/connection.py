"""A REQ connection to the daemon's control socket with a receive timeout turned into a typed error.

Shared by the client and the CLI: it imports neither torch nor server code, so `expertd status` (what
healthchecks run every few seconds) starts fast.
"""

from __future__ import annotations

import os
import socket
import threading

import zmq

from expertd import messages
from expertd.errors import DaemonNotRunning, DaemonNotTrusted, DaemonTimeout, ProtocolError
from expertd.option_words import CLI, OptionWords
from expertd.protocol import MAX_MESSAGE_BYTES, check_endpoint, ipc_path, pack, unpack_reply
from expertd.replies import Reply, read_reply
from expertd.security import Credentials
from expertd.trust import check_socket

def _refused(path: str) -> bool:
    """Whether nothing listens on the unix socket `path` (a daemon killed with -9 leaves its file behind)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a full backlog answers EAGAIN at once: someone listens
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False  # no permission, a full backlog, a path too long: let ZeroMQ try and say
    finally:
        probe.close()
    return False


def _blocking(path: str) -> str:
    """The first folder on the way to `path` this process may not search, with its owner, group and mode."""
    import grp
    import pwd
    import stat

    folder = os.path.dirname(os.path.abspath(path))
    chain = [folder]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    for step in reversed(chain):
        if not os.access(step, os.X_OK):
            st = os.stat(step)
            try:
                owner, group = pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name
            except KeyError:
                owner, group = str(st.st_uid), str(st.st_gid)
            return f"{step} is {owner}:{group} {stat.filemode(st.st_mode)}"
    return f"{folder}"


def check_running(endpoint: str, words: OptionWords = CLI) -> None:
    """Fail at once when no daemon can answer an ipc:// endpoint: no socket file, or nothing listening on it."""
    path = ipc_path(endpoint)
    if path is None:
        return
    fix = f"start one with `expertd start --config CONFIG` (or {words.point})"
    try:
        os.stat(path)
    except PermissionError:
        raise DaemonNotTrusted(f"cannot reach the daemon's socket {path}: permission denied on the way to it "
                               f"({_blocking(path)}); a daemon started with `group: NAME` in its config lets that "
                               "group's members in: run this as a member of it (its operator adds you: usermod -aG "
                               "NAME USER, then log in again), or as the daemon's own user") from None
    except OSError:
        pass
    if not os.path.exists(path):
        raise DaemonNotRunning(f"no expertd daemon is running at {endpoint}: the socket file {path} does not exist; "
                               f"{fix}")
    if _refused(path):
        raise DaemonNotRunning(f"no expertd daemon is running at {endpoint}: nothing listens on its socket file {path} "
                               f"(left behind by a daemon that was killed); {fix}")


class Connection:
    """One REQ socket; after a timeout the socket is rebuilt (a REQ socket that missed a reply is stuck).
    A malformed endpoint is a ConfigError here (`where` names its origin), before any ZeroMQ call."""

    def __init__(self, endpoint: str, timeout: float = 10.0, context: zmq.Context | None = None,
                 token: str | None = None, credentials: Credentials | None = None, where: str | None = None,
                 words: OptionWords = CLI):
        self.endpoint = check_endpoint(endpoint, where)  # a ConfigError, before ZeroMQ says "Invalid argument"
        self.credentials = credentials or Credentials.resolve(token=token)
        self.token = self.credentials.token
        self.timeout_ms = max(1, int(timeout * 1000))
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock = None
        self.on_reply = None  # called with every successful reply (the client reads `latest` from it)
        self.words = words  # how its hints name the caller's options (`expertd.option_words`)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            self.credentials.secure(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def request(self, op: str, _frames=(), **fields) -> dict:
        """Send one request and return the reply map; raises DaemonTimeout or the reply's typed DaemonError.
        `_frames` (buffers) follow the message as frames of their own, sent without a copy (`stage`)."""
        with self._lock:
            if self._sock is None:
                check_running(self.endpoint, self.words)
                if ipc_path(self.endpoint) is not None:  # before a token goes out: whose socket is it?
                    check_socket(ipc_path(self.endpoint))
            sock = self._socket()
            try:
                message = {"op": op, **fields}
                if self.token is not None:
                    message["token"] = self.token
                message.update(self.credentials.for_op(op))  # the push or admin token, with the ops that need it
                # no token in clear to whoever holds the port
                self.credentials.check_transport(self.endpoint, message, self.words)
                packed = pack(message)
                if len(packed) > MAX_MESSAGE_BYTES:  # the daemon's socket would drop it unanswered
                    raise ProtocolError(f"{messages.words(op)} is a {len(packed)}-byte request; the daemon takes "
                                        f"requests of at most {MAX_MESSAGE_BYTES} bytes (larger data travels as "
                                        "frames or in shared memory)")
                if _frames:
                    sock.send(packed, zmq.SNDMORE)
                    for k, buf in enumerate(_frames):
                        sock.send(buf, zmq.SNDMORE if k + 1 < len(_frames) else 0, copy=False)
                else:
                    sock.send(packed)
                frame = sock.recv()
            except zmq.Again as exc:
                self._reset()
                raise DaemonTimeout(
                    f"the daemon at {self.endpoint} did not answer {messages.words(op)} "
                    f"within {self.timeout_ms / 1000:.1f}s "
                    f"({self._silence()})"
                ) from exc
            except BaseException:
                self._reset()  # a REQ socket interrupted between send and recv can never send again
                raise
        reply = unpack_reply(frame, repr(op))
        if self.on_reply is not None:
            self.on_reply(reply)
        return reply

    def send(self, request: messages.Request, reply: type[Reply] | None = None, frames=()):
        """Send a typed request (expertd.messages); the reply as `reply` (checked field by field), else its map."""
        got = self.request(request.op, frames, **request.wire())
        return got if reply is None else read_reply(reply, got, repr(request.op))

    def _silence(self) -> str:
        """Why a daemon may not answer, as far as this side can tell."""
        if ipc_path(self.endpoint) is not None:
            return f"its socket exists: is it stuck, or is {self.words.timeout} too short?"
        if self.credentials.server_key is not None:
            return ("with CURVE a daemon never answers a client whose server key is not its public key, nor a client "
                    "key it does not allow: check EXPERTD_SERVER_KEY / server_key= and EXPERTD_CLIENT_KEY; or it is "
                    f"not running there, or {self.words.timeout} is too short")
        return ("is it running there? A daemon with CURVE never answers a client without its public key: give it "
                f"with EXPERTD_SERVER_KEY / server_key= (or {self.words.server_key})")

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._reset()
