"""What the daemon knows of a request before it decodes it: whether its size is one any op takes, and who sent it.

Both come from the transport, never from what the request says: libzmq's per-frame cap (MAXMSGSIZE on the
socket) and the frames' count and bytes right after they are received; the sender as the kernel (ipc://,
SO_PEERCRED) or CURVE (tcp://) vouches for it.
"""

from __future__ import annotations

import ctypes

import zmq

from expertd.errors import ProtocolError
from expertd.protocol import MAX_REQUEST_BYTES, MAX_REQUEST_FRAMES


def oversized(frames: list) -> None:
    """Refuse a request of more frames or bytes than any op takes (libzmq has already buffered it whole: its
    MAXMSGSIZE caps each frame, not their number) before a byte of it is decoded; its frames past the envelope
    and message are dropped from `frames` at once and the freed heap handed back to the system."""
    total = sum(len(f) for f in frames)
    if len(frames) <= MAX_REQUEST_FRAMES and total <= MAX_REQUEST_BYTES:
        return
    count = len(frames)
    del frames[3:]
    _trim()
    if count > MAX_REQUEST_FRAMES:
        raise ProtocolError(f"a request of {count} frames; the daemon takes at most {MAX_REQUEST_FRAMES}")
    raise ProtocolError(f"a request of {total} bytes; the daemon takes at most {MAX_REQUEST_BYTES}")


def _trim() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim; elsewhere nothing): a refused flood's
    buffers would otherwise stay in the daemon's RSS."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def owner(frame, client_key: str | None) -> str:
    """Who sent a request, as the kernel or CURVE vouches for it (never what the request says): its CURVE key;
    on ipc:// the sending process (SO_PEERCRED uid and pid, which libzmq appends to the peer address); else
    its address. `max_leases_per_client` counts leases per owner."""
    if client_key:
        return f"key {client_key}"
    try:
        address = frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""
    parts = address.rsplit(":", 3)
    if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
        return f"uid {parts[1]} pid {parts[3]}"
    return f"address {address}"
