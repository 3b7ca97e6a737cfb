"""Probes that carry their own position: how an engine's value-independent rearrangement of a weight is read back.

An engine's kernels pad, pack, transpose or fuse weights in ways that do not depend on the values. Fed probes whose
elements hold their own position in base-255 digits (digit + 1, exact in bf16; 0 is left for padding), one run per
digit, the engine's own code shows where each element went: a gather index (`expertd.derived`), which the daemon
applies to its served bytes once per host.
"""

from __future__ import annotations

import torch

BASE = 255  # digit d of a position is stored as d + 1 in 1..255 (0 marks padding); exact in bf16


def digit_count(n: int) -> int:
    """How many base-255 digits the positions 0 .. n-1 take (at least one)."""
    count = 1
    while BASE ** count < n:
        count += 1
    return count


def digits(positions: torch.Tensor, digit: int, dtype: torch.dtype) -> torch.Tensor:
    """Digit `digit` of each position, + 1: 1..255, exact in bf16 (0 is left for padding)."""
    if positions.dtype != torch.int32 and positions.numel() and int(positions.max()) < 2**31:  # int32: ~10x int64
        positions = positions.to(torch.int32)
    if digit:
        positions = torch.div(positions, BASE ** digit, rounding_mode="floor")
    return positions.remainder(BASE).add_(1).to(dtype)


class Positions:
    """A gather index read back from probes, one digit at a time: each element of a probe's result holds the digit
    of the source position it came from, + 1, or 0 where none came (padding: -1 in the index)."""

    def __init__(self, padding: bool = True):
        self.padding = padding
        self.index: torch.Tensor | None = None
        self.pad: torch.Tensor | None = None

    def add(self, out: torch.Tensor, digit: int) -> str | None:
        """Take the result of the probe of `digit`; why it is not a rearrangement of the probe, or None."""
        out = out.detach().flatten()
        ints = out.to(torch.int32)  # a value that is no whole number (or NaN, inf) does not convert back to itself
        lowest = 0 if self.padding else 1
        if out.numel() == 0 or not torch.equal(ints.to(out.dtype), out):
            return "changed the probe's values, not only their places"
        low, high = torch.aminmax(ints)
        if int(low) < lowest or int(high) > BASE:
            return "changed the probe's values, not only their places"
        pad = ints == 0
        if self.pad is not None and not torch.equal(self.pad, pad):
            return "padded differently from one probe to the next"
        self.pad = pad
        wide = self.index is not None and self.index.dtype == torch.int64 or BASE ** (digit + 1) >= 2**31
        part = (ints - 1).clamp_(min=0).to(torch.int64 if wide else torch.int32).mul_(BASE ** digit)
        self.index = part if self.index is None else self.index.to(part.dtype).add_(part)
        return None

    def result(self) -> torch.Tensor:
        """The index: source positions, -1 for padding."""
        self.index = self.index.to(torch.int64)
        self.index[self.pad] = -1
        return self.index
