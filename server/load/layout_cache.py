"""The layout cache: transformers' answer to "which checkpoint tensors make which parameter", kept between starts.

Planning a checkpoint asks the installed transformers (`expertd.hf.checkpoint_assembly`); importing it and building
the model's skeleton on the meta device is most of a start whose weights are adopted or small (about 4.5 of 7 s on
two cores). The answer depends only on the checkpoint's config.json, the names of its tensors, the transformers and
torch installed and expertd's own code that asks, so it is kept under a key that digests all of them: a start that
finds its key reads the answer and never imports transformers; one that does not asks transformers and writes it.
A parameter transformers converts with more than a rename or a stack (`Assembly.computed`) needs transformers at
load anyway: such an answer is not kept. Every check that follows the answer (shapes, formats, scales) still runs.

The folder is the daemon's own, by the rules of its run folder (`server/shm/hostpaths.py`): made 0700; a folder
that is a symlink, is another uid's, or that others may write (it or a folder above it) is not used (one warning,
planning asks transformers). An entry is read only when it is a regular file of this uid that nobody else may write
(`hostpaths.check_file`), holding its own key; any other is ignored (one warning) and replaced. At most
`MAX_ENTRIES` entries are kept, the least lately used removed first.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile

from ..shm.hostpaths import UnsafePath, check_file, ensure_private_dir

SCHEMA = 1
MAX_ENTRIES = 256  # a few KB each for most checkpoints; the test suite alone makes about 60
MAX_ENTRY_BYTES = 256 << 20  # DeepSeek-V3's ~92k tensor names make a few MB
# expertd's modules whose code decides the answer (and this one, which writes it): a change to any is another key
_CODE = ("expertd.hf", "expertd.hf_dtypes", "expertd.fusion", __name__)

log = logging.getLogger("expertd.loader")


def default_folder() -> str:
    """$XDG_CACHE_HOME/expertd/layouts, else ~/.cache/expertd/layouts (the daemon's uid's own)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "expertd", "layouts")


class LayoutCache:
    """`checkpoint_assembly` answered from `folder` where it can be; `hit` says whether the last answer was read."""

    def __init__(self, folder: str, max_entries: int = MAX_ENTRIES):
        self.folder = folder
        self.max_entries = max_entries
        self.hit = False
        self.usable = _own_folder(folder)

    def assembly(self, config: dict, names: list[str]):
        """(assembly, unused names, expected (shape, dtype) by parameter): see `expertd.hf.checkpoint_assembly`."""
        from expertd.hf import checkpoint_assembly

        self.hit = False
        if not self.usable:
            return checkpoint_assembly(config, names)
        key = entry_key(config, names)
        path = os.path.join(self.folder, f"{key}.json")
        known = self._read(path, key)
        if known is not None:
            self.hit = True
            return known
        answer = checkpoint_assembly(config, names)
        entry = encode(key, *answer)
        if entry is not None:
            self._write(path, entry)
        return answer

    def _read(self, path: str, key: str):
        try:
            if check_file(path, "layout cache entry") is None:  # the daemon's regular file nobody else may write
                return None
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # never a link put there meanwhile
        except (UnsafePath, OSError) as exc:
            log.warning("layout cache: ignored %s (%s); asking transformers", path, exc)
            return None
        try:
            size = os.fstat(fd).st_size
            why = f"{size} bytes, more than {MAX_ENTRY_BYTES}" if size > MAX_ENTRY_BYTES else None
            if why is None:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    try:
                        answer = decode(key, json.loads(f.read()))
                    except (ValueError, TypeError, KeyError, AttributeError) as exc:
                        why = f"not a layout entry of this key: {exc}"
            if why is not None:
                log.warning("layout cache: ignored %s (%s); asking transformers", path, why)
                return None
        finally:
            os.close(fd)
        try:
            os.utime(path)  # lately used: the last to be pruned
        except OSError:
            pass
        return answer

    def _write(self, path: str, entry: dict) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")  # 0600
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entry, f, separators=(",", ":"))
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
            self._prune()
        except OSError as exc:  # a full or read-only disk costs the next start the same time, nothing else
            log.warning("layout cache: could not write %s: %s", path, exc.strerror or exc)

    def _prune(self) -> None:
        entries = []
        for name in os.listdir(self.folder):
            if name.endswith(".json") and not name.startswith("."):
                try:
                    entries.append((os.lstat(os.path.join(self.folder, name)).st_mtime, name))
                except FileNotFoundError:
                    continue
        for _, name in sorted(entries)[: max(0, len(entries) - self.max_entries)]:
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass


def _own_folder(folder: str) -> bool:
    """Make the folder (0700, `hostpaths.ensure_private_dir`) where it is missing; whether it is this uid's own, nobody
    else may write it or a folder above it, and it is no link (the cache folder is never one)."""
    try:
        if os.path.islink(folder):
            raise UnsafePath(f"layout cache {folder} is a symlink")
        ensure_private_dir(folder, "layout cache")
    except (UnsafePath, OSError) as exc:
        log.warning("%s: not used, every start asks transformers; set `layout_cache:` to a folder of this uid's own, "
                    "or false", exc)
        return False
    return True


def _transformers() -> str:
    """The installed transformers' version and where it lies, without importing it."""
    spec = importlib.util.find_spec("transformers")
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version} {spec.origin if spec else None}"


@functools.cache
def _code() -> str:
    """The digest of `_CODE` as this process loaded it (read once)."""
    h = hashlib.sha256()
    for name in _CODE:
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def entry_key(config: dict, names: list[str]) -> str:
    """The digest of everything the answer depends on: config.json, the tensor names, transformers, torch, the code."""
    import torch

    what = {"schema": SCHEMA, "config": config, "names": sorted(names), "transformers": _transformers(),
            "torch": torch.__version__, "code": _code()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def encode(key: str, assembly: dict, unused: list[str], expected: dict) -> dict | None:
    """The answer as JSON; None where a parameter is computed (kept only in transformers' own objects)."""
    if any(a.computed for a in assembly.values()):
        return None
    return {"schema": SCHEMA, "key": key,
            "assembly": {p: [a.sources, list(a.patterns)] for p, a in assembly.items()},
            "unused": unused,
            "expected": {p: [list(shape), str(dtype).removeprefix("torch.")] for p, (shape, dtype) in expected.items()}}


def decode(key: str, entry: dict):
    """The answer an entry holds, every field checked; ValueError (or TypeError, KeyError) where it is not one."""
    import torch

    from expertd.hf import Assembly

    if entry.get("schema") != SCHEMA or entry.get("key") != key:
        raise ValueError("another schema or key")

    def strings(value) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("a list of names is not one")
        return value

    assembly = {}
    for param, (sources, patterns) in entry["assembly"].items():
        assembly[param] = Assembly(param, strings(sources), tuple(strings(patterns)))
    expected = {}
    for param, (shape, dtype) in entry["expected"].items():
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"shape of {param!r} is not one")
        value = getattr(torch, dtype) if isinstance(dtype, str) else None
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype of {param!r} is not one")
        expected[param] = (tuple(shape), value)
    return assembly, strings(entry["unused"]), expected
