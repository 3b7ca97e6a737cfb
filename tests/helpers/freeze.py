"""Make a thread of another process hang for real, the way a read from a dead NFS server does: ptrace stops just that
thread (PTRACE_SEIZE, PTRACE_INTERRUPT) while the process's other threads go on. Linux x86_64 or aarch64; the
tracer must be the process's parent or hold CAP_SYS_PTRACE, and must stay alive (a tracer that ends resumes it).
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import signal
import time

from helpers.polling import read_available

PTRACE_CONT, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 7, 17, 0x4206, 0x4207
WALL = 0x40000000  # waitpid's __WALL: a thread of another process
FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, tid: int) -> None:
    if _libc.ptrace(request, tid, None, None) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")


def threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def thread_named(pid: int, name: str, timeout: float = 30) -> int:
    """The thread of `pid` the kernel knows as `name` (its comm, which the daemon sets for its job threads): tids
    are not in start order once the pid counter wraps (pid_max is 32768 on a small machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tid in threads(pid):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if f.read().strip() == name:
                        return tid
            except FileNotFoundError:  # the thread ended meanwhile
                pass
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} has no thread named {name!r} after {timeout}s")


def freeze(pid: int, tid: int, tries: int = 5000) -> None:
    """Stop thread `tid` of process `pid` where it waits in a futex (a lock, a condition, Python's GIL). Not always
    a place where it holds nothing: it may wait there with the GIL held (a native op waiting for its own helper
    threads) or holding a lock of the program, and then the other threads stop too. The caller checks the process
    still answers, and if not `thaw`s it and freezes it again elsewhere."""
    _ptrace(PTRACE_SEIZE, tid)
    for _ in range(tries):
        _ptrace(PTRACE_INTERRUPT, tid)
        os.waitpid(tid, WALL)
        with open(f"/proc/{pid}/task/{tid}/syscall") as f:
            if f.read().split()[0] == str(FUTEX):
                return
        _ptrace(PTRACE_CONT, tid)
        time.sleep(0.0005)
    raise RuntimeError(f"thread {tid} of {pid} was never caught outside Python's GIL")


def thaw(tid: int) -> None:
    """Let a frozen thread go on (and stop tracing it): it can be frozen again elsewhere."""
    _ptrace(PTRACE_DETACH, tid)


def wait_exit(proc, tid: int, timeout: float) -> int | None:
    """`proc`'s exit code once it has ended, else None after `timeout` seconds. A frozen thread that dies is its
    tracer's to collect, and until it is, the process's exit is not reported: this collects it on the way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.waitpid(tid, WALL | os.WNOHANG)
        except ChildProcessError:
            pass
        if proc.poll() is not None:
            return proc.returncode
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def python_stack(proc, marker: str, said: list, timeout: float = 10) -> str:
    """The Python stack of `proc`'s thread whose frames name `marker` (a file), from the dump its faulthandler writes
    to stderr on SIGQUIT (written without the GIL or any lock of the program); what is read is appended to `said`."""
    proc.send_signal(signal.SIGQUIT)
    got, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline and marker not in got:
        got += read_available(proc.stderr)
        time.sleep(0.02)
    time.sleep(0.2)  # the rest of the dump
    got += read_available(proc.stderr)
    said.append(got)
    found = [b for b in re.split(r"(?:Current thread|Thread) 0x", got) if marker in b]
    if not found:
        raise TimeoutError(f"no thread of process {proc.pid} runs {marker} (SIGQUIT's dump: {got[-2000:]!r})")
    return found[-1]


def where(proc) -> str:
    """What a process that does not end is doing, for a failure's message: each thread's name, the system call it
    is in (or "running") and the kernel function it waits in, then what it wrote to its stderr pipe so far (with
    every thread's Python stack: the daemon dumps them on SIGQUIT)."""
    lines = []
    try:
        proc.send_signal(signal.SIGQUIT)
        time.sleep(1)
    except ProcessLookupError:
        pass
    for tid in threads(proc.pid):
        facts = []
        for name in ("comm", "syscall", "wchan"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/{name}") as f:
                    facts.append(f.read().split("\n")[0].split(" ")[0])
            except OSError:
                facts.append("?")
        lines.append(f"thread {tid} {facts[0]}: syscall {facts[1]}, waits in {facts[2]}")
    if proc.stderr is not None:
        lines.append("stderr so far:\n" + read_available(proc.stderr))
    return "\n".join(lines)
