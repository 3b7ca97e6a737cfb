"""Binding a client's views into torch models: the segments it maps, the dtypes each model was loaded with, the
dtype casts and derived tensors the daemon makes for it.

`ExpertClient` composes one `ModelBinder` and hands it what binding needs (its connection, and its current lease and
index as functions, read through the client's lock-guarded lease state); the binder knows nothing of leases changing.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from expertd import messages
from expertd.connection import Connection
from expertd.index import TensorIndex
from expertd.shm import map_segments, view

from .hooks import run_model_hooks
from .parallel import bind_sharded, check_partition
from .quiet import attaching
from .restore import restore
from .derived_tensors import derive, fetch, log_casts, map_derived
from .views import IndexViews

log = logging.getLogger("expertd.client")


class ModelBinder:
    """This client's read-only mappings of the daemon's segments, and the models bound to views of them."""

    def __init__(self, conn: Connection, endpoint: str, lease: Callable[[], str], index: Callable[[], TensorIndex],
                 copy_on_write: bool):
        self._conn, self._endpoint, self._lease, self._index = conn, endpoint, lease, index
        self.copy_on_write = copy_on_write
        self.segments: dict[str, torch.Tensor] | None = None
        self.model_dtypes: dict[int, torch.dtype] = {}  # id(model) -> dtype it was loaded with

    def attach(self) -> dict[str, torch.Tensor]:
        """The segments of the current index, mapped once."""
        if self.segments is None:
            index = self._index()
            self.segments = map_segments(index.segments, writable=self.copy_on_write, shm_dir=index.shm_dir)
        return self.segments

    def forget(self) -> None:
        """Drop this client's own mappings (views and models handed out keep theirs)."""
        self.segments = None

    def remap(self, index: TensorIndex) -> None:
        """Map the segments a new index adds; forget those it no longer uses (views keep theirs alive)."""
        if self.segments is None:
            return
        keep = {s.name: self.segments[s.name] for s in index.segments if s.name in self.segments}
        keep.update(map_segments([s for s in index.segments if s.name not in keep], writable=self.copy_on_write,
                                 shm_dir=index.shm_dir))
        self.segments = keep

    def load_model(self, dtype: torch.dtype, distributed_config=None):
        """The model for the served config, every weight bound (`ExpertClient.load_model`)."""
        from expertd.hf import empty_model

        index = self._index()
        with attaching(one_thread=True):
            model = empty_model(index.config, dtype)
            ep_rank, ep_size = None, 1
            if distributed_config is not None:
                from expertd.hf_distributed import distribute

                model, ep_rank, ep_size = distribute(model, distributed_config)
            check_partition(index, self._endpoint, ep_rank, ep_size)
            self.bind(model, index, dtype, strict=True)
            model.eval()
        self.model_dtypes[id(model)] = dtype
        # client/hooks.py: on_model_loaded, EXPERTD_MODEL_HOOKS, EXPERTD_CAPTURE_DIR / _SIMULATE_*
        run_model_hooks(model)
        return model

    def restore(self, model, dtype: torch.dtype | None, strict: bool):
        """Bind the current index's views into a model the caller built (`ExpertClient.restore`)."""
        dtype = dtype or getattr(model, "dtype", torch.bfloat16)
        self.model_dtypes[id(model)] = dtype
        with attaching():
            return self.bind(model, self._index(), dtype, strict)

    def rebind(self, model, index: TensorIndex, changed: list[str]) -> list[str]:
        """Bind in `model` only the served tensors `changed`, with the dtype it was loaded with; the names bound."""
        dtype = self.model_dtypes.get(id(model), getattr(model, "dtype", torch.bfloat16))
        return self.bind(model, index, dtype, strict=False, only=set(changed)).names

    def bind(self, model, index: TensorIndex, dtype: torch.dtype, strict: bool, only: set[str] | None = None):
        """Bind an index's views with the dtypes `from_pretrained(dtype=dtype)` gives (a private copy where the
        served dtype differs): transformers 5.x models by served names, 4.x models by checkpoint names."""
        from expertd.hf_dtypes import loaded_dtypes

        want = loaded_dtypes(model, dtype)
        views = IndexViews(index, self.attach(), want, only)
        need = views.mismatched(want)
        if need:
            self._map_casts(index, need, views)
        from expertd.hf_distributed import is_dtensor, reset_fsdp_shards, reshard

        if getattr(model.config, "distributed_config", None) is not None:
            reshard(model)  # a refresh after forward passes: FSDP2's root holds gathered parameters until then
        sharded = {name for name, p in model.named_parameters() if is_dtensor(p)}
        if not sharded:
            result = restore(model, views, strict=strict, dtypes=want, unexpected=False)
        else:
            # transformers' parallelism made DTensors of the sharded parameters: each gets its rank's shard of the
            # served tensor; the rest (buffers, unsharded parameters) binds as in any model
            shards = bind_sharded(model, views, {e.name: e for e in index.tensors}, only)
            result = restore(model, views, strict=strict, dtypes=want, unexpected=False, skip=sharded)
            result.names += shards
            result.bound += len(shards)
            reset_fsdp_shards(model)
        log_casts(model, dtype, index, views, need)
        return result

    def _map_casts(self, index: TensorIndex, need: dict[str, tuple[str, str]], views: IndexViews) -> None:
        """Map the dtype casts `need` names, made by the daemon once per host (`derived_tensors.fetch`)."""
        entries = fetch(self._conn, self._lease(), index, need)
        self._map_entries(entries, index)
        views.derived.update({(e.name, e.dtype): e for e in entries})

    def derived(self, items: list[messages.GatherItem], trusted: int = 0) -> list[torch.Tensor]:
        """Read-only views of derived tensors of the current index's generation (`ExpertClient.derived`)."""
        index = self._index()
        entries = derive(self._conn, self._lease(), index, items)
        self._map_entries(entries, index, len(entries) - trusted)
        return [view(self.segments, e) for e in entries]

    def _map_entries(self, entries, index: TensorIndex, checked: int | None = None) -> None:
        self.attach()  # the segments of derived tensor entries not mapped yet
        map_derived(self.segments, entries, index.shm_dir, self.copy_on_write, checked)
