"""Whom a client trusts before it sends a token or maps a byte: the daemon's socket folder, socket and segments.

Whoever may replace the socket file, or any folder or link on the way to it, collects the token of every client
that connects (its first request, `lease`, carries it), and whoever owns a segment decides the bytes a worker
computes with. So on ipc:// a client first walks the socket's path from `/` one component at a time (never
trusting the kernel's resolution), as OpenSSH's StrictModes checks a home folder:

- a symbolic link on the way is followed only when a trusted uid owns it (root's /var/run -> /run);
- every folder is writable by nobody but its owner (a sticky one such as /tmp aside, and only on the way: never
  as the socket's own folder), and its owner is trusted: root, the client's own uid, a uid named in
  `$EXPERTD_DAEMON_UID` (numbers or user names, comma-separated), or the owner of a folder that sits in a folder
  of a trusted uid nobody else may write (root gave it to the daemon's user: the images' `/run/expertd`);
- the socket is a socket of the socket folder's owner (or of a trusted uid, in a trusted uid's folder).

The socket's owner is then the daemon's uid for this process: segments are mapped only when they belong to a
trusted uid or to such a daemon. A refusal is `DaemonNotTrusted`, one line naming the path, its owner and mode.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Iterator

from .errors import DaemonNotTrusted

_daemons: set[int] = set()  # uids this process found behind a trusted socket: their segments may be mapped
FIX = ("set $EXPERTD_DAEMON_UID to the daemon's user if it is the right daemon, else use a socket in a folder of "
       "your own")
MAX_LINKS = 40  # as the kernel's resolution (ELOOP beyond)


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


def walk(path: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry the kernel meets resolving the absolute `path`, in order, as (its path, its lstat): `/`, each
    folder, each symbolic link (yielded before it is followed, so that a caller may stop there) and last the entry
    `path` names. OSError (ENOENT, ELOOP, ...) when the path cannot be resolved."""
    current, todo, links = "/", [p for p in path.split("/") if p], 0
    yield current, os.lstat(current)
    while todo:
        name = todo.pop(0)
        if name in (".", ""):
            continue
        if name == "..":  # `current` is already resolved: its parent is its real parent
            current = os.path.dirname(current)
            continue
        entry = os.path.join(current, name)
        st = os.lstat(entry)
        yield entry, st
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(entry)
            todo = target.split("/") + todo
            current = "/" if target.startswith("/") else current
        elif stat.S_ISDIR(st.st_mode):
            current = entry
        elif any(p not in ("", ".") for p in todo):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), entry)


def _refuse(path: str, why: str) -> DaemonNotTrusted:
    return DaemonNotTrusted(f"refusing to talk to {path}: {why}; {FIX}")


def _socket_entries(path: str, trusted: set[int]) -> tuple[list[tuple[str, os.stat_result]], str, os.stat_result]:
    """The folders on the way to the socket `path` (links checked as they come) and the socket's own entry."""
    folders, entries = [], walk(path)
    while True:
        try:
            entry, st = next(entries)
        except StopIteration:
            raise _refuse(path, "it is a folder, not a socket") from None
        except OSError as exc:  # DaemonNotTrusted is one too: raised below, never from the walk
            raise _refuse(path, f"its path cannot be followed ({exc.strerror}: {exc.filename})") from None
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            raise _refuse(path, f"the symbolic link {describe(entry, st)} on its way belongs to a user this "
                          "client does not trust, who could point it at a daemon of their own")
        if stat.S_ISDIR(st.st_mode):
            folders.append((entry, st))
        elif not stat.S_ISLNK(st.st_mode):
            return folders, entry, st


def check_socket(path: str) -> int:
    """The daemon's uid behind the ipc:// socket `path`, once every component of its path and the socket are found
    trustworthy (see the module's rules); DaemonNotTrusted naming what is wrong otherwise."""
    trusted = trusted_uids()
    folders, entry, sock = _socket_entries(path, trusted)
    if not stat.S_ISSOCK(sock.st_mode):
        raise DaemonNotTrusted(f"refusing to talk to {path}: {describe(entry, sock)} is not a socket")
    owners, given, parent = set(trusted), None, None
    for k, (folder, st) in enumerate(folders):
        own = k == len(folders) - 1  # the socket's own folder
        if _others_write(st) and (own or not st.st_mode & stat.S_ISVTX or st.st_uid not in trusted):
            raise _refuse(path, f"{'its' if own else 'the'} folder {describe(folder, st)} may be written by others, "
                          "who could replace " + ("the socket" if own else "what lies below it"))
        if st.st_uid not in owners:
            if given is not None or parent is None or parent.st_uid not in trusted or _others_write(parent):
                raise _refuse(path, f"the folder {describe(folder, st)} belongs to a user this client does not "
                              "trust (root, you, $EXPERTD_DAEMON_UID), not given to it in a folder only they may write")
            given = st.st_uid  # root (or a trusted uid) made it theirs: the daemon's user
            owners.add(given)
        parent = st
    folder, st = folders[-1]
    if sock.st_uid != st.st_uid and not (sock.st_uid in trusted and st.st_uid in trusted):
        raise _refuse(path, f"the socket {describe(entry, sock)} in {describe(folder, st)} belongs to neither the "
                      "folder's owner nor a user this client trusts (root, you, $EXPERTD_DAEMON_UID)")
    _daemons.add(sock.st_uid)
    return sock.st_uid


def check_owner(path: str, st: os.stat_result, what: str = "segment") -> None:
    """Refuse to map a segment that belongs to nobody this process trusts (a daemon's uid found by `check_socket`,
    root, itself, $EXPERTD_DAEMON_UID)."""
    if st.st_uid not in trusted_uids():
        raise DaemonNotTrusted(f"refusing to map {what} {describe(path, st)}: it belongs to neither the daemon this "
                               f"client talks to nor a user it trusts; {FIX}")
