"""An index's tensors as a mapping of views, the way `restore` binds them into a model."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from expertd.extents import extents_of, position
from expertd.index import TensorEntry, TensorIndex
from expertd.shm import to_dtype, view


class IndexViews(Mapping):
    """An index's tensors as views: served tensors by the model's names, then checkpoint tensors by
    checkpoint name (derived only when a name is asked for that is not served, as a 4.x model's are).

    Where `dtypes` wants another dtype for a name than the one served, the view is taken from the dtype
    derived tensor the daemon made of its served tensor (`derived`: (served name, dtype) -> its entry), or,
    where there is none, is a private copy (named in `copies`). `only` restricts it to these served tensors (and the
    checkpoint views inside them).
    """

    def __init__(self, index: TensorIndex, segments: dict[str, torch.Tensor],
                 dtypes: dict[str, torch.dtype] | None = None, only: set[str] | None = None):
        self.index, self.segments, self.dtypes, self.only = index, segments, dtypes or {}, only
        self.served = {e.name: e for e in index.tensors if only is None or e.name in only}
        self.derived: dict[tuple[str, str], TensorEntry] = {}
        self.copies: list[str] = []  # names bound to a private copy (no derived tensor of their served tensor)
        self.cast: list[str] = []  # names bound to a derived tensor
        self._checkpoint = None

    def _entry(self, name: str):
        entry = self.served.get(name)
        if entry is None:
            if self._checkpoint is None:
                self._checkpoint = {n: e for n, e in self.index.checkpoint_entries().items()
                                    if self.only is None or (e.base or n) in self.only}
            entry = self._checkpoint.get(name)
        return entry

    def mismatched(self, names) -> dict[str, tuple[str, str]]:
        """Of `names`, those whose wanted dtype differs from the served one: name -> (served tensor, wanted dtype)."""
        out = {}
        for name in names:
            want = self.dtypes.get(name)
            entry = self._entry(name) if want is not None else None
            if entry is not None and entry.dtype != str(want):
                out[name] = (entry.base or entry.name, str(want))
        return out

    def __contains__(self, name) -> bool:
        return self._entry(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        if entry is None:
            raise KeyError(name)
        want = self.dtypes.get(name)
        if want is None or entry.dtype == str(want):
            return view(self.segments, entry)
        cast = self.derived.get((entry.base or entry.name, str(want)))
        if cast is None:
            self.copies.append(name)
            return view(self.segments, entry).to(want)
        self.cast.append(name)
        return view(self.segments, self._within(entry, cast, want))

    def _within(self, entry: TensorEntry, cast: TensorEntry, want: torch.dtype) -> TensorEntry:
        """Where `entry` (a served tensor, or a checkpoint view inside one) lies in the tensor derived from it."""
        if entry.base is None:
            return cast
        base = self.served[entry.base]  # a checkpoint view is kept only where its base is served (`_entry`)
        first = position(extents_of(base), entry.segment, entry.offset) // to_dtype(entry.dtype).itemsize
        count = entry.nbytes // to_dtype(entry.dtype).itemsize
        return TensorEntry(entry.name, cast.segment, cast.offset + first * want.itemsize, count * want.itemsize,
                           list(entry.shape), str(want))

    def __iter__(self):
        self._entry("")  # derive the checkpoint names
        return iter(dict.fromkeys([*self.served, *self._checkpoint]))

    def __len__(self) -> int:
        return sum(1 for _ in self)
