"""A derived layout of a stack of which some experts changed keeps the other experts' blocks (`expert_ranges`).

A gather of one source works block by block (`expertd.derived`): derived block b is source block b rearranged. When
a newer generation's stack lies in the older one's ranges but for some experts (a push or reload with
`expert_ranges`), and a live generation holds the same derivation of the older stack (`DerivedTensor.form`: the request
but for its source's bytes), only the changed experts' blocks are derived again, into a segment of their size. The
new derived tensor's entry is the older derived tensor's ranges with those replaced (extents, as a served stack's); its
checksum is combined of its blocks' (`xxh3_64xN:`), each block hashed once, when made. A reader maps it as any stack of
ranges (`expertd.compose`). The older derived tensor's segments live while a live generation's derived tensor uses a
range of them (`Generation.segments`), and count against the derived quota while they do (`DerivedTensor.sizes`,
`Quota.usage`). The derived tensors record keeps each one's form and extents: a successor adopts it, and
its next push's derivation keeps that layout's unchanged blocks as well (their checksums hashed where they lie).
"""

from __future__ import annotations

from expertd.extents import MAX_EXTENTS, mappable, extents_of, reach, replaced, split
from expertd.index import TensorEntry, checksum, combined_checksum, tensor_bytes

from ..shm.arena import Arena
from .tensors import Planned, DerivedTensor, mapped_sources


def older_forms(gens, gen) -> dict[tuple, DerivedTensor]:
    """The derived tensors of the other live generations that a newer stack's derivation may keep blocks of, by form
    (the newest generation's where several have one). On the request loop (it reads the tables)."""
    out: dict[tuple, DerivedTensor] = {}
    for number in sorted(gens.live):
        other = gens.live[number]
        if other is not gen:
            out.update((v.form, v) for v in other.derived.values() if v.form)
    return out


def prior(planned: Planned, forms: dict[tuple, DerivedTensor], unit: int) -> tuple[DerivedTensor, list[int]] | None:
    """The older derived tensor whose blocks `planned` may keep, and the blocks to derive again (those whose source
    bytes lie elsewhere now): None where there is none, every block changed, or the blocks are not whole pages of
    shm_dir."""
    old = forms.get(planned.form) if planned.form else None
    if old is None or old.of.nbytes != planned.entry.nbytes or old.entry.nbytes != planned.nbytes:
        return None
    blocks = planned.gather.blocks
    now, before = split(extents_of(planned.entry), blocks), split(extents_of(old.of), blocks)
    changed = [b for b in range(blocks) if now[b] != before[b]]
    if not changed or len(changed) == blocks or (planned.nbytes // blocks) % unit \
            or not mappable(extents_of(old.entry), unit) \
            or len(replaced(extents_of(old.entry), blocks, changed, "", 0)) > MAX_EXTENTS:
        return None
    return old, changed


def placed_bytes(planned: Planned, changed: list[int]) -> int:
    """The bytes of the blocks derived again."""
    return planned.nbytes // planned.gather.blocks * len(changed)


def make_changed(gen, planned: Planned, old: DerivedTensor, changed: list[int], owner: str, placed: int,
                 group: str | None, should_stop=None) -> DerivedTensor:
    """Derive blocks `changed` of `planned` into a segment of their own of generation `gen`; the derived tensor's entry
    is
    `old`'s ranges with those blocks replaced. Touches no table (it may run on a job's thread)."""
    import copy

    from expertd.derived import gather_into
    from expertd.shm import to_dtype, view

    shm_dir, entry, blocks = gen.index.shm_dir, planned.entry, planned.gather.blocks
    arena = Arena(gen.index.namespace, f"v{gen.number}", group=group, shm_dir=shm_dir)
    dtype = to_dtype(planned.dtype)
    placement = arena.add(placed_bytes(planned, changed), gen.next_derived())
    one = copy.copy(planned.gather)
    one.blocks = 1  # each changed block gathered on its own, by the same index and strided form
    try:
        source = mapped_sources(gen, [entry])
        src = view(source, entry).reshape(blocks, -1)
        out = arena.tensor(placement, (len(changed), *planned.shape[1:]), dtype)
        sums = old_sums(old, blocks, shm_dir)
        for j, b in enumerate(changed):
            gather_into(out[j], [src[b]], one, should_stop)
            sums[b] = checksum(tensor_bytes(out[j]))
        del out, src, source
        arena.unmap()  # the daemon keeps no writable mapping
    except BaseException:
        arena.unlink()
        raise
    extents = replaced(extents_of(old.entry), blocks, changed, placement.segment, 0)
    made = TensorEntry(entry.name, extents[0].segment, extents[0].offset, planned.nbytes, list(planned.shape),
                       planned.dtype, [entry.name], checksum=combined_checksum(sums), extents=extents)
    older = old.sizes or {old.created: old.placed}
    sizes = {x.segment: older.get(x.segment, placed) for x in extents}  # what it keeps alive counts (`Quota`)
    return DerivedTensor(entry, made, planned.key, (), owner, placed, planned.form, sums, placement.segment, sizes)


def old_sums(old: DerivedTensor, blocks: int, shm_dir: str) -> list[str]:
    """Each block's checksum of `old`: kept since it was made, else (an adopted derived tensor) hashed where it lies."""
    if old.sums is not None and len(old.sums) == blocks:
        return list(old.sums)
    from expertd.segments import Placed, map_segment, extents_checksum

    ends = reach([old.entry])
    with Placed(lambda name: map_segment(name, ends[name], shm_dir=shm_dir)) as where:
        return [extents_checksum(where.read, part, 1) for part in split(extents_of(old.entry), blocks)]
