"""Tensors made whole at load: computed parameters and parameters cast to the dtype the model loads them as.

A parameter whose conversion is more than a rename or an expert stack (transpose, chunk, interleave,
...) is no view of its checkpoint tensors. The loader reads all of its sources, FP8 dequantized as for
any other tensor, and this module applies transformers' own operations to them. A parameter the model
loads in another dtype than its sources decode to (a router transformers keeps in float32) is made the
same way: decoded, then cast once, as `from_pretrained` casts it.
"""

from __future__ import annotations

import torch

from expertd.errors import ShapeError
from expertd.hf import convert
from expertd.index import tensor_checksum

from .checkpoint import Checkpoint
from .dequant import write_part
from .layout import PlannedTensor
from .parts import part_digest


def source_tensor(data: torch.Tensor, scale: torch.Tensor | None, src, dtype: torch.dtype, **options) -> torch.Tensor:
    """One source as transformers' ops would see it: dequantized by its format (into a temporary of the served
    dtype) or as stored."""
    if scale is None:
        return data.view(src.info.shape)
    out = torch.empty(src.shape, dtype=dtype)
    write_part(out, data, scale, codec=src.codec, name=src.info.name, block=src.block, **options)
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
    result = convert(how, collected, config, planned.decoded or planned.dtype)
    first = planned.sources[0].info
    if tuple(result.shape) != planned.shape:
        raise ShapeError(
            f"transformers' conversion {[type(op).__name__ for op in how.converter.operations]} of {how.sources} gives "
            f"shape {list(result.shape)}, but parameter {planned.name!r} has shape {list(planned.shape)}",
            file=first.file, tensor=planned.name,
        )
    if result.dtype != (planned.decoded or planned.dtype):
        raise ShapeError(f"transformers' conversion gives {result.dtype} for parameter {planned.name!r}, planned "
                         f"{planned.decoded or planned.dtype}",
                         file=first.file, tensor=planned.name)
    return result


def build_whole(ckpt: Checkpoint, planned, out: torch.Tensor, config, dev: torch.device):
    """A tensor made from all its sources at once: read whole, dequantized, then converted by transformers' own
    ops (a computed tensor) or put back to back, and cast to the dtype the model loads it as; written;
    [(source digests, checksum)]."""
    digests, tensors, ids = [], [], {}
    for src in planned.sources:
        data = ckpt.view(src.info)
        scale = ckpt.view(src.scale) if src.scale is not None else None
        ids[ckpt.identity(src.info)] = digest = tensor_checksum(data)
        scale_digest = None
        if scale is not None:
            ids[ckpt.identity(src.scale)] = scale_digest = tensor_checksum(scale)
        digests.append(part_digest(digest, scale_digest))
        tensors.append(source_tensor(data, scale, src, planned.decoded or planned.dtype, device=dev))
    if planned.computed is not None:
        out.copy_(compute(planned, tensors, config))  # copy_ casts when the model loads it as another dtype
    else:
        out.copy_(torch.cat([t.reshape(-1) for t in tensors]).view(out.shape))
    return [(digests, ids, tensor_checksum(out))]
