"""Bind served tensors into a model that transformers' own expert parallelism (and FSDP2) has sharded.

`ExpertClient.load_model(distributed_config=...)` builds the model `from_pretrained(...,
distributed_config=...)` would build (same modules, EP hooks and DTensor placements, through
`expertd.hf_distributed`) and gives each sharded parameter a view of the host's shared memory as its
local shard: an expert block's rows are found through the entry's `ExpertBlock` (a partitioned daemon
serves only its ranks' experts), a dense parameter's shard is its rows of the whole served tensor.
Nothing is copied where the shard is a contiguous part of the served tensor (FSDP2 copies a shard it
must pad, as it would any loaded one).
"""

from __future__ import annotations

import logging

import torch

from expertd.errors import RestoreError
from expertd.partition import PartitionError

log = logging.getLogger("expertd.client")


def check_partition(index, endpoint: str, ep_rank: int | None, ep_size: int) -> None:
    """A worker of EP rank `ep_rank` of `ep_size` (None: no expert parallelism) may use this daemon's index."""
    ep = index.expert_parallel
    if ep is None or ep.whole:  # every expert served: any EP layout finds its rows
        return
    served = f"the daemon at {endpoint} serves EP ranks {list(ep.ranks)} of EP size {ep.size}"
    if ep_rank is None:
        raise PartitionError(
            f"the model is partitioned: {served}, so no process gets every expert from it; attach with "
            f"load_model(distributed_config=DistributedConfig(ep_size={ep.size}, ...)) inside torch.distributed "
            f"(torchrun), one worker per EP rank on the host that serves it")
    if ep_size != ep.size:
        raise PartitionError(f"this worker runs ep_size {ep_size} (EP rank {ep_rank}) but {served}; "
                             f"use DistributedConfig(ep_size={ep.size}, ...)")
    if ep_rank not in ep.ranks:
        raise PartitionError(f"this worker is EP rank {ep_rank} of {ep_size}, which this host does not serve: "
                             f"{served}; attach it to the daemon of the host that serves rank {ep_rank}")


def shard_of(entry_name: str, full: torch.Tensor, block, placeholder) -> torch.Tensor:
    """This rank's local shard of a parameter sharded like `placeholder`, as a view of the served tensor `full`
    (which holds the experts `block` says, or the whole parameter when `block` is None)."""
    from expertd.hf_distributed import local_shard

    shape, offset = local_shard(placeholder)
    rows = offset[0] if block is None else block.rows_of(offset[0], shape[0])
    if rows is None:
        raise PartitionError(f"{entry_name}: this rank holds experts [{offset[0]}, {offset[0] + shape[0]}) of "
                             f"{block.total}, which are not among the served ranges {block.to_dict()['ranges']}")
    index = (slice(rows, rows + shape[0]), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))
    local = full[index]
    if tuple(local.shape) != shape:
        raise RestoreError(f"served {entry_name} {list(full.shape)} has no local shard of shape {list(shape)} "
                           f"at {list(offset)}")
    if not local.is_contiguous():  # a tensor-parallel split of an inner dim: no view can be its own storage
        log.warning("%s: the local shard %s is not contiguous in shared memory; using a private copy", entry_name,
                    list(shape))
        local = local.contiguous()
    return local


def bind_sharded(model, views, entries: dict, only: set[str] | None = None) -> list[str]:
    """Bind every DTensor parameter of `model` to its local shard of the served tensor of the same name;
    returns the names bound. `views` maps served names to views with the model's dtypes; `entries` to their
    index entries (for the expert geometry)."""
    from expertd.hf_distributed import from_local_like, is_dtensor

    bound = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for attr, param in list(module._parameters.items()):
            name = prefix + attr
            if param is None or not is_dtensor(param) or (only is not None and name not in only):
                continue
            if name not in entries:
                raise RestoreError(f"sharded parameter {name!r} has no served tensor")
            local = shard_of(name, views[name], entries[name].experts, param)  # in the dtype from_pretrained gives
            module._parameters[attr] = from_local_like(local, param)
            bound.append(name)
    return bound
