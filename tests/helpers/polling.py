"""Waiting for a condition a daemon or a worker reaches in its own time: polled, with a deadline that turns a hang
into a failure naming what did not happen (never a timing assertion)."""

from __future__ import annotations

import os
import time


def wait_until(predicate, what: str, timeout: float = 60.0, every: float = 0.05):
    """The first truthy value of `predicate()`, polled every `every` seconds; AssertionError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def read_available(stream) -> str:
    """What a process's text pipe (`Popen(..., text=True)`'s stdout or stderr) holds now, without waiting: read from
    its file descriptor, set non-blocking (a non-blocking TextIOWrapper.read() fails when the pipe is empty)."""
    os.set_blocking(stream.fileno(), False)
    chunks = []
    while True:
        try:
            chunk = os.read(stream.fileno(), 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
