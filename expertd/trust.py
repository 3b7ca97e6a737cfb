"""Whom a client trusts before it sends a token or maps a byte: the daemon's socket folder, socket and segments.

Whoever may replace the socket file collects the token of every client that connects (its first request, `lease`,
carries it), and whoever owns a segment decides the bytes a worker computes with. So on ipc:// a client first
checks, as OpenSSH's StrictModes checks a home folder:

- the socket folder is writable by nobody but its owner (a sticky folder such as /tmp aside: there the socket's
  owner must be trusted itself), and its owner is trusted: root, the client's own uid, a uid named in
  `$EXPERTD_DAEMON_UID` (numbers or user names, comma-separated), or any owner of a folder that sits in a folder
  only root or a trusted uid may write (root or that uid gave it to its owner: the images' `/run/expertd`);
- the socket is a socket, owned by the folder's owner (or a trusted uid).

The socket's owner is then the daemon's uid for this process: segments are mapped only when they belong to a
trusted uid or to such a daemon. A refusal is `DaemonNotTrusted`, one line naming the path, its owner and mode.
"""

from __future__ import annotations

import os
import pwd
import stat

from .errors import DaemonNotTrusted

_daemons: set[int] = set()  # uids this process found behind a trusted socket: their segments may be mapped
FIX = "set $EXPERTD_DAEMON_UID to the daemon's user if it is the right daemon, else use a socket in a folder of your own"


def _named(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def describe(path: str, st: os.stat_result) -> str:
    return f"{path} (owner {_named(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o})"


def trusted_uids() -> set[int]:
    """root, this process's uid, the uids of $EXPERTD_DAEMON_UID and the daemons found behind trusted sockets."""
    uids = {0, os.geteuid()} | _daemons
    for item in os.environ.get("EXPERTD_DAEMON_UID", "").replace(",", " ").split():
        try:
            uids.add(int(item) if item.isdigit() else pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise DaemonNotTrusted(f"$EXPERTD_DAEMON_UID names {item!r}: no such user") from None
    return uids


def _others_write(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def check_socket(path: str) -> int:
    """The daemon's uid behind the ipc:// socket `path`, once its folder and the socket are found trustworthy
    (see the module's rules); DaemonNotTrusted naming what is wrong otherwise."""
    folder = os.path.dirname(os.path.realpath(path))
    trusted = trusted_uids()
    st, sock = os.stat(folder), os.lstat(os.path.join(folder, os.path.basename(path)))
    if not stat.S_ISSOCK(sock.st_mode):
        raise DaemonNotTrusted(f"refusing to talk to {path}: {describe(path, sock)} is not a socket")
    if _others_write(st) and not st.st_mode & stat.S_ISVTX:
        raise DaemonNotTrusted(f"refusing to talk to {path}: its folder {describe(folder, st)} may be written by "
                               f"others, who could replace the socket; {FIX}")
    if _others_write(st):  # sticky (like /tmp): anyone may have made the socket, so its owner must be trusted
        owner_ok = sock.st_uid in trusted
    else:
        parent = os.stat(os.path.dirname(folder))
        given = parent.st_uid in trusted and not _others_write(parent)  # root or a trusted uid made it theirs
        owner_ok = (st.st_uid in trusted or given) and sock.st_uid in trusted | {st.st_uid}
    if not owner_ok:
        raise DaemonNotTrusted(f"refusing to talk to {path}: the socket {describe(path, sock)} in "
                               f"{describe(folder, st)} belongs to a user this client does not trust (root, you, "
                               f"$EXPERTD_DAEMON_UID); {FIX}")
    _daemons.add(sock.st_uid)
    return sock.st_uid


def check_owner(path: str, st: os.stat_result, what: str = "segment") -> None:
    """Refuse to map a segment that belongs to nobody this process trusts (a daemon's uid found by `check_socket`,
    root, itself, $EXPERTD_DAEMON_UID)."""
    if st.st_uid not in trusted_uids():
        raise DaemonNotTrusted(f"refusing to map {what} {describe(path, st)}: it belongs to neither the daemon this "
                               f"client talks to nor a user it trusts; {FIX}")
