"""A gather index that is a strided view of its source block: copied as one, not gathered element by element.

An engine's packing is often a tile transpose (vLLM's CPU MoE "vec" layout: each 16-row tile of an expert stored
column by column): its index is `offset + sum(digit_i * stride_i)` over a mixed-radix counter, i.e. a strided view
(`torch.as_strided`) of the source block. Copying that view is a strided copy, several times faster than an index
gather of 2-byte elements. `Strides` finds the form streaming, chunk by chunk, as the daemon checks the index: it
infers the sizes and strides from the first WINDOW entries, then checks every entry against them; the derived bytes
are those of the plain gather either way (an index it cannot prove strided is gathered as before).

Client-safe: torch is imported by the methods that compute, not by this module.
"""

from __future__ import annotations

WINDOW = 1 << 19  # index entries held to infer the form (4 MiB of int64): several outer steps of a DeepSeek tile
MOST_DIMS = 8


class Strides:
    """Feed it every chunk of an index (in order); `form()` is then (sizes, strides, offset), outermost first, such
    that the index equals the flat strided view of `arange` with them, or None."""

    def __init__(self, length: int):
        self.length = length
        self.head: list = []
        self.held = 0
        self.inner: list[tuple[int, int]] | None = None  # (size, stride) innermost first; the outermost size last
        self.offset = 0
        self.ok = True

    def feed(self, at: int, index) -> None:
        if not self.ok:
            return
        if self.inner is None:
            self.head.append((at, index))
            self.held += index.numel()
            if self.held >= min(WINDOW, self.length):
                self._infer()
            return
        self.ok = self._matches(at, index)

    def form(self) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        if self.ok and self.inner is None and self.head:
            self._infer()
        if not self.ok or self.inner is None:
            return None
        dims = list(reversed(self.inner))
        return tuple(s for s, _ in dims), tuple(t for _, t in dims), self.offset

    def _infer(self) -> None:
        import torch

        window = torch.cat([index for _, index in self.head])
        self.ok, inner, rest = bool((window >= 0).all()), [], window
        while self.ok and rest.numel() > 1 and len(inner) < MOST_DIMS:
            step = int(rest[1] - rest[0])
            off = (torch.diff(rest) != step).nonzero()
            if not off.numel():  # one run to the window's end: the outermost dimension
                inner.append((0, step))
                break
            size = int(off[0]) + 1
            inner.append((size, step))
            rest = rest[: rest.numel() // size * size: size]
        else:
            self.ok = self.ok and rest.numel() == 1 and self.held == self.length  # a single outer row: the whole
            inner.append((0, 0))
        inside = 1
        for size, _ in inner[:-1]:
            inside *= size
        if not self.ok or inside <= 0 or self.length % inside or any(t < 0 for _, t in inner):
            self.ok = False
            return
        inner[-1] = (self.length // inside, inner[-1][1])
        self.inner, self.offset = inner, int(window[0])
        head, self.head = self.head, []
        self.ok = all(self._matches(at, index) for at, index in head)

    def _matches(self, at: int, index) -> bool:
        """Whether entries `at`.. of the index are those of the form."""
        import torch

        rest = torch.arange(at, at + index.numel(), dtype=torch.int64)
        expected = torch.full_like(rest, self.offset)
        for size, stride in self.inner[:-1]:
            expected += (rest % size) * stride
            rest //= size
        expected += rest * self.inner[-1][1]
        return torch.equal(expected, index)


def copy_strided(out, source, blocks: int, form: tuple, should_stop=None) -> None:
    """`out` (blocks x m elements) = the strided view `form` of each of `source`'s blocks (contiguous), a few blocks
    at a time (`should_stop()` asked between)."""
    sizes, strides, offset = form
    src = source.reshape(blocks, -1)
    dst = out.view(blocks, *sizes)
    step = max(1, (64 << 20) // max(1, src[0].numel() * src.element_size()))
    for b0 in range(0, blocks, step):
        if should_stop is not None and should_stop():
            raise InterruptedError("the daemon is stopping")
        part = src[b0:b0 + step]
        view = part.as_strided((part.shape[0], *sizes), (src.stride(0), *strides), part.storage_offset() + offset)
        dst[b0:b0 + step].copy_(view)
