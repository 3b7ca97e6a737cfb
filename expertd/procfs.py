"""What /proc says about processes, shared by the daemon and the client (which must not import server code).

A pid alone names a process only while it lives: the kernel reuses pids. A pid with its start time
(clock ticks since boot, field 22 of /proc/PID/stat) names one process for good. Pids mean something
only within one pid namespace, named here by the inode of /proc/self/ns/pid.
"""

from __future__ import annotations

import ctypes
import os

GONE_STATES = ("Z", "X", "x")  # zombie, dead: the process has exited (its memory is released)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if no such process."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process that had `pid` and `start_time` still runs: False when the pid is gone, is a
    zombie (exited, not yet waited for) or now names another process (reused)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in GONE_STATES and int(fields[19]) == start_time


def pid_namespace() -> int | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or None where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def runs_expertd(pid: int) -> bool | None:
    """Whether process `pid` runs expertd (its command line names it); None when /proc cannot tell (gone, or
    another user's process hidden). One rule for the reaper (which treats "cannot tell" as live) and `stop`."""
    line = command_line(pid)
    return None if line is None else b"expertd" in line


def command_line(pid: int) -> bytes | None:
    """Process `pid`'s /proc/PID/cmdline (empty while it exits, and for kernel threads); None when unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def process_state(pid: int) -> str | None:
    """Process `pid`'s state letter in /proc/PID/stat (R, S, D, Z for exited and not yet reaped, ...); None when
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return None


def default_threads() -> int:
    """The cores this process may run on (its affinity mask, which containers' cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


PR_SET_NAME = 15  # prctl: the calling thread's name, 15 bytes at most (/proc/PID/task/TID/comm, top -H, gdb)


def name_this_thread(name: str) -> None:
    """Give the calling thread its name in the kernel as well (Python 3.11 keeps `Thread.name` to itself), so that
    an operator's `top -H`, gdb or /proc/PID/task/*/comm tell a build from the request loop; cut to 15 bytes.
    Nothing happens where there is no prctl (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
