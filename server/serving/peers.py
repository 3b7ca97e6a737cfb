"""What the daemon knows of a request before it decodes it: whether its size is one any op takes, and who sent it.

Both come from the transport, never from what the request says: libzmq's per-frame cap (MAXMSGSIZE on the
socket) and the frames' count and bytes right after they are received; the sender as the kernel (ipc://,
SO_PEERCRED) or CURVE (tcp://) vouches for it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Peer:
    """What the transport says of a request, beside it (never inside its map): who sent it, as the kernel
    (ipc://, SO_PEERCRED) or CURVE (tcp://) vouches for it, and the frames that came after its message."""

    key: str | None = None  # the sender's CURVE public key (tcp:// with CURVE)
    uid: int | None = None  # the sending process's uid and pid (ipc://)
    pid: int | None = None
    address: str = ""  # its address otherwise
    frames: tuple = ()  # a `stage` request's pushed bytes, as memoryviews
    anonymous: bool = False  # a CURVE key the config does not list (no curve_client_keys): counted as "anonymous"

    @property
    def holder(self) -> str:
        """Whom what this request takes counts against (`max_leases_per_client`, a lease's heartbeats): the uid on
        ipc:// ("uid U": every process of a user alike), the CURVE key on tcp:// ("key K"), else the address."""
        if self.key:
            return f"key {self.key}"
        if self.uid is not None:
            return f"uid {self.uid}"
        return f"address {self.address}" if self.address else ""

    @property
    def account(self) -> str:
        """Whom every cap counts this request against (leases, derived tensors, the derivation queue): its holder,
        but "anonymous" for every CURVE key the config does not list, together: throwaway keys cost nothing to make,
        so they never multiply a per-reader cap. A lease still belongs to its key alone."""
        return "anonymous" if self.anonymous else self.holder


def peer_of(frame, client_key: str | None, frames=(), listed=None) -> Peer:
    """The Peer of a request whose last frame is `frame`: its CURVE key when given (anonymous unless `listed(key)`);
    on ipc:// the sending process (SO_PEERCRED uid and pid, which libzmq appends to the peer address); else its
    address."""
    data = tuple(memoryview(f) for f in frames)
    if client_key:
        return Peer(key=client_key, frames=data, anonymous=listed is not None and not listed(client_key))
    try:
        address = frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return Peer(frames=data)
    parts = address.rsplit(":", 3)
    if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
        return Peer(uid=int(parts[1]), pid=int(parts[3]), frames=data)
    return Peer(address=address, frames=data)
