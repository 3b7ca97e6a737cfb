"""Waiting for a condition a daemon or a worker reaches in its own time: polled, with a deadline that turns a hang
into a failure naming what did not happen (never a timing assertion)."""

from __future__ import annotations

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
