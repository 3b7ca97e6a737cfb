"""Weights pushed by a process (an RL trainer, online fine-tuning) become a new generation.

The updater names the tensors it pushes; the daemon checks every name, shape and dtype against
the latest generation and hands back a staging segment to write them into (tensor bytes never
travel over ZeroMQ). On commit the daemon checks the staged bytes against the updater's
checksums, then builds the new generation: each served tensor that receives a pushed value gets
a fresh segment holding the old bytes with the pushed parts written over them (quantized parts pushed
in the checkpoint's format — FP8 with its scale, MXFP4 `*_blocks` with `*_scales` — are dequantized
exactly as at load); everything else is shared.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass

import torch

from expertd.errors import UpdateRejected
from expertd.index import DEFAULT_SHM_DIR, TensorEntry, TensorIndex, combined_checksum, tensor_checksum
from expertd.messages import PushedTensor
from expertd.quantization import Codec, quantization_format
from expertd.replies import StagedTensor, UpdateReply
from expertd.segments import OPEN_FLAGS, segment_path
from expertd.shm import DTYPES

from ..load.building import PreviousBytes
from ..load.built import Built
from ..load.dequant import write_part
from ..load.expert_slots import Changed, changed_parts, part_checksums, say_unpaged, stack_parts, write_changed
from ..load.loader import segments_of
from ..shm.arena import Arena, placed_size

log = logging.getLogger("expertd.updates")


@dataclass
class Push:
    """One pushed tensor: where its bytes are staged and which served tensor (and part) it replaces."""

    name: str
    shape: list[int]
    dtype: str
    target: TensorEntry  # the served tensor it goes into
    part: int | None  # position among the target's parts; None: the whole tensor
    parts: int  # how many parts the target has
    offset: int = 0  # in the staging segment
    scale: "Push | None" = None  # a quantized push's aux tensor (FP8 scale, MXFP4 scales)
    codec: Codec | None = None  # a quantized push's format (its dequant writes it); None: written as it is
    block: tuple[int, int] | None = None  # fp8: the (rows, columns) one scale covers
    served_shape: list[int] | None = None  # what it becomes (a quantized push's decoded shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def plan_update(index: TensorIndex, items: list[PushedTensor]) -> list[Push]:
    """Check every pushed name, shape and dtype against the served generation (their types are checked by
    `messages`); nothing is created."""
    if not items:
        raise UpdateRejected("an update needs a non-empty list of tensors")
    served = {t.name: t for t in index.tensors}
    views = {v.name: v for v in index.all_views()}
    codec = quantization_format(index.config)
    specs = {}
    for item in items:
        if item.dtype not in DTYPES:
            raise UpdateRejected(f"tensor {item.name!r}: dtype {item.dtype!r} is not one expertd serves")
        if item.name in specs:
            raise UpdateRejected(f"tensor {item.name!r} is named twice in the update")
        specs[item.name] = (item.shape, item.dtype)
    logical = codec.logical(specs)  # {served name: (pushed tensor, its aux)}
    unserved = [stored for n, (stored, _) in logical.items() if n not in served and n not in views]
    if unserved:
        share = ""
        if index.expert_parallel is not None:
            share = (f"; this daemon serves the experts of EP ranks {list(index.expert_parallel.ranks)} of "
                     f"{index.expert_parallel.size} (push to every host with expertd.client.push_all)")
        raise UpdateRejected(f"{len(unserved)} tensor(s) not served here (neither a served nor a checkpoint name): "
                             f"{', '.join(map(repr, unserved))}{share}")
    pushes, claimed = [], {}
    for name, (stored, aux) in logical.items():
        if name in served:
            target, part, want = served[name], None, served[name]
        elif name in views:
            view = views[name]
            target, want = served[view.base], view
            part = target.sources.index(name)
        else:
            raise UpdateRejected(f"tensor {name!r} is not served (neither a served nor a checkpoint name)")
        push = _push(codec, specs, stored, aux, target, part, want)
        key = (target.name, part)
        overlaps = [k for k in claimed if k[0] == target.name and (k[1] is None or part is None or k[1] == part)]
        if overlaps:
            raise UpdateRejected(f"tensor {name!r} overlaps {claimed[overlaps[0]]!r} in the same update")
        claimed[key] = name
        pushes.append(push)
    return pushes


def _push(codec, specs: dict, stored: str, aux: str | None, target: TensorEntry, part: int | None, want) -> Push:
    """The push of `stored` into `want` (a served tensor or one of its parts), checked: as served, or quantized
    in the checkpoint's format with its aux tensor (the codec's `check_push`)."""
    shape, dtype = specs[stored]
    push = Push(stored, shape, dtype, target, part, len(target.sources), served_shape=list(want.shape))
    decoding = codec.check_push(stored, specs[stored], aux, specs.get(aux), want)
    if decoding is not None:
        push.codec, push.block = decoding.codec, decoding.block
        push.scale = Push(aux, *specs[aux], target, part, push.parts)
    elif shape != want.shape:
        raise UpdateRejected(f"tensor {stored!r}: shape {shape} does not match the served {want.shape}")
    elif dtype != want.dtype:
        raise UpdateRejected(f"tensor {stored!r}: dtype {dtype} is not the served {want.dtype} (or quantized in the "
                             f"checkpoint's format with its scale)")
    return push


ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION, _ANY = 2, 0xFFFFFFFF
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def writer_acl(uid: int) -> bytes:
    """A POSIX access ACL in the kernel's xattr form: the owner (the daemon) and user `uid` read and write, nobody
    else anything (its group included). A later chmod 0600 sets the mask to none: `uid` may then do nothing."""
    entries = [(_USER_OBJ, 6, _ANY), (_USER, 6, uid), (_GROUP_OBJ, 0, _ANY), (_MASK, 6, _ANY), (_OTHER, 0, _ANY)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


class Staging:
    """The segment an updater writes its pushed tensors into, owned by the daemon until commit.

    It is 0600 whatever the group. An updater of another uid on this host (`writer`: its uid as SO_PEERCRED says)
    is let write it by an ACL entry of its uid alone, never the group's; where the folder takes no ACLs
    (hugetlbfs), it cannot open the segment and sends its bytes as `stage` frames, as over tcp://."""

    def __init__(self, namespace: str, number: int, pushes: list[Push], client: str, group: str | None = None,
                 shm_dir: str = DEFAULT_SHM_DIR, writer: int | None = None):
        self.number = number
        self.client = client
        self.committed = False  # a build from it is under way: it goes when that ends
        self.pushes = pushes
        flat = [t for p in pushes for t in ((p, p.scale) if p.scale else (p,))]
        # one segment for all: each tensor starts on a page, so it needs the page-rounded sizes
        self.arena = Arena(namespace, f"u{number}", segment_bytes=sum(placed_size(t.nbytes) for t in flat),
                           group=group, shm_dir=shm_dir)
        places = self.arena.place([t.nbytes for t in flat])
        if len(self.arena.segments) != 1:
            raise AssertionError(f"staging placed {len(flat)} tensors in {len(self.arena.segments)} segments")
        for t, where in zip(flat, places):
            t.offset = where.offset
        self.arena.create(private=True)
        self.arena.unmap()  # the daemon reads it back through a fresh read-only mapping at commit
        self.segment = self.arena.segments[0]
        self.tensors = flat
        self.writer = writer if writer is not None and writer != os.geteuid() and self._let_write(writer) else None

    def _let_write(self, uid: int) -> bool:
        """Give uid `uid` alone read-write access to the segment (an ACL entry); False where the folder takes none."""
        fd = os.open(segment_path(self.segment.name, self.arena.shm_dir), os.O_RDONLY | OPEN_FLAGS)
        try:
            os.setxattr(fd, ACL_XATTR, writer_acl(uid))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                self.close()
                raise
            log.info("staging segment %s stays 0600 (%s takes no ACL: %s): uid %d sends its bytes as frames",
                     self.segment.name, self.arena.shm_dir, exc.strerror, uid)
            return False
        finally:
            os.close(fd)
        return True

    def reply(self) -> UpdateReply:
        """What the updater writes into: the segment and where each pushed tensor goes in it."""
        return UpdateReply(update=self.number, segment=self.segment.name, nbytes=self.segment.nbytes,
                           shm_dir=self.arena.shm_dir,
                           tensors=[StagedTensor(name=t.name, offset=t.offset, nbytes=t.nbytes) for t in self.tensors])

    def seal(self) -> dict[str, torch.Tensor]:
        """The staged tensors copied into this process's private memory, the segment closed to its updater first
        (0600, which masks its ACL entry): the updater (another uid, with a writable mapping of its own) can change
        the segment at any time, so what is checked and what is built from must be this one copy, never the shared
        pages."""
        fd = os.open(segment_path(self.segment.name, self.arena.shm_dir), os.O_RDONLY | OPEN_FLAGS)
        try:
            os.fchmod(fd, 0o600)
            data = torch.empty(self.segment.nbytes, dtype=torch.uint8)
            buf, done = memoryview(data.numpy()), 0
            while done < len(buf):
                got = os.preadv(fd, [buf[done:]], done)
                if got == 0:
                    raise UpdateRejected(f"staging segment {self.segment.name} is shorter than the update's "
                                         f"{self.segment.nbytes} bytes: it was truncated")
                done += got
        finally:
            os.close(fd)
        return {t.name: data[t.offset: t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) if t.nbytes
                else torch.empty(t.shape, dtype=DTYPES[t.dtype]) for t in self.tensors}

    def verify(self, checksums: list[str]) -> dict[str, torch.Tensor]:
        """The staged tensors (`seal`: a private copy), after checking each against the updater's checksum of what
        it wrote; the build reads that copy only."""
        if len(checksums) != len(self.tensors):
            raise UpdateRejected(f"commit needs one checksum per staged tensor ({len(self.tensors)})")
        staged = self.seal()
        for t, want in zip(self.tensors, checksums):
            got = tensor_checksum(staged[t.name])
            if got != want:
                raise UpdateRejected(f"staged bytes of {t.name!r} do not match the updater's checksum "
                                     f"({got} != {want})")
        return staged

    def write(self, tensor: int, at: int, frames: list) -> int:
        """Write pushed bytes that came as frames (an updater on another host) into staged tensor `tensor`
        from its byte `at` (both non-negative ints: `messages.Stage`); returns the bytes written."""
        if tensor >= len(self.tensors):
            raise UpdateRejected(f"update {self.number} stages {len(self.tensors)} tensors, not tensor {tensor!r}")
        slot = self.tensors[tensor]
        nbytes = sum(len(f) for f in frames)
        if at + nbytes > slot.nbytes:
            raise UpdateRejected(f"{nbytes} bytes at {at!r} do not fit staged tensor {slot.name!r} "
                                 f"({slot.nbytes} bytes)")
        # one pwritev of the request's frames into the segment's file: no mapping, and tmpfs takes the fresh
        # pages without zeroing them first (a write through a mapping has them zeroed, then written);
        # hugetlbfs has no write(): there they go through a mapping
        place = slot.offset + at
        fd = os.open(segment_path(self.segment.name, self.arena.shm_dir), os.O_RDWR | OPEN_FLAGS)  # never a link
        try:
            done = 0
            while done < nbytes:
                done += os.pwritev(fd, _rest(frames, done), place + done)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            mapping = mmap.mmap(fd, self.segment.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for frame in frames:
                mapping[place: place + len(frame)] = frame
                place += len(frame)
            mapping.close()
        finally:
            os.close(fd)
        return nbytes

    def close(self) -> None:
        self.arena.unlink()


def _marked(digests: list[str] | None, pushes: list[Push], staged: dict, n: int) -> list[str]:
    """A pushed tensor's part digests (what a later reload compares its checkpoint's parts with): each pushed part
    marked with the checksum of what was pushed into it."""
    digests = list(digests or [""] * n)
    for p in pushes:
        scale = staged[p.scale.name] if p.scale else None
        mark = f"pushed:{tensor_checksum(staged[p.name])}" + (f"+{tensor_checksum(scale)}" if scale is not None else "")
        for k in (range(n) if p.part is None else (p.part,)):
            digests[k] = f"{mark}#{k}"
    return digests


def _rest(frames: list, skip: int) -> list:
    """The buffers of `frames` after their first `skip` bytes (what a short pwritev left)."""
    out = []
    for frame in frames:
        if skip >= len(frame):
            skip -= len(frame)
            continue
        out.append(frame[skip:] if skip else frame)
        skip = 0
    return out[:1024]  # IOV_MAX


def build_update(previous: Built, staging: Staging, staged: dict[str, torch.Tensor], *, generation: int,
                 device: torch.device, group: str | None = None, ranges: bool = False) -> Built:
    """The previous generation with the staged values written into fresh copies of their served tensors."""
    started = time.perf_counter()
    index = previous.index
    old = PreviousBytes(index)
    by_target: dict[str, list[Push]] = {}
    for p in staging.pushes:
        by_target.setdefault(p.target.name, []).append(p)
    arena = Arena(index.namespace, generation, group=group, shm_dir=index.shm_dir)
    entries, parts, sums, written = [], dict(previous.parts), dict(previous.sums), 0
    ranged: list[tuple[int, Changed]] = []  # (its place in `entries`, what the update changes of the stack)
    unpaged: list[TensorEntry] = []  # stacks written whole: their parts are not whole pages
    try:
        for entry in index.tensors:
            pushes = by_target.get(entry.name)
            if not pushes:
                entries.append(entry)
                continue
            change = changed_parts(entry, pushes, staged, old, arena, device, unpaged) if ranges else None
            if change is not None:  # only the changed parts written, after the loop, all into one segment
                ranged.append((len(entries), change))
                entries.append(entry)
                if change.parts:
                    parts[entry.name] = _marked(parts.get(entry.name), pushes, staged, len(entry.sources))
                    written += change.nbytes
                continue
            where = arena.add(entry.nbytes)
            out = arena.tensor(where, tuple(entry.shape), DTYPES[entry.dtype])
            n = len(entry.sources)
            covered = {k for p in pushes for k in (range(max(n, 1)) if p.part is None else (p.part,))}
            if len(covered) < max(n, 1):  # some parts keep their old bytes (a whole push overwrites all of them)
                out.view(-1).view(torch.uint8).copy_(old.part(entry, 0, 1))
            chunks = out.view(-1).view(n, -1)
            for p in pushes:
                dest = out.view(-1) if p.part is None else chunks[p.part]
                scale = staged[p.scale.name] if p.scale else None
                write_part(dest.view(p.served_shape), staged[p.name], scale, codec=p.codec, name=p.name, block=p.block,
                           device=device)
            parts[entry.name] = _marked(parts.get(entry.name), pushes, staged, n)
            each_part = part_checksums(out, stack_parts(entry))  # the next push into it hashes its changed parts
            sums[entry.name] = each_part
            entries.append(TensorEntry(entry.name, where.segment, where.offset, entry.nbytes, list(entry.shape),
                                       entry.dtype, list(entry.sources), checksum=combined_checksum(each_part),
                                       experts=entry.experts))
            written += entry.nbytes
            del out, chunks, dest
        for (at, _), entry in zip(ranged, write_changed([c for _, c in ranged], old, arena, sums)):
            entries[at] = entry
        say_unpaged(unpaged, arena, f"generation {generation}'s push")
        arena.unmap()
        new_index = TensorIndex(generation=generation, namespace=index.namespace, model_type=index.model_type,
                                layout=index.layout, config=index.config,
                                segments=segments_of(entries, index, arena=arena), tensors=entries, views=None,
                                shm_dir=index.shm_dir, expert_parallel=index.expert_parallel)
    except BaseException:
        arena.unlink()
        raise
    return Built(arena, new_index, parts, previous.known, written, len(by_target), time.perf_counter() - started,
                 sums=sums)
