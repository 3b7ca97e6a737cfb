"""Bind shared-memory views into a model's parameters and buffers, without copying a byte.

Works for models whose names match the checkpoint (transformers 4.x per-expert layout, plain
modules) and for transformers 5.x fused experts: a fused `[E, 2I, H]` parameter is rebuilt as
one view over its per-expert views when those lie back to back in one storage, which is how the
daemon lays them out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from expertd.errors import RestoreError
from expertd.fusion import owner_of, parts_of
from expertd.hf import fusions_for, tied_aliases


@dataclass
class RestoreResult:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bound: int = 0
    names: list[str] = field(default_factory=list)  # what was bound, in module order


def _fused_view(parts: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """One tensor over `parts` when they lie back to back in one storage, else None."""
    first = parts[0]
    storage = first.untyped_storage()
    step = first.numel()

    for k, part in enumerate(parts):
        if (
            part.dtype != first.dtype or not part.is_contiguous() or part.numel() != step
            or part.untyped_storage().data_ptr() != storage.data_ptr()
            or part.storage_offset() != first.storage_offset() + k * step
        ):
            return None
    fused = torch.empty(0, dtype=first.dtype, device=first.device)
    fused.set_(storage, first.storage_offset(), shape)
    return fused


def _resolve(name: str, target: torch.Tensor, views, fusions) -> torch.Tensor | None:
    if name in views:
        return views[name]
    fused = parts_of(fusions(), name, tuple(target.shape))
    if fused is None or not all(n in views for n, _ in fused[1]):
        return None
    for n, part_shape in fused[1]:
        if tuple(views[n].shape) != part_shape:
            raise RestoreError(
                f"view {n!r} of shape {list(views[n].shape)} cannot be part of {name!r} "
                f"(which has shape {list(target.shape)}: parts of {list(part_shape)})"
            )
    view = _fused_view([views[n] for n, _ in fused[1]], target.shape)
    if view is None:
        raise RestoreError(
            f"per-expert views for {name!r} are not laid out back to back in one buffer; binding them would need a copy"
        )
    return view


def restore(model: nn.Module, views, strict: bool = True, dtypes: dict[str, torch.dtype] | None = None,
            unexpected: bool = True, skip=()) -> RestoreResult:
    """Bind `views` (a mapping of name -> tensor) into `model` in place, no copies; returns missing and
    unexpected names.

    Views named like the model's parameters bind directly (served names into a transformers 5.x model,
    checkpoint names into a 4.x one); a fused expert parameter with no view of its own is rebuilt from its
    per-expert checkpoint views, which needs transformers' expert fusions for the model (read only then).
    Raises RestoreError naming the parameter on a shape or dtype mismatch. `dtypes` gives the dtype each
    name must have (default: the model's current dtypes); with `strict`, any persistent parameter or
    buffer left without a view is an error. `unexpected=False` skips listing the views nothing used. Names in
    `skip` (parameters bound otherwise, such as DTensor shards) are left as they are.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fusions = functools.cache(lambda: fusions_for(model_type))
    result = RestoreResult()
    used: set[str] = set()
    dtypes = dtypes or {}
    # one pass over the modules: no state_dict() and no get_submodule() per name (attach cost)
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        members = [(attr, t, True) for attr, t in module._parameters.items() if t is not None]
        members += [(attr, t, False) for attr, t in module._buffers.items()
                    if t is not None and attr not in module._non_persistent_buffers_set]
        for attr, current, is_param in members:
            name = prefix + attr
            if name in skip:
                continue
            source = _resolve(name, current, views, fusions)
            if source is None:
                result.missing.append(name)
                continue
            if tuple(source.shape) != tuple(current.shape):
                raise RestoreError(
                    f"view of shape {list(source.shape)} cannot be bound to {name!r} "
                    f"(which has shape {list(current.shape)})"
                )
            want_dtype = dtypes.get(name, current.dtype)
            if source.dtype != want_dtype:
                raise RestoreError(f"view of dtype {source.dtype} cannot be bound to {name!r} "
                                   f"(which must be {want_dtype})")
            if is_param:
                module._parameters[attr] = nn.Parameter(source, requires_grad=False)
            else:
                module._buffers[attr] = source
            used.add(name)
            result.names.append(name)
            result.bound += 1
    for alias, target in tied_aliases(model).items():  # tied embeddings: bind the alias to its target's view
        if alias in result.missing and target in used:
            owner, _, attr = alias.rpartition(".")
            head, _, tattr = target.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = model.get_submodule(head)._parameters[tattr]
            result.missing.remove(alias)
            result.names.append(alias)
            used.add(alias)
    if unexpected:
        result.unexpected = sorted(
            n for n in views if n not in used and (owner_of(fusions(), n) or (None,))[0] not in used
        )
    if strict and result.missing:
        raise RestoreError(f"{len(result.missing)} parameter(s) have no view: {', '.join(result.missing[:8])}")
    return result

