"""The control-plane wire protocol: small msgpack messages over one ZeroMQ REQ/ROUTER socket.

Every request is a map with `op` (str) and, after the handshake, `client` (the lease id). A
`lease` request may carry `protocol` and then is the handshake too (one round trip to attach):
its reply names the generation's index segment (`index_segment`: segment, nbytes, checksum,
generation; see `expertd.index_segment`), which the worker maps and decodes itself. `refresh`
replies name it too; `index` with `segment: true` returns only that descriptor (a lease taken
while loading), without it the index inline (for tools).

Version 3: the index is schema 2 (source patterns, no views) and lease replies carry `index_segment`. Version 4:
dtype casts and gathers are two typed ops (`cast`, `gather`) instead of `variant`'s untyped items. Version 5: an
index may be schema 3 (a stack as ranges of several segments, `extents`; the daemon's `expert_ranges`, on by default),
so a reader that cannot map ranges is refused at the handshake rather than by the first index a push makes. Version 6:
one word per idea — the error `VariantRejected` is `DerivedRejected`, a status generation row's `variants` list is
`derived.tensors`.
Every reply is a map with `ok` (bool) and `latest` (the newest generation served); on error
also `error` (the condition's name, see `ERRORS`) and `message`. Tensor bytes never travel
here: they stay in shared memory (pushed weights too: they go through a staging segment). Over
`tcp://` (an updater on another host) the pushed bytes travel as extra frames of `stage` requests,
sent without a copy, never inside msgpack; the daemon writes them into the staging segment itself.
`commit` with `hold: true` builds without publishing until `publish` (or `abort`): a push to several
daemons publishes nowhere unless every daemon has built its share.
"""

from __future__ import annotations

import os
import re
import stat

import msgpack

from . import errors
from .errors import DaemonError, ProtocolError

PROTOCOL_VERSION = 6
MAX_MESSAGE_BYTES = 1 << 20  # requests larger than this are refused unread

ECHO_CHARS = 120  # what an error reply or a log line repeats of a value a client sent
MESSAGE_CHARS = 2000  # an error reply's message at most (whatever it lists)

# `stage` is the one request with more frames than its message: the pushed bytes, each frame at most
# STAGE_FRAME_BYTES (under the socket's per-frame cap MAX_MESSAGE_BYTES with room for CURVE's encryption
# overhead: libzmq checks the cap on the encrypted frame), a message at most STAGE_MESSAGE_BYTES of one tensor.
STAGE_FRAME_BYTES = MAX_MESSAGE_BYTES - (4 << 10)
STAGE_MESSAGE_BYTES = 64 * STAGE_FRAME_BYTES
# what the daemon takes at most in one request, checked as soon as it is received, before anything is decoded:
# a REQ envelope (identity, empty frame), the message, then a `stage` request's frames
MAX_REQUEST_FRAMES = 3 + STAGE_MESSAGE_BYTES // STAGE_FRAME_BYTES
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES + STAGE_MESSAGE_BYTES + 4096

# Conditions a client handles by type, mapped by name in one place (as pyzmq maps errno to classes);
# any other error name arrives as a plain DaemonError carrying that name in `kind`.
ERRORS = {cls.__name__: cls for cls in (
    errors.NotReady, errors.LeaseExpired, errors.LeaseLimit, errors.Busy, errors.GenerationLimit, errors.GenerationGone,
    errors.UpdateRejected, errors.PushDenied, errors.PermissionDenied, errors.AuthError, errors.VersionMismatch,
    errors.DerivedRejected, errors.LeaseRevoked, errors.MappedLimit, errors.DerivedLimit,
)}


def clip(value, limit: int = ECHO_CHARS) -> str:
    """`value` as text of at most `limit` characters (an ellipsis marks a cut): what a reply or a log line may
    echo of what a client sent, so that a 900 KB `client` string is not sent back or logged whole."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _private_folder(path: str, uid: int) -> bool:
    """Whether `path` is a folder (not a link) of `uid` that nobody else may write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def runtime_base() -> str:
    """Where a daemon keeps its socket (and run folders) when its config names none: a folder no other uid can make
    first. For root /run/expertd; for another uid $XDG_RUNTIME_DIR/expertd when that variable names a folder of the
    uid's own that nobody else may write, else /tmp/expertd-UID (which the daemon makes 0700 and refuses when it is a
    link or another uid's; a client refuses such a one too). The daemon, its CLI and its clients of one uid (and
    one environment) resolve the same folder; a worker of another uid names the endpoint."""
    uid = os.geteuid()
    if uid == 0:
        return "/run/expertd" if _private_folder("/run", 0) else "/tmp/expertd-0"
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg.startswith("/") and _private_folder(xdg, uid):
        return os.path.join(xdg, "expertd")
    return f"/tmp/expertd-{uid}"


def default_endpoint() -> str:
    """The endpoint of a daemon whose config names none: ipc://RUNTIME_BASE/expertd.sock (see `runtime_base`)."""
    return f"ipc://{runtime_base()}/expertd.sock"


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an `ipc://PATH` endpoint; None for any other transport."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def tcp_host(endpoint: str) -> str | None:
    """The host of a `tcp://HOST:PORT` endpoint; None for any other transport."""
    m = re.match(r"^tcp://(.+):\d+$", endpoint)
    return m.group(1) if m else None


