"""The conditions attach runs under: no cyclic GC, and torch's small ops on one thread while the skeleton is built."""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def attaching(one_thread: bool = False):
    """No cyclic GC while attach allocates its many small objects; with `one_thread`, torch's ops on one thread.

    In a worker that has torch and transformers loaded, one full collection walks millions of
    objects (~0.25 s here) and attach would pay it at random; it runs after, at a time that is ours.
    Building the skeleton runs a few small ops (a router's zeros) that torch splits over its threads: on a
    busy host each waits ~7 ms for its second thread (measured on 2 cores, 2026-11-24), more than the rest of
    the attach; on one thread each takes ~0.1 ms. The thread count is put back afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    threads = torch.get_num_threads() if one_thread else 1
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)
        if was_enabled:
            gc.enable()
