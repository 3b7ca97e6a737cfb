"""transformers' own distributed loading, applied to a model whose weights come from shared memory.

`from_pretrained(..., distributed_config=...)` builds the model, then (before loading any weight)
sets up the device mesh and applies pipeline / tensor / expert parallelism and FSDP2 through
`prepare_distribute_model` and `maybe_distribute_model`, which leave every sharded parameter a
meta DTensor placeholder with its mesh and placements; loading then wraps each rank's local shard
with `DTensor.from_local` like that placeholder. `distribute` runs those same two steps on an empty
model, and `local_shard` says which part of a full tensor a placeholder's rank holds, so the worker
binds views of the served tensors as the local shards: same modules, hooks and placements.
"""

from __future__ import annotations

import sys

import torch


def distribute(model, distributed_config):
    """Apply `distributed_config` to an empty model as `from_pretrained` does before it loads weights;
    returns (model, EP rank of this process, EP size)."""
    from transformers.distributed import DistributedConfig

    cls = type(model)
    if isinstance(distributed_config, dict):
        distributed_config = DistributedConfig.from_dict(distributed_config)
    config, _device_map, mesh_manager = cls.prepare_distribute_model(distributed_config)
    model.config.distributed_config = config
    model = cls.maybe_distribute_model(model, config, mesh_manager)
    ep_rank = mesh_manager.get_mesh("ep").get_local_rank() if config.ep_size > 1 else 0
    return model, ep_rank, config.ep_size


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor, without importing torch.distributed where nothing made one (attach stays cheap)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_shard(placeholder) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the shard of `placeholder` (a DTensor) that this rank holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(placeholder.shape, placeholder.device_mesh,
                                                          placeholder.placements)
    return tuple(shape), tuple(offset)


def from_local_like(local: torch.Tensor, placeholder) -> torch.nn.Parameter:
    """`local` as this rank's shard of a parameter sharded like `placeholder` (no copy of `local`)."""
    from torch.distributed.tensor import DTensor

    dtensor = DTensor.from_local(local, placeholder.device_mesh, placeholder.placements, run_check=False,
                                 shape=placeholder.shape, stride=tuple(placeholder.stride()))
    return torch.nn.Parameter(dtensor, requires_grad=False)


def reshard(model) -> None:
    """Register FSDP2's sharded parameters again (after a forward its root keeps gathered, unsharded ones)."""
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state"):
            module.reshard()


def reset_fsdp_shards(model) -> None:
    """Have FSDP2 take the bound local shards as its sharded storage now (it would at its lazy init): a shard
    whose size needs no padding is used as it is, a padded one is copied by FSDP itself."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in get_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.reset_sharded_param()
