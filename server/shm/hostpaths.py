"""Who may touch what on the host: the folders and files the daemon trusts must be its own, writable by nobody else.

What the daemon reads back from its run folder (manifest, ledger) decides what it adopts and unlinks, and its
socket folder decides who answers its clients; a folder another user owns or may write lets that user pose as
the daemon. So, like OpenSSH's StrictModes, the run folder, the socket folder, the ledger and its key must be
owned by the daemon's uid with no group or other write bit (group *read/search* is fine: `group:` deployments
need 0750 or 0710 so that the group reaches the socket), and every folder above them must belong to root or
the daemon's uid and be writable by nobody else unless sticky (like /tmp). Files in the shm folder are unlinked
only when the daemon's uid owns them.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat

from expertd import protocol, trust
from expertd.errors import ExpertdError

log = logging.getLogger("expertd.hostpaths")

GUIDE = 'see README "Who may touch what on the host"'


class UnsafePath(ExpertdError, PermissionError):
    """A folder or file the daemon would trust is not its own, or someone else may write it."""


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def describe(st: os.stat_result) -> str:
    """'owned by uid N (name), mode 0MMM': what a refusal says about a path."""
    return f"owned by {_who(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _ancestor_problem(path: str) -> str | None:
    """Why a folder above ours lets someone else move ours away (None if it does not): it must belong to root or
    us and be writable by nobody else, unless sticky (then only an entry's owner may rename or remove it)."""
    uid = os.geteuid()
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, uid) or _writable_by_others(st) and not st.st_mode & stat.S_ISVTX:
            return (f"the folder above it, {parent}, is {describe(st)}; every folder above must belong to root or "
                    f"{_who(uid)} and be writable by nobody else (or sticky, like /tmp)")
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


def link_problem(path: str) -> str | None:
    """Why the way to `path` may not be trusted (None if it may): a symbolic link on it that someone else owns, who
    could point it elsewhere after the checks (a link of root's, /var/run -> /run, or of this uid is followed)."""
    uid = os.geteuid()
    try:
        for entry, st in trust.walk(os.path.abspath(path)):
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
                return (f"is reached through the symbolic link {entry}, {describe(st)}; expertd follows no link "
                        f"another user may replace (only root's or {_who(uid)}'s)")
    except OSError:
        return None  # what cannot be followed is said by the checks that follow
    return None


def folder_problem(path: str) -> str | None:
    """Why `path` (an existing folder) may not be trusted by this daemon, or None."""
    link = link_problem(path)
    if link is not None:
        return link
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror})"
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid or _writable_by_others(st):
        return f"is {describe(st)}; expertd needs it owned by {_who(uid)} and not writable by group or others"
    return _ancestor_problem(real)


def check_folder(path: str, what: str) -> None:
    """Refuse (UnsafePath, one line naming the path, its owner and mode) a folder this daemon may not trust."""
    problem = folder_problem(path)
    if problem is not None:
        raise UnsafePath(f"{what} {path} {problem} ({GUIDE})")


def ensure_private_dir(path: str, what: str) -> list[str]:
    """Create `path` 0700 (and the folders missing above it, 0700 too) or check the one there; the folders
    created, outermost first, so that a clean stop or a failed start can remove them again."""
    path = os.path.abspath(path)
    missing = []
    existing = path
    while not os.path.isdir(existing) and existing != os.path.dirname(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    if missing:  # never create anything under a folder (or through a link) someone else could swap
        problem = link_problem(path) or _ancestor_problem(os.path.join(os.path.realpath(existing), "x"))
        if problem is not None:
            raise UnsafePath(f"{what} {path}: {problem} ({GUIDE})")
    created = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue  # made meanwhile (another daemon): checked below like any folder that was there
        except FileNotFoundError:  # a folder above went meanwhile (a stopping daemon's empty runtime base): again
            return created + ensure_private_dir(path, what)
        os.chmod(folder, 0o700)  # whatever the umask
        created.append(folder)
    check_folder(path, what)
    return created


def remove_created(created: list[str], path: str) -> None:
    """Remove the folders `ensure_private_dir` made for `path`, innermost first, each only when empty; and the
    runtime base when `path` is a default run folder in it and was its last (another daemon may have made the
    base: a stop leaves nothing of its own under /tmp either way)."""
    base = runtime_base()
    if os.path.dirname(os.path.abspath(path)) == base and base not in created:
        created = [base, *created]
    for folder in reversed(created):  # innermost first; one that is not empty keeps those above it too
        try:
            os.rmdir(folder)
        except OSError:
            continue


def check_file(path: str, what: str, mode: int | None = None) -> os.stat_result | None:
    """Refuse a file this daemon would trust (ledger, manifest, key) that is not a regular file of its uid, or that
    others may write (with `mode`: that is not exactly this mode); None when it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    uid = os.geteuid()
    want = f"a regular file owned by {_who(uid)}, " + (f"mode {mode:04o}" if mode is not None else
                                                       "not writable by group or others")
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or (
            stat.S_IMODE(st.st_mode) != mode if mode is not None else _writable_by_others(st)):
        kind = "" if stat.S_ISREG(st.st_mode) else "not a regular file, "
        raise UnsafePath(f"{what} {path} is {kind}{describe(st)}; expertd needs {want} ({GUIDE})")
    return st


def check_socket(path: str) -> None:
    """Refuse a socket path that holds anything but a socket of this daemon's uid (one planted by someone else
    would be theirs to answer on); nothing there is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    uid = os.geteuid()
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
        kind = "a socket" if stat.S_ISSOCK(st.st_mode) else "not a socket"
        raise UnsafePath(f"control socket {path} exists, {kind}, {describe(st)}; expertd only replaces a socket "
                         f"{_who(uid)} left: remove it if it is stale ({GUIDE})")


def runtime_base() -> str:
    """Where a daemon keeps its socket and run folders when its config names none (`expertd.protocol.runtime_base`:
    /run/expertd for root, else $XDG_RUNTIME_DIR/expertd or /tmp/expertd-UID, made 0700, checked if it exists)."""
    return protocol.runtime_base()


def owned(path: str) -> bool | None:
    """Whether this daemon's uid owns `path` (never following a link); None when it does not exist."""
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except FileNotFoundError:
        return None


def unlink_owned(path: str, what: str = "file") -> bool:
    """Unlink `path` only when this daemon's uid owns it: another user's file with a segment-like name is left
    alone, with one log line. False when nothing was removed."""
    mine = owned(path)
    if mine is None:
        return False
    if not mine:
        st = os.lstat(path)
        log.warning("leaving %s %s alone: it is %s, not this daemon's (%s)", what, path, describe(st),
                    _who(os.geteuid()))
        return False
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
