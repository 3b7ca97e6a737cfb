"""Read a HuggingFace safetensors checkpoint: structure checked up front, tensors one at a time.

`Checkpoint.open` parses config.json, the shard index and every shard header, and refuses anything malformed
before a byte is loaded. Tensor data is then read a tensor (or a piece of one) at a time: memory stays bounded.

Every file is opened through `open_regular`: only regular files are read. A FIFO named config.json
would block the open (it wedged a reload's build slot), /dev/zero as a shard never ends, a folder
or a socket is no file at all; each is one `NotRegularFileError` naming the file and what it is.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
import struct
import threading
import warnings
from dataclasses import dataclass

import torch
from safetensors import safe_open

from expertd.dtypes import SAFETENSORS
from expertd.errors import (
    CheckpointError,
    MissingShardError,
    MissingTensorError,
    NotACheckpointError,
    NotRegularFileError,
    ShardFormatError,
    UnsupportedDtypeError,
)

from ..shm.heap import collection_paused

INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {dtype: str(dtype) for dtype in SAFETENSORS.values()}  # str() of a torch dtype costs a call into torch
SINGLE_FILE = "model.safetensors"
CHECKPOINT_HOLDS = ("a HuggingFace checkpoint folder holds config.json (the model's architecture) beside its weights "
                    f"({INDEX_FILE} and the shards it names, or one {SINGLE_FILE}): point `checkpoint:` (or "
                    "--checkpoint) at the folder save_pretrained or the Hub download wrote")
MAX_HEADER_BYTES = 100 << 20
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def _not_regular(path: str, real: str, what: str, mode: int) -> NotRegularFileError:
    kind = next((name for test, name in _KINDS if test(mode)), f"of file type {stat.S_IFMT(mode):#o}")
    linked = real != os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    link = f"a symlink to {real}, which is " if linked else ""
    return NotRegularFileError(f"{what} is {link}{kind}, not a regular file; expertd reads only regular files",
                               file=path)


def open_regular(path: str, what: str) -> tuple[int, os.stat_result]:
    """Open a checkpoint file read-only if it is a regular file: (fd, its fstat); else `NotRegularFileError`.

    Symlinks are followed on purpose (a HuggingFace cache links snapshots/REV/*.safetensors to ../../blobs/HASH):
    the path is resolved with realpath, the target must be a regular file wherever it is, and it is opened with
    O_NOFOLLOW (a link swapped in after the realpath is refused, not followed) and O_NONBLOCK (a FIFO swapped in
    cannot block the open; reads of a regular file ignore the flag); fstat of what was opened decides. A target
    that is no regular file is refused by stat before any open, so no device is ever opened. OSError (missing,
    permission) propagates for the caller to name.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, real, what, st.st_mode)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(f"{what} was replaced by a symlink while being opened", file=path) from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(path, real, what, st.st_mode)
    return fd, st



@dataclass(slots=True, unsafe_hash=True)  # read-only by convention: a frozen dataclass costs ~4x to make
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # where the data starts in the file

    def rows(self, first: int, count: int) -> "TensorInfo":
        """Rows [first, first + count) of the outermost dimension: contiguous bytes of the same file (an expert
        stack's share, for a partitioned daemon)."""
        row = self.nbytes // self.shape[0]
        return TensorInfo(self.name, self.file, self.dtype, (count, *self.shape[1:]), count * row,
                          self.offset + first * row)


def _reject_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _parse_header(raw: bytes) -> dict:
    """A safetensors header as a dict, duplicate keys refused.

    Parsed by json's C code alone (a Python hook would cost ~10 us for each of tens of thousands of
    entries); a duplicate tensor name or field would leave more "dtype" / "shape" / "data_offsets" keys
    in the text than entries parsed, and only then is the header parsed again, key by key.
    """
    header = json.loads(raw)
    if isinstance(header, dict):
        n = len(header) - ("__metadata__" in header)
        if all(raw.count(key) == n for key in (b'"dtype"', b'"shape"', b'"data_offsets"')):
            return header
        return json.loads(raw, object_pairs_hook=_reject_duplicate_keys)
    return header


def read_json(path: str, what: str) -> dict:
    try:
        fd, _ = open_regular(path, what)
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(), object_pairs_hook=_reject_duplicate_keys)
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise MissingShardError(f"{what} not found", file=path) from exc
    except OSError as exc:
        raise CheckpointError(f"{what} is unreadable: {exc.strerror}", file=path) from exc
    except ValueError as exc:
        raise CheckpointError(f"{what} is not valid JSON: {exc}", file=path) from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} must hold a JSON object", file=path)
    return data


def _check_entry(path: str, name: str, entry, data_len: int) -> tuple[int, int, int, torch.dtype]:
    """One header entry checked field by field: (begin, end, nbytes, dtype), or the error that names what is wrong."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ShardFormatError("header entry needs dtype, shape and data_offsets", file=path, tensor=name)
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(tag, str) or tag not in SAFETENSORS:
        raise UnsupportedDtypeError(
            f"dtype {tag!r} is not supported (supported: {', '.join(SAFETENSORS)})", file=path, tensor=name
        )
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ShardFormatError(f"shape {shape!r} is not a list of non-negative integers", file=path, tensor=name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ShardFormatError(f"data_offsets {offsets!r} is not [begin, end]", file=path, tensor=name)
    dtype = SAFETENSORS[tag]
    nbytes = math.prod(shape) * dtype.itemsize
    begin, end = offsets
    if begin < 0 or end < begin or end - begin != nbytes:
        raise ShardFormatError(
            f"data_offsets {offsets} span {end - begin} bytes but {tag}{shape} needs {nbytes}", file=path, tensor=name
        )
    if end > data_len:
        raise ShardFormatError(
            f"data_offsets {offsets} run past the end of the data ({data_len} bytes; truncated shard?)",
            file=path,
            tensor=name,
        )
    return begin, end, nbytes, dtype


def read_shard_header(path: str) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header: dtypes known, offsets inside the file, no overlaps."""
    try:
        fd, st = open_regular(path, "shard")
        size = st.st_size
        with os.fdopen(fd, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ShardFormatError(f"file of {size} bytes is too short for a safetensors header", file=path)
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise ShardFormatError(
                    f"header length {header_len} runs past the end of the {size}-byte file (truncated?)", file=path
                )
            raw = f.read(header_len)
    except FileNotFoundError as exc:
        raise MissingShardError("shard not found", file=path) from exc
    except OSError as exc:
        raise CheckpointError(f"shard is unreadable: {exc.strerror}", file=path) from exc
    try:
        header = _parse_header(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ShardFormatError(f"safetensors header is not valid JSON: {exc}", file=path) from exc
    if not isinstance(header, dict):
        raise ShardFormatError("safetensors header must be a JSON object", file=path)
    data_len = size - 8 - header_len
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:  # the common case in a few C calls; anything unusual is checked field by field below
            tag, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            dtype = SAFETENSORS[tag]
            nbytes = math.prod(shape) * dtype.itemsize
            plain = (type(shape) is list and type(nbytes) is int and type(begin) is int and type(end) is int
                     and min(shape, default=0) >= 0 and 0 <= begin <= end <= data_len and end - begin == nbytes)
        except (TypeError, KeyError, ValueError):
            plain = False
        if not plain:
            begin, end, nbytes, dtype = _check_entry(path, name, entry, data_len)
        spans.append((begin, end, name))
        infos[name] = TensorInfo(name, path, dtype, tuple(shape), nbytes, 8 + header_len + begin)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0 and e0 > b0 and e1 > b1:
            raise ShardFormatError(f"data of {n0!r} [{b0}, {e0}) overlaps {n1!r} [{b1}, {e1})", file=path, tensor=n1)
    return infos


class Checkpoint:
    """A checked checkpoint folder: config, tensor catalogue, and one-at-a-time tensor reads."""

    def __init__(self, folder: str, config: dict, tensors: dict[str, TensorInfo]):
        self.folder = folder
        self.config = config
        self.tensors = tensors
        self._handles: dict[str, object] = {}
        self._files: dict[str, tuple] = {}  # file -> (device, inode, size, mtime): what its identities start with
        self._maps: dict[str, torch.Tensor] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # tensor bytes read (or mapped for reading) since opened: what a partition saves

    @classmethod
    @collection_paused()  # an info per checkpoint tensor
    def open(cls, folder: str) -> "Checkpoint":
        folder = os.path.abspath(folder)
        if not os.path.isdir(folder):
            raise MissingShardError("checkpoint folder does not exist or is not a folder; point `checkpoint:` "
                                    "(or --checkpoint) at a HuggingFace checkpoint folder (config.json and "
                                    "*.safetensors)", file=folder)
        if not os.access(folder, os.R_OK | os.X_OK):
            raise CheckpointError("checkpoint folder is unreadable (permission denied)", file=folder)
        if not os.path.lexists(os.path.join(folder, "config.json")):
            raise NotACheckpointError(f"checkpoint folder {folder} has no config.json; {CHECKPOINT_HOLDS}")
        config = read_json(os.path.join(folder, "config.json"), "config.json")
        index_path = os.path.join(folder, INDEX_FILE)
        if os.path.exists(index_path):
            weight_map = read_json(index_path, INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError("'weight_map' must map tensor names to shard file names", file=index_path)
        elif os.path.exists(os.path.join(folder, SINGLE_FILE)):
            index_path, weight_map = None, None
        else:
            raise NotACheckpointError(f"checkpoint folder {folder} has neither {INDEX_FILE} nor {SINGLE_FILE}; "
                                      + CHECKPOINT_HOLDS)

        shard_names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        tensors: dict[str, TensorInfo] = {}
        for shard in shard_names:
            path = os.path.join(folder, shard)
            if os.path.dirname(os.path.normpath(shard)) not in ("",):
                raise CheckpointError(f"shard name {shard!r} must be a file name inside the checkpoint",
                                      file=index_path)
            for name, info in read_shard_header(path).items():
                if name in tensors:
                    raise CheckpointError(
                        f"duplicate tensor: also stored in {os.path.basename(tensors[name].file)}", file=path,
                        tensor=name,
                    )
                tensors[name] = info
        if weight_map is not None:
            paths = {shard: os.path.join(folder, shard) for shard in shard_names}
            for name, shard in weight_map.items():
                info = tensors.get(name)
                if info is None:
                    raise MissingTensorError(
                        f"index names tensor in shard {shard} but that shard's header lacks it",
                        file=os.path.join(folder, shard),
                        tensor=name,
                    )
                if info.file != paths[shard]:
                    raise CheckpointError(
                        f"index places tensor in {shard} but it is stored in {os.path.basename(info.file)}",
                        file=index_path,
                        tensor=name,
                    )
            tensors = {name: tensors[name] for name in weight_map}
        return cls(folder, config, tensors)

    def identity(self, info: TensorInfo) -> tuple:
        """Names `info`'s bytes as long as its file is not rewritten: same file (device, inode, size,
        mtime), same place. Equal identities mean equal bytes without reading them."""
        file = self._files.get(info.file)
        if file is None:
            st = os.stat(info.file)
            file = self._files[info.file] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return (*file, info.offset, info.nbytes, _DTYPE_NAMES.get(info.dtype) or str(info.dtype), info.shape)

    def view(self, info: TensorInfo) -> torch.Tensor:
        """A read-only tensor over the tensor's bytes in a mapping of its file: no copy, pages come in as
        they are touched. Falls back to `read` where the data is not aligned for its dtype."""
        if info.nbytes == 0 or info.offset % info.dtype.itemsize:
            return self.load(info)
        data = self._maps.get(info.file)
        if data is None:
            try:
                fd, _ = open_regular(info.file, "shard")
                try:
                    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise ShardFormatError(f"cannot map shard: {exc}", file=info.file, tensor=info.name) from exc
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": read-only is the point
                data = self._maps[info.file] = torch.frombuffer(mapping, dtype=torch.uint8)
        if info.offset + info.nbytes > data.numel():
            raise ShardFormatError(f"data past the end of the {data.numel()}-byte file (truncated since opened?)",
                                   file=info.file, tensor=info.name)
        with self._lock:
            self.bytes_read += info.nbytes
        return data[info.offset: info.offset + info.nbytes].view(info.dtype).view(info.shape)

    def read_into(self, info: TensorInfo, start: int, buf: memoryview) -> None:
        """Bytes [start, start + len(buf)) of a tensor's data into `buf`, with `os.preadv`: the kernel copies
        from the page cache, so no page of the shard is mapped (faster than faulting pages in, and any
        number of threads may read at once)."""
        fd = self.fd(info)
        done, want = 0, len(buf)
        while done < want:
            got = os.preadv(fd, [buf[done:]], info.offset + start + done)
            if got <= 0:
                raise ShardFormatError(f"data ends {want - done} bytes early (truncated since opened?)",
                                       file=info.file, tensor=info.name)
            done += got
        self.counted(want)

    def fd(self, info: TensorInfo) -> int:
        """The open file `info` lies in (opened once, checked as a regular file), for `os.preadv` or compiled reads."""
        fd = self._fds.get(info.file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(info.file)
                if fd is None:
                    try:
                        fd = self._fds[info.file] = open_regular(info.file, "shard")[0]
                    except OSError as exc:
                        raise ShardFormatError(f"cannot open shard: {exc}", file=info.file, tensor=info.name) from exc
        return fd

    def counted(self, nbytes: int) -> None:
        """`nbytes` more tensor bytes read (by whoever read them with `fd`)."""
        with self._lock:
            self.bytes_read += nbytes

    def load(self, info: TensorInfo) -> torch.Tensor:
        """The tensor `info` describes, read through safetensors: the whole checkpoint tensor, or the rows of it
        that `info` (made by `TensorInfo.rows`) covers."""
        whole = self.read(info.name)
        base = self.tensors[info.name]
        if info.offset == base.offset and info.shape == base.shape:
            return whole
        first = (info.offset - base.offset) // (base.nbytes // base.shape[0])
        return whole[first: first + info.shape[0]]

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into memory through safetensors (mmap-backed)."""
        info = self.tensors.get(name)
        if info is None:
            raise MissingTensorError("tensor not in checkpoint", file=self.folder, tensor=name)
        handle = self._handles.get(info.file)
        try:
            if handle is None:
                fd, _ = open_regular(info.file, "shard")
                try:  # safetensors opens a path: the one of the file just checked, not a name that could change
                    handle = self._handles[info.file] = safe_open(f"/proc/self/fd/{fd}", framework="pt")
                finally:
                    os.close(fd)
            return handle.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own types; name the file and tensor
            raise ShardFormatError(f"reading failed: {exc}", file=info.file, tensor=name) from exc

    def close(self) -> None:
        """Drop file handles and mappings (a mapping lives on while a tensor over it does)."""
        self._handles.clear()
        self._maps.clear()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
