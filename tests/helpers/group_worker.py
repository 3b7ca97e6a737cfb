"""A worker run as another uid than the daemon's: it reads what it may, tries to change a segment every way the
kernel offers, and prints one JSON line saying how each attempt ended (tests/attacks/test_group_mode.py).

Usage: group_worker.py ENDPOINT member   (a uid in the daemon's group: attach, read, attack, read again)
       group_worker.py ENDPOINT outsider SEGMENT_PATH SOCKET_PATH   (a uid outside it: may it read at all?)
       group_worker.py ENDPOINT owner SEGMENT_PATH   (the daemon's own uid, as every worker is in a single-user set-up)
"""

import ctypes
import errno
import hashlib
import json
import mmap
import os
import sys

import torch


def attempt(action) -> str:
    """'allowed', or the errno name the kernel refused with."""
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "allowed"


def digest(views) -> str:
    h = hashlib.sha256()
    for name in sorted(views):
        h.update(name.encode())
        h.update(views[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_writable(tensor) -> None:
    """mprotect the page of the client's read-only mapping that holds `tensor` to read-write."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    if libc.mprotect(start, page, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def attacks(path: str, run_dir: str, tensor) -> dict:
    """Every way to change segment `path` (or what names it) that does not go through the daemon."""

    def open_close(flags):
        return lambda: os.close(os.open(path, flags))

    def map_shared_writable():
        fd = os.open(path, os.O_RDONLY)
        try:
            mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
        finally:
            os.close(fd)

    return {
        "open O_RDWR": attempt(open_close(os.O_RDWR)),
        "open O_WRONLY|O_TRUNC": attempt(open_close(os.O_WRONLY | os.O_TRUNC)),
        "truncate": attempt(lambda: os.truncate(path, 0)),
        "unlink": attempt(lambda: os.unlink(path)),
        "rename": attempt(lambda: os.rename(path, path + ".moved")),
        "chmod 0666": attempt(lambda: os.chmod(path, 0o666)),
        "mmap MAP_SHARED writable": attempt(map_shared_writable),
        "mprotect the client's mapping writable": attempt(lambda: make_writable(tensor)),
        "create a file in the run folder": attempt(open_close_new(os.path.join(run_dir, "planted.json"))),
    }


def open_close_new(path: str):
    return lambda: os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))


def member(endpoint: str) -> dict:
    from expertd.client import ExpertClient

    with ExpertClient(endpoint, timeout=60) as client:
        views = client.tensors()
        index = client.index()
        before = digest(views)
        entry = max(index.tensors, key=lambda e: e.nbytes)  # an expert's weights: the bytes an attacker wants
        path = os.path.join(index.shm_dir, entry.segment.lstrip("/"))
        name = next(n for n, e in index.checkpoint_entries().items() if e.segment == entry.segment)
        tried = attacks(path, os.path.dirname(endpoint[len("ipc://"):]), views[name])
        return {"uid": os.getuid(), "groups": os.getgroups(), "segment": path, "tensors": len(views),
                "attacks": tried, "unchanged": digest(client.tensors()) == before, "verify": client.verify()}


def outsider(endpoint: str, segment: str, socket: str) -> dict:
    from expertd.client import ExpertClient
    from expertd.errors import ExpertdError

    try:
        ExpertClient(endpoint, timeout=10).close()
        said = "attached"
    except ExpertdError as exc:
        said = f"{type(exc).__name__}: {exc}"
    return {"uid": os.getuid(), "groups": os.getgroups(),
            "read the segment": attempt(lambda: os.close(os.open(segment, os.O_RDONLY))),
            "reach the socket": attempt(lambda: os.stat(socket)), "attach": said}


if __name__ == "__main__":
    endpoint, role = sys.argv[1], sys.argv[2]
    if role == "owner":  # opened for writing and closed: nothing is changed
        print(json.dumps({"uid": os.getuid(),
                          "open O_RDWR": attempt(lambda: os.close(os.open(sys.argv[3], os.O_RDWR)))}))
    else:
        print(json.dumps(member(endpoint) if role == "member" else outsider(endpoint, *sys.argv[3:5])), flush=True)
