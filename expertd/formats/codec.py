"""What every checkpoint format answers: its names and checks (the codec) and its dequant entry points.

A format is one class. Its names and checks read names, shapes and dtypes only, never tensor values, so the
planner, updates and the client's `push_all` all ask it. Its dequant entry points make served bytes from stored
ones over the format's kernel; they import `expertd.kernels` inside the method, so importing a format imports
no kernel (the client never calls them). Which bytes are read and where results go is the loader's concern: it
hands `stream` a `Pieces`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import CheckpointError


class UnsupportedQuantization(CheckpointError):
    """config.json's quantization_config names a format expertd does not serve."""


@dataclass(frozen=True)
class Decoding:
    """What a stored quantized weight serves as: the format that decodes it (`codec`, whose dequant entry points
    make it), the decoded shape, the (rows, columns) one scale covers (FP8) and how it is quantized, in words."""

    codec: Codec
    shape: tuple[int, ...]
    block: tuple[int, int] | None = None
    scheme: str = ""


class Pieces(Protocol):
    """One part as the loader hands it to a format's `stream`: its source read and its result placed a piece at a
    time, both hashed in order while they are in cache."""

    chunk: int  # result bytes to make at a time
    most: int  # the most result bytes one piece may take where a scale block is not split

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """Source bytes [offset, offset + nbytes) (uint8), read and hashed."""

    def place(self, offset: int, nbytes: int, dtype: torch.dtype, shape) -> AbstractContextManager[torch.Tensor]:
        """Where result bytes [offset, offset + nbytes) go, as a `dtype` tensor of `shape`: filled inside the
        `with`, hashed when it ends."""


class Codec:
    """A checkpoint format (see the module docstring). Names: a quantized weight served as `NAME` is stored as
    `NAME + stored_suffix` with its aux tensor `NAME + aux_suffix`; any other tensor serves as itself."""

    stored_suffix = ""
    aux_suffix = ""
    batched = False  # whether many small parts go through `batch` at once (the loader's small_parts)

    def aux_name(self, weight: str) -> str:
        return weight + self.aux_suffix

    def is_aux(self, name: str, names) -> bool:
        return name.endswith(self.aux_suffix) and name[: len(name) - len(self.aux_suffix)] + self.stored_suffix in names

    def logical(self, names) -> dict[str, tuple[str, str | None]]:
        """{served name: (stored tensor, aux tensor or None)} for every tensor that is not an aux."""
        out = {}
        for n in names:
            if self.is_aux(n, names):
                continue
            if not n.endswith(self.stored_suffix):
                out[n] = (n, None)
                continue
            base = n[: len(n) - len(self.stored_suffix)]
            aux = self.aux_name(base)
            out[base] = (n, aux if aux in names else None)
        return out

    def shape_of(self, name: str, info) -> tuple[int, ...]:
        """The shape stored tensor `info` (a checkpoint's TensorInfo) serves as under the name `name`."""
        return info.shape

    def quantized(self, name: str, info) -> bool:
        """Whether stored tensor `info`, serving `name`, is a weight in this format's quantized form."""
        raise NotImplementedError

    def decoding(self, name: str, info, aux) -> Decoding | None:
        """How stored tensor `info` serves as `name` with its aux tensor `aux` (or None), both checked before a
        byte is read; None: it is no quantized weight of this format and serves as stored."""
        raise NotImplementedError

    def check_aux(self, tensors: dict) -> None:
        """Refuse a checkpoint (`tensors`: name -> TensorInfo) with aux tensors its format cannot have."""

    def check_push(self, stored: str, spec, aux: str | None, aux_spec, want) -> Decoding | None:
        """A pushed tensor `stored` ((shape, dtype name) in `spec`) with its aux, checked against what it replaces
        (`want`: shape and dtype as the index lists them); None: it is not quantized and must match `want` as is."""
        raise NotImplementedError

    # dequant entry points: the daemon's and its tools' (they import the kernels), bit for bit the format's rule

    def dequant(self, out: torch.Tensor, data: torch.Tensor, aux: torch.Tensor, *, name: str, block,
                device: torch.device, threads: int | None = None) -> None:
        """One stored weight `data` (named `name`) with its aux into `out`, on `device`; `threads` caps the CPU
        threads the call uses (a loader thread passes 1)."""
        raise NotImplementedError

    def stream(self, pieces: Pieces, aux: torch.Tensor, *, name: str, shape: tuple[int, ...], block,
               dtype: torch.dtype, device: torch.device) -> None:
        """One stored weight of `shape` a piece at a time, read from and placed through `pieces`, each piece's
        result (`dtype`) made while its source is in cache."""
        raise NotImplementedError

    def reference(self, data: torch.Tensor, aux: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
        """The format's definition in plain torch (the offline tools'): what every entry point matches."""
        raise NotImplementedError
