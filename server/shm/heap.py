"""Pausing Python's cyclic garbage collector while tens of thousands of long-lived objects are made.

Planning, building and reading a ledger record make an object or more per checkpoint tensor (~92k at
DeepSeek-V3's counts): every 700 allocations a young collection, and now and then a full one, would scan
all of them for cycles they do not have (a third of planning, most of reading a record). What is made
while paused is collected as usual afterwards.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collection_paused():
    """No cyclic collection inside (usable as a decorator); the collector's state before is restored after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
