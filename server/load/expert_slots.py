"""A push that changes some experts of a stack writes those experts only: the new generation's entry is the old
one's ranges with the changed experts' replaced (`expertd.extents`).

A served expert stack is one tensor of n equal parts (one per checkpoint source: an expert, or an expert's
projection; a stack the checkpoint stores fused, as gpt-oss does, one per expert: `stack_parts`). Where a part is a
whole number of the shm folder's pages and the old stack's ranges start on pages, the changed parts' bytes go into a
new segment and every unchanged part stays where it is, in whatever older generation's segment holds it: a new
generation costs the changed experts' bytes, not the stack's. Which parts changed is decided by their bytes (a pushed
part equal to what is served changes nothing); the changed parts of every stack a push changes go into one segment
(`write_changed`: one file and one mapping per reader). A stack whose ranges would pass MAX_EXTENTS is written whole
into one segment instead (compaction: a reader maps each range, and a long run of generations must not approach the
kernel's limit on a process's mappings, `vm.max_map_count`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from expertd.extents import MAX_EXTENTS, Extent, mappable, extents_of, replaced
from expertd.index import TensorEntry, checksum, combined_checksum, tensor_bytes
from expertd.partition import fused_experts
from expertd.shm import DTYPES, same_bytes

from .dequant import write_part

log = logging.getLogger("expertd.updates")


def stack_parts(entry: TensorEntry) -> int:
    """How many equal parts a served tensor has for `expert_ranges`: one per checkpoint source, or for an expert
    stack the checkpoint stores fused (one source, [E, R, C], experts outermost: gpt-oss), one per expert."""
    n = len(entry.sources)
    return (fused_experts(entry.name, entry.shape) or n) if n == 1 else n


def part_bytes(push, staged: dict, entry: TensorEntry, parts: int, device) -> list[torch.Tensor]:
    """The new bytes (uint8) of each part `push` writes: views of the staged tensor where it is the served bytes
    as they are (plain, the served dtype), else decoded into private memory as the whole path writes them."""
    data, scale = staged[push.name], (staged[push.scale.name] if push.scale else None)
    shape = push.served_shape
    if push.codec is None and scale is None and data.dtype == DTYPES[entry.dtype]:
        flat = data.reshape(-1).view(torch.uint8)
    else:
        out = torch.empty(shape, dtype=DTYPES[entry.dtype])
        write_part(out, data, scale, codec=push.codec, name=push.name, block=push.block, device=device)
        flat = out.reshape(-1).view(torch.uint8)
    count = parts if push.part is None else 1
    step = flat.numel() // count
    return [flat[k * step: (k + 1) * step] for k in range(count)]


@dataclass
class Changed:
    """A stack a push changes some parts of: the parts' new bytes (uint8), in part order."""

    entry: TensorEntry
    parts: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.parts.values())


def changed_parts(entry: TensorEntry, pushes: list, staged: dict, old, arena, device,
                  unpaged: list[TensorEntry]) -> Changed | None:
    """What `pushes` (the update's pushes into stack `entry`) change of it, decided by the parts' bytes: a copy of
    those parts' bytes (a decoded push's others dropped); empty where nothing changes. None where the parts are not
    whole pages (the entry then added to `unpaged`, for `say_unpaged`), all of them change, or the ranges would pass
    MAX_EXTENTS: the caller writes the stack whole."""
    n = stack_parts(entry)
    if not whole_pages(entry, arena, unpaged):
        return None
    new: dict[int, torch.Tensor] = {}
    for push in pushes:
        for k, data in zip(range(n) if push.part is None else (push.part,), part_bytes(push, staged, entry, n, device)):
            new[k] = data
    changed = [k for k in sorted(new) if not same_bytes(new[k], old.part(entry, k, n))]
    if len(changed) == n or len(layout(entry, changed, "")) > MAX_EXTENTS:
        return None
    return Changed(entry, {k: new[k].clone() for k in changed})  # not the rest of a decoded push


def write_changed(stacks: list[Changed], old, arena, sums: dict[str, list[str]]) -> list[TensorEntry]:
    """Write the changed parts of `stacks` back to back into one new segment of `arena` (a push's new bytes are one
    file and one mapping per reader, however many stacks it changes) and return each stack's new entry: its old ranges
    with those parts' replaced. `sums` (name -> each part's checksum, `Built.sums`) is updated: only changed parts are
    hashed where the old parts' checksums make the old entry's."""
    total = sum(c.nbytes for c in stacks)
    if not total:
        return [c.entry for c in stacks]
    where = arena.add(total)
    out = arena.tensor(where, (total,), torch.uint8)
    entries, at = [], 0
    for c in stacks:
        entry = c.entry
        if not c.parts:  # pushed as it is served: the same entry, its parts' checksums as they were
            entries.append(entry)
            continue
        each = part_sums(entry, old, sums.get(entry.name))
        for k, data in c.parts.items():
            out[at: at + data.numel()].copy_(data)
            each[k] = checksum(tensor_bytes(data))
            at += data.numel()
        extents = layout(entry, list(c.parts), where.segment, where.offset + at - c.nbytes)
        sums[entry.name] = each
        entries.append(TensorEntry(entry.name, extents[0].segment, extents[0].offset, entry.nbytes, list(entry.shape),
                                   entry.dtype, list(entry.sources), checksum=combined_checksum(each),
                                   experts=entry.experts, extents=extents))
    del out
    return entries


def part_checksums(t: torch.Tensor, parts: int) -> list[str]:
    """The checksum of each of `parts` equal parts of tensor `t`'s bytes: `tensor_checksum(t, parts)` combines them."""
    flat = t.reshape(-1).view(torch.uint8)
    step = flat.numel() // max(parts, 1)
    return [checksum(tensor_bytes(flat[k * step: (k + 1) * step])) for k in range(max(parts, 1))]


def part_sums(entry: TensorEntry, old, sums: list[str] | None) -> list[str]:
    """The checksum of each of the stack's parts: `sums` where they make its checksum, else hashed from its bytes."""
    n = stack_parts(entry)
    if sums is not None and len(sums) == n and combined_checksum(sums) == entry.checksum:
        return list(sums)
    return [checksum(tensor_bytes(old.part(entry, k, n))) for k in range(n)]


def whole_pages(entry: TensorEntry, arena, unpaged: list[TensorEntry]) -> bool:
    """Whether the stack's parts can be ranges of their own: two or more, each whole pages of the arena's folder, the
    old ranges starting on pages. A stack of parts that are not is added to `unpaged`: it is written whole."""
    n, unit = stack_parts(entry), arena.shm.unit
    if n < 2:
        return False
    if entry.nbytes // n % unit or not mappable(extents_of(entry), unit):
        unpaged.append(entry)
        return False
    return True


def say_unpaged(unpaged: list[TensorEntry], arena, what: str) -> None:
    """One log line for a push's or reload's stacks that were written whole: their parts are not whole pages."""
    if unpaged:
        first = unpaged[0]
        n = stack_parts(first)
        log.info("%s: %d changed expert stack(s) written whole, their experts' parts not whole pages of %s (%d bytes): "
                 "%s has %d parts of %d bytes", what, len(unpaged), arena.shm_dir, arena.shm.unit, first.name, n,
                 first.nbytes // n)


def layout(entry: TensorEntry, changed: list[int], segment: str, offset: int = 0) -> list[Extent]:
    """The new stack's ranges: the changed parts back to back in `segment` from `offset`, the others where they are."""
    return replaced(extents_of(entry), stack_parts(entry), changed, segment, offset)
