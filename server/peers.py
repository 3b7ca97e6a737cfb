"""What the daemon knows of a request before it decodes it: whether its size is one any op takes, and who sent it.

Both come from the transport, never from what the request says: libzmq's per-frame cap (MAXMSGSIZE on the
socket) and the frames' count and bytes right after they are received; the sender as the kernel (ipc://,
SO_PEERCRED) or CURVE (tcp://) vouches for it.
"""

from __future__ import annotations

import zmq

from expertd.errors import ProtocolError
from expertd.protocol import MAX_REQUEST_BYTES, MAX_REQUEST_FRAMES


def oversized(frames) -> None:
    """Refuse a request of more frames or bytes than any op takes (libzmq has already buffered it whole: its
    MAXMSGSIZE caps each frame, not their number) before a byte of it is decoded."""
    if len(frames) > MAX_REQUEST_FRAMES:
        raise ProtocolError(f"a request of {len(frames)} frames; the daemon takes at most {MAX_REQUEST_FRAMES}")
    total = sum(len(f) for f in frames)
    if total > MAX_REQUEST_BYTES:
        raise ProtocolError(f"a request of {total} bytes; the daemon takes at most {MAX_REQUEST_BYTES}")


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
