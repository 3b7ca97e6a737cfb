"""Hold a module's import in another process until the test opens the gate: proof that what that process does
meanwhile (answer requests, serve adopted generations, stop) never needed the module.

`gated_env(folder, "torch")` returns an environment whose Python blocks in `import torch` (any thread) until
`open_gate(folder)`; the blocked thread holds only that module's import lock, as a slow import would.
"""

from __future__ import annotations

import os

_SITECUSTOMIZE = '''\
import os, sys, time

class _Gate:
    """A meta path finder that waits at {modules!r} until {gate!r} exists (a test's import gate)."""

    def find_spec(self, name, path=None, target=None):
        if name in {modules!r}:
            with open({log!r}, "a") as f:
                f.write(name + "\\n")
            while not os.path.exists({gate!r}):
                time.sleep(0.02)
        return None

sys.meta_path.insert(0, _Gate())
'''


def gated_env(folder: str, *modules: str) -> dict:
    """The environment of a process whose imports of `modules` wait for `open_gate(folder)`."""
    site = os.path.join(folder, "gate-site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(modules=set(modules), gate=_gate(folder), log=_log(folder)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": site + (os.pathsep + path if path else "")}


def waiting(folder: str) -> list[str]:
    """The gated imports that have been asked for so far (each waits until the gate opens)."""
    try:
        with open(_log(folder)) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def open_gate(folder: str) -> None:
    open(_gate(folder), "w").close()


def _gate(folder: str) -> str:
    return os.path.join(folder, "gate-open")


def _log(folder: str) -> str:
    return os.path.join(folder, "gate-asked")
