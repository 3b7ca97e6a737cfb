"""Computed parameters: what transformers' conversion makes of their sources, worked out once at load.

A parameter whose conversion is more than a rename or an expert stack (transpose, chunk, interleave,
...) is no view of its checkpoint tensors. The loader reads all of its sources, FP8 dequantized as for
any other tensor, and this module applies transformers' own operations to them.
"""

from __future__ import annotations

import torch

from expertd.errors import ShapeError
from expertd.hf import convert

from .layout import PlannedTensor


def source_tensor(data: torch.Tensor, scale: torch.Tensor | None, src, dtype: torch.dtype, write_part,
                  **options) -> torch.Tensor:
    """One source as transformers' ops would see it: dequantized by its format (into a temporary of the served
    dtype) or as stored."""
    if scale is None:
        return data.view(src.info.shape)
    out = torch.empty(src.shape, dtype=dtype)
    write_part(out, data, scale, name=src.info.name, block=src.block, kind=src.kind, **options)
    return out


def compute(planned: PlannedTensor, tensors: list[torch.Tensor], config) -> torch.Tensor:
    """The served tensor of a computed parameter from its sources (in `planned.sources` order), checked
    against the parameter's shape and dtype."""
    how = planned.computed
    collected, k = {}, 0
    for pattern, keys in how.groups.items():
        if keys:
            collected[pattern] = tensors[k: k + len(keys)]
            k += len(keys)
    result = convert(how, collected, config)
    first = planned.sources[0].info
    if tuple(result.shape) != planned.shape:
        raise ShapeError(
            f"transformers' conversion {[type(op).__name__ for op in how.converter.operations]} of {how.sources} gives "
            f"shape {list(result.shape)}, but parameter {planned.name!r} has shape {list(planned.shape)}",
            file=first.file, tensor=planned.name,
        )
    if result.dtype != planned.dtype:
        raise ShapeError(f"transformers' conversion gives {result.dtype} for parameter {planned.name!r}, planned {planned.dtype}",
                         file=first.file, tensor=planned.name)
    return result
