"""The loader's errors as a vLLM user meets them: in vLLM's option words, and raised by `LLM()` in every mode.

The client's hints name the caller's options as a vLLM user knows them, keys of `model_loader_extra_config`
(`options.VLLM_WORDS`, handed to the client, which words its messages so). With the multi-process engine (the
default, and `vllm serve`'s) the loader runs in a worker two processes below the user's: vLLM logs the error there
and the user's `LLM()` raises "Engine core initialization failed" some hundred lines later. So the frontend makes a
private folder (mkdtemp: 0700, a random name) before it starts the engine core and names it in
`$EXPERTD_VLLM_ERRORS`, which the engine core and its workers inherit; a worker whose load fails writes the typed
error there (`reported`), and the frontend raises it, chained to vLLM's RuntimeError, as the last thing the user sees
(`install`: vLLM's startup runs through `_starting` and `_waiting` by `hooks.patch_startup`, the adapter's one place
that names vLLM internals). Needs vLLM (registered by `register`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import weakref

from expertd import errors as error_types
from expertd.errors import ExpertdError

from .hooks import patch_startup

ERRORS_ENV = "EXPERTD_VLLM_ERRORS"
_folders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # vLLM's CoreEngineProcManager -> its folder


def record(exc: ExpertdError) -> None:
    """Write `exc` into the frontend's folder ($EXPERTD_VLLM_ERRORS), when this process has one: a file of its own,
    made O_EXCL and 0600 in a folder that must be this user's and private."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder:
        return
    try:
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return
        path = os.path.join(folder, f"{os.getpid()}.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return  # the frontend is gone, or this process already said it: vLLM's own log still has it
    with os.fdopen(fd, "w") as f:
        json.dump({"type": type(exc).__name__, "message": str(exc)}, f)


@contextlib.contextmanager
def recording():
    try:
        yield
    except ExpertdError as exc:
        record(exc)
        raise


def reported(loader: type) -> type:
    """`loader` (the "expertd" `BaseModelLoader`) whose typed errors also reach the frontend (`record`)."""

    class Reported(loader):
        def __init__(self, load_config):
            with recording():
                super().__init__(load_config)

        def load_model(self, *args, **kwargs):
            with recording():
                return super().load_model(*args, **kwargs)

    Reported.__name__, Reported.__qualname__, Reported.__doc__ = loader.__name__, loader.__qualname__, loader.__doc__
    return Reported


def recorded(folder: str) -> ExpertdError | None:
    """The first error a worker wrote into `folder`, as its expertd type (ExpertdError when the type is unknown)."""
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                found.append((os.stat(path).st_mtime_ns, json.load(f)))
    if not found:
        return None
    first = min(found, key=lambda item: item[0])[1]
    cls = getattr(error_types, str(first.get("type")), None)
    cls = cls if isinstance(cls, type) and issubclass(cls, ExpertdError) else ExpertdError
    return cls(str(first.get("message")))


def _starting(manager, config, start):
    """vLLM's engine cores started by `manager` (`hooks.patch_startup`): for `load_format="expertd"`, with a private
    folder of this process's named in `$EXPERTD_VLLM_ERRORS`, removed with the manager."""
    if getattr(getattr(config, "load_config", None), "load_format", None) != "expertd":
        return start()
    folder = tempfile.mkdtemp(prefix="expertd-vllm-")
    _folders[manager] = folder
    weakref.finalize(manager, shutil.rmtree, folder, True)
    before = os.environ.get(ERRORS_ENV)
    os.environ[ERRORS_ENV] = folder
    try:
        return start()
    finally:
        if before is None:
            os.environ.pop(ERRORS_ENV, None)
        else:
            os.environ[ERRORS_ENV] = before


def _waiting(manager, wait):
    """vLLM's wait for the engine cores of `manager` (`hooks.patch_startup`): when one failed and a worker recorded
    an expertd error, that error is raised from vLLM's RuntimeError."""
    folder = _folders.get(manager) if manager is not None else None
    try:
        return wait()
    except RuntimeError as exc:
        cause = recorded(folder) if folder else None
        if cause is None:
            raise
        raise cause from exc
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def install() -> None:
    """In the process that starts vLLM's engine cores (every process runs it: `register`): make their expertd
    errors this process's. Once per process; left out, with a warning, where vLLM lacks what it patches."""
    patch_startup(_starting, _waiting)
