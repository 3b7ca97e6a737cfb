"""A push that changes some experts of a stack writes those experts only: the new generation's entry is the old
one's ranges with the changed experts' replaced (`expertd.extents`).

A served expert stack is one tensor of n equal parts (one per checkpoint source: an expert, or an expert's
projection). Where a part is a whole number of the shm folder's pages and the old stack's ranges start on pages, the
changed parts' bytes go into a new segment of their size and every unchanged part stays where it is, in whatever
older generation's segment holds it: a new generation costs the changed experts' bytes, not the stack's. Which parts
changed is decided by their bytes (a pushed part equal to what is served changes nothing). A stack whose ranges
would pass MAX_EXTENTS is written whole into one segment instead (compaction: a reader maps each range, and a long
run of generations must not approach the kernel's limit on a process's mappings, `vm.max_map_count`).
"""

from __future__ import annotations

import logging

import torch

from expertd.extents import Extent, mappable, places, replaced
from expertd.index import TensorEntry, checksum, combined_checksum, tensor_bytes
from expertd.shm import DTYPES, same_bytes

from .dequant import write_part

log = logging.getLogger("expertd.updates")

MAX_EXTENTS = 64  # a stack of more ranges than this is written whole again (one range)


def part_bytes(push, staged: dict, entry: TensorEntry, parts: int, device) -> list[torch.Tensor]:
    """The new bytes (uint8) of each part `push` writes: views of the staged tensor where it is the served bytes
    as they are (plain, the served dtype), else decoded into private memory as the whole path writes them."""
    data, scale = staged[push.name], (staged[push.scale.name] if push.scale else None)
    shape = push.served_shape
    if push.kind == "plain" and scale is None and data.dtype == DTYPES[entry.dtype]:
        flat = data.reshape(-1).view(torch.uint8)
    else:
        out = torch.empty(shape, dtype=DTYPES[entry.dtype])
        write_part(out, data, scale, name=push.name, block=push.block, kind=push.kind, device=device)
        flat = out.reshape(-1).view(torch.uint8)
    count = parts if push.part is None else 1
    step = flat.numel() // count
    return [flat[k * step: (k + 1) * step] for k in range(count)]


def changed_stack(entry: TensorEntry, pushes: list, staged: dict, old, arena, device, sums: list[str] | None = None
                  ) -> tuple[TensorEntry, list[str]] | None:
    """The new entry of stack `entry` after `pushes` (the update's pushes into it), only the parts whose bytes change
    written, into a new segment of `arena` (the old entry itself where none changes), and its parts' checksums;
    None where the parts are not whole pages, all of them change, or the ranges would pass MAX_EXTENTS: the caller
    writes the stack whole. `sums` are the old parts' checksums where known (`Built.sums`): only changed parts are
    hashed then."""
    n = len(entry.sources)
    chunk = entry.nbytes // max(n, 1)
    if not whole_pages(entry, arena):
        return None
    new: dict[int, torch.Tensor] = {}
    for push in pushes:
        for k, data in zip(range(n) if push.part is None else (push.part,), part_bytes(push, staged, entry, n, device)):
            new[k] = data
    changed = [k for k in sorted(new) if not same_bytes(new[k], old.part(entry, k, n))]
    if not changed:
        return entry, part_sums(entry, old, sums)
    if len(changed) == n or len(layout(entry, changed, "")) > MAX_EXTENTS:
        return None
    where = arena.add(len(changed) * chunk)
    out = arena.tensor(where, (len(changed) * chunk,), torch.uint8)
    for slot, k in enumerate(changed):
        out[slot * chunk: (slot + 1) * chunk].copy_(new[k])
    del out
    extents = layout(entry, changed, where.segment, where.offset)
    sums = part_sums(entry, old, sums)
    for k in changed:
        sums[k] = checksum(tensor_bytes(new[k]))
    return TensorEntry(entry.name, extents[0].segment, extents[0].offset, entry.nbytes, list(entry.shape),
                       entry.dtype, list(entry.sources), checksum=combined_checksum(sums), experts=entry.experts,
                       extents=extents), sums


def part_checksums(t: torch.Tensor, parts: int) -> list[str]:
    """The checksum of each of `parts` equal parts of tensor `t`'s bytes: `tensor_checksum(t, parts)` combines them."""
    flat = t.reshape(-1).view(torch.uint8)
    step = flat.numel() // max(parts, 1)
    return [checksum(tensor_bytes(flat[k * step: (k + 1) * step])) for k in range(max(parts, 1))]


def part_sums(entry: TensorEntry, old, sums: list[str] | None) -> list[str]:
    """The checksum of each of the stack's parts: `sums` where they make its checksum, else hashed from its bytes."""
    n = len(entry.sources)
    if sums is not None and len(sums) == n and combined_checksum(sums) == entry.checksum:
        return list(sums)
    return [checksum(tensor_bytes(old.part(entry, k, n))) for k in range(n)]


def whole_pages(entry: TensorEntry, arena) -> bool:
    """Whether the stack's parts can be ranges of their own: two or more, each whole pages of the arena's folder, the
    old ranges starting on pages (else one log line: the stack is written whole)."""
    n, unit = len(entry.sources), arena.shm.unit
    if n < 2:
        return False
    chunk = entry.nbytes // n
    if chunk % unit or not mappable(places(entry), unit):
        log.info("%s: its %d parts of %d bytes are not whole pages of %s (%d bytes): written whole", entry.name, n,
                 chunk, arena.shm_dir, unit)
        return False
    return True


def layout(entry: TensorEntry, changed: list[int], segment: str, offset: int = 0) -> list[Extent]:
    """The new stack's ranges: the changed parts back to back in `segment` from `offset`, the others where they are."""
    return replaced(places(entry), len(entry.sources), changed, segment, offset)