def is_endpoint(text: str) -> bool:
    return text.startswith(("ipc://", "tcp://"))


ABSOLUTE_IPC = "write it as ipc:// followed by its absolute path, e.g. ipc:///run/expertd/expertd.sock"


def check_endpoint(endpoint: str, where: str | None = None, *, relative: bool = False) -> str:
    """`endpoint` when it is `ipc:///ABSOLUTE/PATH` or `tcp://HOST:PORT`, else a ConfigError that says how to write it.

    The one syntax check the CLI, the config, the Python client and (restated) the C++ client share, so that a
    socket path given without `ipc://` is explained before ZeroMQ answers it with a bare "Invalid argument".
    A relative ipc:// path is refused (each process would find it under its own working folder; `ipc://tmp/x.sock`
    is most often a slash short of `ipc:///tmp/x.sock`) unless `relative` (a config file, whose folder anchors it).
    `where` (a flag, a config file) leads the message."""
    lead = f"{where}: endpoint {endpoint!r}" if where else f"endpoint {endpoint!r}"
    path = ipc_path(endpoint)
    if path is not None:
        if not path:
            raise errors.ConfigError(f"{lead} names no socket path")
        if not relative and not path.startswith("/"):
            fix = ABSOLUTE_IPC if path.startswith((".", "~")) else f"an absolute path takes three slashes: ipc:///{path}"
            raise errors.ConfigError(f"{lead} names the relative path {path}, which each process would look for under "
                                     f"its own working folder; {fix}")
        return endpoint
    if re.match(r"^tcp://[^:/]+:\d+$", endpoint):
        return endpoint
    if re.match(r"^tcp://[^:/]+$", endpoint):
        raise errors.ConfigError(f"{lead} names no port; write it as {endpoint}:PORT")
    if re.match(r"^ipc:/[^/]", endpoint) or re.match(r"^tcp:/?[^/]", endpoint):  # the scheme's // short
        fixed = "ipc://" + endpoint[4:] if endpoint.startswith("ipc") else "tcp://" + endpoint[4:].lstrip("/")
        raise errors.ConfigError(f"{lead} has too few slashes; write it as {fixed}")
    if "://" not in endpoint and endpoint.startswith("/"):
        raise errors.ConfigError(f"{lead} looks like a socket path; write it as ipc://{endpoint}")
    if "://" not in endpoint and (endpoint.startswith((".", "~", "ipc:")) or endpoint.endswith(".sock")):
        raise errors.ConfigError(f"{lead} looks like a relative socket path; {ABSOLUTE_IPC}")
    if "://" not in endpoint and re.match(r"^[^:/]+:\d+$", endpoint):
        raise errors.ConfigError(f"{lead} needs its transport; write it as tcp://{endpoint}")
    raise errors.ConfigError(f"{lead} must be ipc://PATH (a unix socket) or tcp://HOST:PORT")


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _decode(frame: bytes, what: str):
    if len(frame) > MAX_MESSAGE_BYTES and what == "message":
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"{what} is not valid msgpack: {exc}") from exc


def unpack(frame: bytes) -> dict:
    """Decode one request into a map; anything else is a ProtocolError, never a crash. Its op and fields are
    checked by `expertd.messages.parse_request`."""
    message = _decode(frame, "message")
    if not isinstance(message, dict):
        raise ProtocolError(f"message must be a map, got {type(message).__name__}")
    return message


def unpack_reply(frame: bytes, what: str) -> dict:
    """Decode a reply to `what` (a request, in the user's words); an error reply raises its typed DaemonError."""
    reply = _decode(frame, f"the daemon's reply to {what}")
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ProtocolError(f"the daemon's reply to {what} is malformed")
    if not reply["ok"]:
        kind = str(reply.get("error"))
        cls = ERRORS.get(kind, DaemonError)
        exc = cls(errors.refusal(cls, what, kind, reply.get("message")), kind)
        retry = reply.get("retry_after_s")  # GenerationLimit: when a retry can proceed
        if isinstance(retry, (int, float)) and not isinstance(retry, bool) and 0 <= retry < 1e9:
            exc.retry_after_s = float(retry)
        raise exc
    return reply


def check_version(version) -> None:
    """A client speaking another protocol version is refused with both versions named."""
    if version != PROTOCOL_VERSION:
        raise errors.VersionMismatch(f"client speaks protocol {version!r}, daemon speaks {PROTOCOL_VERSION}")


def error_reply(exc: BaseException) -> dict:
    reply = {"ok": False, "error": clip(getattr(exc, "kind", None) or type(exc).__name__),
             "message": clip(str(exc), MESSAGE_CHARS)}
    if isinstance(getattr(exc, "retry_after_s", None), float):  # GenerationLimit while leases are being revoked
        reply["retry_after_s"] = exc.retry_after_s
    return reply
