"""The loader's errors as a vLLM user meets them: in vLLM's option words, and raised by `LLM()` in every mode.

The client's messages name the CLI's options (`--endpoint`, `--timeout`); in an engine the option is a key of
`model_loader_extra_config` (`engine_words`). With the multi-process engine (the default, and `vllm serve`'s) the
loader runs in a worker two processes below the user's: vLLM logs the error there and the user's `LLM()` raises
"Engine core initialization failed" some hundred lines later. So the frontend makes a private folder (mkdtemp: 0700,
a random name) before it starts the engine core and names it in `$EXPERTD_VLLM_ERRORS`, which the engine core and
its workers inherit; a worker whose load fails writes the typed error there (`reported`), and the frontend raises it,
chained to vLLM's RuntimeError, as the last thing the user sees (`install`). Needs vLLM (registered by `register`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
import stat
import tempfile
import weakref

from expertd import errors as error_types
from expertd.errors import ExpertdError

ERRORS_ENV = "EXPERTD_VLLM_ERRORS"
# the client's words for the CLI (expertd/connection.py) -> the same option of `load_format="expertd"`
ENGINE_WORDS = {
    "point to the right one with --endpoint / $EXPERTD_ENDPOINT":
        'name the right one: model_loader_extra_config={"endpoint": ...}, for vllm serve --model-loader-extra-config '
        '\'{"endpoint": ...}\', or $EXPERTD_ENDPOINT',
    "--endpoint": 'model_loader_extra_config\'s "endpoint"',
    "--timeout": 'model_loader_extra_config\'s "timeout"',
    "--server-key": 'model_loader_extra_config\'s "server_key"',
}
_folders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # vLLM's CoreEngineProcManager -> its folder


def in_engine_words(message: str) -> str:
    for cli, option in ENGINE_WORDS.items():
        message = message.replace(cli, option)
    return message


@contextlib.contextmanager
def engine_words():
    """Re-raise an expertd error whose message names a CLI option with the engine's option instead (same type,
    same traceback)."""
    try:
        yield
    except ExpertdError as exc:
        message = in_engine_words(str(exc))
        if message == str(exc):
            raise
        again = copy.copy(exc)  # keeps what the class carries besides its message (DaemonError.kind)
        again.args = (message,)
        raise again.with_traceback(exc.__traceback__) from None


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


def _starting(start):
    """vLLM's `CoreEngineProcManager.__init__`: for `load_format="expertd"`, its engine cores start with a private
    folder of this process's named in `$EXPERTD_VLLM_ERRORS`, removed with the manager."""

    @functools.wraps(start)
    def wrapper(self, *args, **kwargs):
        config = kwargs.get("vllm_config")
        if getattr(getattr(config, "load_config", None), "load_format", None) != "expertd":
            return start(self, *args, **kwargs)
        folder = tempfile.mkdtemp(prefix="expertd-vllm-")
        _folders[self] = folder
        weakref.finalize(self, shutil.rmtree, folder, True)
        before = os.environ.get(ERRORS_ENV)
        os.environ[ERRORS_ENV] = folder
        try:
            return start(self, *args, **kwargs)
        finally:
            if before is None:
                os.environ.pop(ERRORS_ENV, None)
            else:
                os.environ[ERRORS_ENV] = before

    return wrapper


def _waiting(wait):
    """vLLM's `wait_for_engine_startup`: when the engine core failed and a worker recorded an expertd error, that
    error is raised from vLLM's RuntimeError."""

    @functools.wraps(wait)
    def wrapper(*args, **kwargs):
        launch = kwargs.get("launch", args[-1] if args else None)
        folder = _folders.get(getattr(launch, "engine_manager", None))
        try:
            return wait(*args, **kwargs)
        except RuntimeError as exc:
            cause = recorded(folder) if folder else None
            if cause is None:
                raise
            raise cause from exc
        finally:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)

    return wrapper


def install() -> None:
    """In the process that starts vLLM's engine cores (every process runs it: `register`): make their expertd
    errors this process's. Once per process."""
    from vllm.v1.engine import utils

    if getattr(utils.wait_for_engine_startup, "_expertd", False):
        return
    utils.CoreEngineProcManager.__init__ = _starting(utils.CoreEngineProcManager.__init__)
    utils.wait_for_engine_startup = _waiting(utils.wait_for_engine_startup)
    utils.wait_for_engine_startup._expertd = True
