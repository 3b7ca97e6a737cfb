"""Fused expert parameters and their per-expert checkpoint parts: one rule for planner, generator and restore.

transformers 5.x stacks a MoE layer's experts into one parameter (`mlp.experts.gate_up_proj`
[E, 2I, H]: each expert's gate rows, then its up rows) while checkpoints store one tensor per
expert and projection. A `Fusion` maps one onto the other in both directions.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ShapeError


@dataclass(frozen=True)
class Fusion:
    """`target` is the fused parameter's name suffix; `sources` the checkpoint-name suffixes of
    its parts with `*` for the expert index, concatenated per expert in order."""

    target: str
    sources: tuple[str, ...]

    def _prefix(self, param: str) -> str | None:
        if not param.endswith(self.target):
            return None
        prefix = param[: len(param) - len(self.target)]
        if prefix and not (prefix.endswith(".") or self.target.startswith(".")):
            return None
        return prefix

    def parts(self, param: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
        """(checkpoint name, shape) of each part of fused `param` in storage order; None if `param` is not this
        fusion's.

        Part k lies at bytes [k * size, (k + 1) * size) of the fused tensor.
        """
        prefix = self._prefix(param)
        if prefix is None or len(shape) < 2:
            return None
        per_expert = len(self.sources)
        if shape[1] % per_expert:
            raise ShapeError(f"{param} {list(shape)} cannot be split into {per_expert} parts per expert")
        part_shape = (shape[1] // per_expert, *shape[2:])
        return [(prefix + src.replace("*", str(e)), part_shape) for e in range(shape[0]) for src in self.sources]

    def owner(self, source: str) -> tuple[str, int] | None:
        """(fused parameter name, position of the part in storage order) of a checkpoint name, or None."""
        for k, pattern in enumerate(self.sources):
            head, _, tail = pattern.partition("*")
            i = source.rfind(head)
            if i < 0 or not source.endswith(tail) or (i and source[i - 1] != "." and not head.startswith(".")):
                continue
            middle = source[i + len(head): len(source) - len(tail)]
            if middle.isdigit():
                return source[:i] + self.target, int(middle) * len(self.sources) + k
        return None


def parts_of(fusions, param: str, shape: tuple[int, ...]) -> tuple[Fusion, list[tuple[str, tuple[int, ...]]]] | None:
    """The first fusion that `param` belongs to, with its parts; None for a parameter served as stored."""
    for fusion in fusions:
        parts = fusion.parts(param, shape)
        if parts is not None:
            return fusion, parts
    return None


def owner_of(fusions, source: str) -> tuple[str, int] | None:
    """The fused parameter a checkpoint tensor is part of, and its position there; None if none."""
    for fusion in fusions:
        owner = fusion.owner(source)
        if owner is not None:
            return owner
    return None
