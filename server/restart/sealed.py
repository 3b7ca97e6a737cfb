"""Sealed records: the manifest and ledger carry an HMAC-SHA256 under a key only the daemon's uid can read.

What a daemon reads back from its run folder decides which segments it serves and unlinks, so it is input
like any other: a record rewritten by someone without the key (a swapped segment, offset or checksum) fails
its MAC and is not adopted. The key is 32 random bytes (hex) in `{run_dir}/{namespace}.ledger.key`, created
0600 once and reused by successors; a clean stop removes it with the records it signed. A sealed file is the
record's JSON with `"hmac"` as its first key; the MAC covers the exact bytes of the rest, prefixed with the
record's purpose (which file it is), so that one record cannot be passed off as another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets

from expertd.index import json_text, write_text_atomic

from ..shm.hostpaths import UnsafePath, check_file

KEY_MODE = 0o600
_SEAL = re.compile(r'\{"hmac":"([0-9a-f]{64})",')


class Unsealed(ValueError):
    """A record has no MAC, or one that does not match its bytes under this run folder's key."""


def key_path(run_dir: str, namespace: str) -> str:
    return os.path.join(run_dir, f"{namespace}.ledger.key")


def load_key(run_dir: str, namespace: str) -> bytes | None:
    """The run folder's key, or None when there is none; UnsafePath for a key file that is not 0600 and ours."""
    path = key_path(run_dir, namespace)
    if check_file(path, "ledger key", KEY_MODE) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not re.fullmatch(r"[0-9a-f]{64}", text):
        raise UnsafePath(f"ledger key {path} does not hold a key expertd wrote (64 hex digits); remove it and the "
                         f"records it signed ({namespace}.manifest.json, {namespace}.gen*.json)")
    return bytes.fromhex(text)


def ensure_key(run_dir: str, namespace: str) -> bytes:
    """The run folder's key: the one a predecessor made (checked), else a new one, created 0600."""
    key = load_key(run_dir, namespace)
    if key is not None:
        return key
    path = key_path(run_dir, namespace)
    key = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, KEY_MODE)
    except FileExistsError:  # made meanwhile: take that one
        return ensure_key(run_dir, namespace)
    try:
        os.fchmod(fd, KEY_MODE)
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def remove_key(run_dir: str, namespace: str) -> None:
    try:
        os.unlink(key_path(run_dir, namespace))
    except FileNotFoundError:
        pass


def _mac(key: bytes, purpose: str, body: str) -> str:
    return hmac.new(key, purpose.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def write(path: str, data: dict, purpose: str, key: bytes, indent: int | None = None, sort_keys: bool = False) -> None:
    """Write `data` sealed, atomically (temp file 0600 + rename): readers never see half a record."""
    if not data:
        raise ValueError("a sealed record holds at least one key")
    body = json_text(data, indent, sort_keys)
    write_text_atomic(path, f'{{"hmac":"{_mac(key, purpose, body)}",' + body[1:], mode=KEY_MODE)


def read(path: str, purpose: str, key: bytes | None) -> dict:
    """The record at `path` once its MAC checks out; Unsealed (or OSError, ValueError) naming what is wrong."""
    if key is None:
        raise Unsealed(f"{path}: there is no ledger key in its folder to check it against")
    with open(path) as f:
        text = f.read()
    seal = _SEAL.match(text)
    if seal is None:
        raise Unsealed(f"{path}: it carries no MAC where expertd puts it: rewritten by someone without the run "
                       "folder's key (or by an expertd that did not seal it)")
    body = "{" + text[seal.end():]
    if not hmac.compare_digest(seal.group(1), _mac(key, purpose, body)):
        raise Unsealed(f"{path}: its MAC does not match: it was rewritten by someone without the run folder's key")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise Unsealed(f"{path}: not a record")
    return data


def read_record(path: str, purpose: str, run_dir: str, namespace: str) -> dict:
    """The record at `path` sealed under the run folder's key: Unsealed as it is, any other failure a ValueError
    naming the path (a key file that is not ours, UnsafePath, is an OSError)."""
    try:
        return read(path, purpose, load_key(run_dir, namespace))
    except Unsealed:
        raise
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
