"""An index's tensors as a mapping of views, the way `restore` binds them into a model."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from expertd.index import TensorIndex
from expertd.shm import view

log = logging.getLogger("expertd.client")


class IndexViews(Mapping):
    """An index's tensors as views: served tensors by the model's names, then checkpoint tensors by
    checkpoint name (derived only when a name is asked for that is not served, as a 4.x model's are).

    A view whose dtype differs from what `dtypes` wants for that name becomes a private copy.
    `only` restricts it to these served tensors (and the checkpoint views inside them).
    """

    def __init__(self, index: TensorIndex, segments: dict[str, torch.Tensor],
                 dtypes: dict[str, torch.dtype] | None = None, only: set[str] | None = None):
        self.index, self.segments, self.dtypes, self.only = index, segments, dtypes or {}, only
        self.served = {e.name: e for e in index.tensors if only is None or e.name in only}
        self._checkpoint = None

    def _entry(self, name: str):
        entry = self.served.get(name)
        if entry is None:
            if self._checkpoint is None:
                self._checkpoint = {n: e for n, e in self.index.checkpoint_entries().items()
                                    if self.only is None or (e.base or n) in self.only}
            entry = self._checkpoint.get(name)
        return entry

    def __contains__(self, name) -> bool:
        return self._entry(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        if entry is None:
            raise KeyError(name)
        tensor = view(self.segments, entry)
        want = self.dtypes.get(name)
        if want is not None and tensor.dtype != want:
            log.warning("%s is served as %s but the model needs %s: using a private copy", name, tensor.dtype, want)
            tensor = tensor.to(want)
        return tensor

    def __iter__(self):
        self._entry("")  # derive the checkpoint names
        return iter(dict.fromkeys([*self.served, *self._checkpoint]))

    def __len__(self) -> int:
        return sum(1 for _ in self)
