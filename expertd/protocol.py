"""The control-plane wire protocol: small msgpack messages over one ZeroMQ REQ/ROUTER socket.

Every request is a map with `op` (str) and, after the handshake, `client` (the lease id). A
`lease` request may carry `protocol` and then is the handshake too (one round trip to attach).
Every reply is a map with `ok` (bool); on error also `error` (type name) and `message`.
Tensor bytes never travel here: they stay in shared memory.
"""

from __future__ import annotations

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 1
DEFAULT_ENDPOINT = "ipc:///tmp/expertd/expertd.sock"
MAX_MESSAGE_BYTES = 1 << 20  # requests larger than this are refused unread

OPS = ("hello", "index", "lease", "release", "heartbeat", "status", "stop")


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict:
    """Decode one frame into a map; anything else is a ProtocolError, never a crash."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"message is not valid msgpack: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"message must be a map, got {type(message).__name__}")
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError("message has no string 'op'")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    return message


def error_reply(exc: BaseException) -> dict:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)}
