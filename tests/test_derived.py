"""Derived tensors (`expertd.derived`, `server/derived/`): a served expert stack gathered into another layout by a
real daemon, once per host, into a read-only shared segment of its own; reused by a newer generation whose source
bytes are the same, made afresh when they change; every bad request refused with DerivedRejected before anything
is left in shared memory; nothing of the namespace left once the daemon stops.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import pytest
import torch

from expertd import derived
from expertd.client import ExpertClient
from helpers import derived_cases
from helpers.derived_cases import (
    PAD, _left, _start, ask, derivation, derived_listed, expert_stack, in_shared_memory, malformed, mapping_of,
    permutation, reference, refused,
)


# this module's fixtures, test_derived_limits.py's too (tests/helpers/derived_cases.py): a checkpoint and a daemon
# for the module, a client per test
checkpoint, daemon, client = derived_cases.checkpoint, derived_cases.daemon, derived_cases.client


def test_gather_of_an_expert_stack_is_the_reference_in_read_only_shared_memory(daemon, client):
    name, source = expert_stack(client)
    blocks, n = source.shape[0], source[0].numel()
    index = permutation(n, seed=1)
    shape = (blocks, (n + PAD) // 64, 64)
    (out,) = client.derived([ask(name, index, shape)])
    assert out.shape == shape and out.dtype == source.dtype
    assert torch.equal(out, reference(source, index, shape))
    assert int((out.reshape(blocks, -1)[:, index < 0] != 0).sum()) == 0 and bool(out.any())
    shm_dir = client.index().shm_dir
    assert in_shared_memory(out, shm_dir)
    path, perms = mapping_of(out)
    assert perms == "r--s" and path.startswith(f"/dev/shm/{daemon.namespace}.") and ".v1." in path, (path, perms)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def tile_transpose(rows: int, cols: int, tile: int) -> torch.Tensor:
    """vLLM's CPU MoE "vec" packing of a [rows, cols] block: each `tile`-row tile stored column by column."""
    return torch.arange(rows * cols).reshape(rows // tile, tile, cols).permute(0, 2, 1).reshape(-1)


@pytest.mark.parametrize("tile", [2, 4])
def test_a_strided_index_and_one_strided_but_for_its_last_pair_gather_the_same_as_the_reference(daemon, client, tile):
    """An index that is a strided view of the block (a tile transpose) is copied as one (`expertd.strided`); one that
    is such a view up to its last two entries, swapped, is gathered entry by entry: both equal the reference."""
    name, source = expert_stack(client, layer=1, which="down_proj")
    strided = tile_transpose(4 * tile, source.shape[2], tile)  # the first rows of each block (a small budget)
    almost = strided.clone()
    almost[-2:] = strided[-2:].flip(0)
    for index in (strided, almost):
        (out,) = client.derived([ask(name, index, (source.shape[0], index.numel()))])
        assert torch.equal(out, reference(source, index, (source.shape[0], index.numel())))


def test_the_strided_form_is_found_only_where_every_entry_has_it():
    from expertd.strided import Strides

    def form(index: torch.Tensor, chunk: int = 1000):
        found = Strides(index.numel())
        for at in range(0, index.numel(), chunk):
            found.feed(at, index[at:at + chunk])
        return found.form()

    vec = tile_transpose(64, 48, 16)
    assert form(vec) == ((4, 48, 16), (16 * 48, 1, 48), 0)
    assert form(torch.arange(10, 3082)) == ((3072,), (1,), 10)
    assert form(torch.arange(64 * 48).reshape(64, 48).t().reshape(-1)) == ((48, 64), (1, 48), 0)
    for k in (0, 1500, vec.numel() - 2):  # one pair swapped anywhere: no form
        bad = vec.clone()
        bad[k:k + 2] = vec[k:k + 2].flip(0)
        assert form(bad) is None, k
    assert form(torch.cat([vec, torch.full((16,), -1)])) is None  # padding
    assert form(torch.randperm(vec.numel(), generator=torch.Generator().manual_seed(1))) is None


def test_a_job_whose_items_share_an_index_checks_it_once_and_gathers_each_item_right(daemon, client):
    """A derivation job (over the inline bound of items) whose items send one index alike on several sources (a
    model's layers of one kind): the index is checked and its strided form found once, every item still gathers its
    own source, and an index out of range refuses the whole request however many items share it."""
    (l0, s0), (l1, s1) = expert_stack(client, layer=0), expert_stack(client, layer=1)
    assert s0.shape == s1.shape
    strided = tile_transpose(64, s0.shape[2], 16)  # each block's first rows, packed as vLLM's CPU kernel does
    scrambled = strided.clone()  # strided but for one pair: gathered entry by entry
    scrambled[1000:1002] = strided[1000:1002].flip(0)
    asked = [(l0, s0, strided), (l1, s1, strided), (l1, s1, scrambled)] * 22
    assert len(asked) > 64  # a job, not an inline request

    def items(which):
        return [ask(name, index, (source.shape[0], index.numel())) for name, source, index in which]

    outs = client.derived(items(asked))
    for out, (_, source, index) in zip(outs, asked):
        assert torch.equal(out, reference(source, index, (source.shape[0], index.numel())))
    assert not torch.equal(outs[0], outs[1])  # each item its own source's bytes, not its index-mate's
    bad = strided.clone()
    bad[-1] = s0[0].numel()  # past the block, in the last entry: found only by a check of the whole index
    refused(daemon, client, items([(l0, s0, bad), (l1, s1, bad)] * 33), "holds", f"outside [-1, {s0[0].numel()})")


def test_asked_again_and_from_another_client_is_the_same_segment(daemon, client):
    name, source = expert_stack(client)
    blocks, n = source.shape[0], source[0].numel()
    index = permutation(n, seed=2)
    shape = (blocks, n + PAD)
    item = ask(name, index, shape)
    before = _left(daemon.namespace)
    (first,) = client.derived([item])
    made = sorted(set(_left(daemon.namespace)) - set(before))
    assert len(made) == 1, made  # one new segment, the derived tensor's
    (again,) = client.derived([item])
    assert again.data_ptr() == first.data_ptr()
    with ExpertClient(daemon.endpoint, timeout=60) as other:
        (theirs,) = other.derived([item])
        assert mapping_of(theirs)[0] == made[0] and torch.equal(theirs, first)
    assert _left(daemon.namespace) == sorted(before + made)  # nothing more made by the asks after the first
    listed = [v for v in derived_listed(daemon, client.generation) if v["derivation"] == derivation(client, item)]
    assert len(listed) == 1, listed
    (v,) = listed
    assert v["name"] == name and v["shape"] == list(shape) and f"/dev/shm{v['segment']}" == made[0]
    assert v["nbytes"] == math.prod(shape) * source.element_size() and v["dtype"] == str(source.dtype)
    assert torch.equal(first, reference(source, index, shape))


def test_a_gathers_name_is_the_digest_protocol_md_gives(daemon, client):
    """PROTOCOL.md's derivation name of a gather, computed here from its words alone (gather "v": 2: the inflated
    index by its own digest inside the canonical request), is the name the daemon lists and the client checks."""
    name, source = expert_stack(client)
    index = torch.cat([permutation(64, seed=3), torch.full((8,), -1, dtype=torch.int64)])  # a few bytes of quota
    shape = (source.shape[0], index.numel())
    item = ask(name, index, shape)
    client.derived([item])
    entry = next(t for t in client.index().tensors if t.name == name)
    differences = torch.cat([index[:1], index[1:] - index[:-1]]).to(torch.int32).numpy().astype("<i4").tobytes()
    canonical = {"kind": "gather", "v": 2, "dtype": entry.dtype, "sources": [[name, entry.dtype, list(entry.shape),
                                                                               entry.checksum]],
                 "shape": list(shape), "blocks": shape[0], "length": index.numel(),
                 "index": hashlib.blake2b(differences, digest_size=32, person=b"expertd.index").hexdigest()}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode() + b"\0"
    want = "blake2b:" + hashlib.blake2b(text, digest_size=32, person=b"expertd.derive").hexdigest()
    assert derivation(client, item) == want
    assert want in {v["derivation"] for v in derived_listed(daemon, client.generation)}


def test_a_derived_tensor_whose_bytes_differ_from_its_checksum_is_refused_unless_trusted(daemon, client):
    """A derived tensor's bytes changed behind the daemon (as its owner could): a client mapping it checks it
    against the checksum the daemon made it with and refuses it, naming it; the same asked as `trusted` (an
    engine's map of layers whose checked layer it compared byte for byte) is mapped unchecked."""
    from expertd.errors import ProtocolError

    name, source = expert_stack(client)
    index = torch.cat([permutation(32, seed=5), torch.full((8,), -1, dtype=torch.int64)])
    item = ask(name, index, (source.shape[0], index.numel()))
    (good,) = client.derived([item])
    path = mapping_of(good)[0]
    del good
    with open(path, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        with ExpertClient(daemon.endpoint, timeout=60) as other:
            with pytest.raises(ProtocolError, match=f"derived tensor '{name}' .* does not match its checksum"):
                other.derived([item])
            (trusted,) = other.derived([item], trusted=1)
            assert not torch.equal(trusted, reference(source, index, tuple(trusted.shape)))
            del trusted
    finally:
        with open(path, "r+b") as f:
            f.write(byte)
    with ExpertClient(daemon.endpoint, timeout=60) as other:
        (again,) = other.derived([item])
        assert torch.equal(again, reference(source, index, tuple(again.shape)))


def test_newer_generation_reuses_same_bytes_and_remakes_changed_ones(daemon, client):
    name, source = expert_stack(client, layer=1)
    blocks, n = source.shape[0], source[0].numel()
    index = permutation(n, seed=3)
    shape = (blocks, n + PAD)
    item = ask(name, index, shape)
    (old,) = client.derived([item])
    old_segment = mapping_of(old)[0]
    assert torch.equal(old, reference(source, index, shape))

    norm = "model.norm.weight"
    unrelated = client.update({norm: torch.ones_like(client.served_tensors()[norm])})
    assert unrelated > client.generation
    with ExpertClient(daemon.endpoint, timeout=60) as newer:  # leases the new generation; `client` keeps the old
        assert newer.index().generation == unrelated
        assert torch.equal(newer.served_tensors()[name], source)
        before = _left(daemon.namespace)
        (reused,) = newer.derived([item])
        assert _left(daemon.namespace) == before  # not made again
        assert mapping_of(reused)[0] == old_segment and torch.equal(reused, old)
        (listed,) = [v for v in derived_listed(daemon, unrelated) if v["name"] == name]
        assert f"/dev/shm{listed['segment']}" == old_segment and listed["derivation"] == derivation(newer, item)
        # the old generation retires (its lease moves): the segment the newer one reuses stays
        client.refresh()
        assert unrelated - 1 not in {g["generation"] for g in daemon.status()["generations"]}
        assert os.path.exists(old_segment)

        changed = (source.float() * -2 + 1).to(source.dtype)
        stack = newer.update({name: changed})
        newer.refresh()
        assert newer.index().generation == stack and torch.equal(newer.served_tensors()[name], changed)
        (remade,) = newer.derived([item])
        made = sorted(set(_left(daemon.namespace)) - set(before))
        path = mapping_of(remade)[0]
        assert path != old_segment and path in made and f".v{stack}." in path, (path, made)
        assert torch.equal(remade, reference(changed, index, shape))
        assert not torch.equal(remade, old) and torch.equal(reused, reference(source, index, shape))


def test_a_gather_over_several_served_tensors_rearranges_their_concatenation(daemon, client):
    """`also`: vLLM's fused q/k/v from the served q_proj, k_proj and v_proj, one block over their concatenation;
    reused while all three are the same bytes, made afresh when one changes; an unserved source refused by name."""
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    served = client.served_tensors()
    flat = torch.cat([served[n].reshape(-1) for n in names])
    g = torch.Generator().manual_seed(11)
    index = torch.cat([torch.randperm(flat.numel(), generator=g), torch.full((PAD,), -1, dtype=torch.int64)])
    shape = (index.numel() // 8, 8) if index.numel() % 8 == 0 else (index.numel(),)
    item = derived.request(names[0], derived.encode(index), index.numel(), shape, also=names[1:])
    (out,) = client.derived([item])
    want = torch.where(index >= 0, flat[index.clamp(min=0)], torch.zeros((), dtype=flat.dtype)).reshape(shape)
    assert torch.equal(out, want) and in_shared_memory(out, client.index().shm_dir)
    key = derivation(client, item)
    (listed,) = [v for v in derived_listed(daemon, client.generation) if v["derivation"] == key]
    assert listed["name"] == names[0] and listed["shape"] == list(shape)

    with ExpertClient(daemon.endpoint, timeout=60) as newer:
        unrelated = newer.update({"model.norm.weight": torch.full_like(served["model.norm.weight"], 2.0)})
        newer.refresh()
        assert newer.index().generation == unrelated
        (reused,) = newer.derived([item])
        assert mapping_of(reused)[0] == mapping_of(out)[0]
        changed = (served[names[2]].float() * 3).to(served[names[2]].dtype)  # v_proj: the last source
        newer.update({names[2]: changed})
        newer.refresh()
        (remade,) = newer.derived([item])
        flat2 = torch.cat([served[names[0]].reshape(-1), served[names[1]].reshape(-1), changed.reshape(-1)])
        assert mapping_of(remade)[0] != mapping_of(out)[0]
        assert torch.equal(remade, torch.where(index >= 0, flat2[index.clamp(min=0)],
                                               torch.zeros((), dtype=flat.dtype)).reshape(shape))

    gone = derived.request(names[0], derived.encode(index), index.numel(), shape, also=[names[1], "no.such.weight"])
    refused(daemon, client, [gone], "'no.such.weight'", "not served")


def test_a_whole_gather_pads_a_tensor_as_one_block(daemon, client):
    """`whole`: the served tensor as one block, e.g. the embeddings padded to vLLM's vocabulary of a multiple of 64
    rows; a `blocks` other than 1 is refused by name."""
    name = "model.embed_tokens.weight"
    source = client.served_tensors()[name]
    rows = -(-source.shape[0] // 64) * 64 + 64  # at least one padding row
    index = torch.cat([torch.arange(source.numel()), torch.full(((rows - source.shape[0]) * source.shape[1],), -1)])
    (out,) = client.derived([derived.request(name, derived.encode(index), index.numel(), (rows, source.shape[1]),
                                             whole=True)])
    assert torch.equal(out[:source.shape[0]], source) and not bool(out[source.shape[0]:].any())
    bad = derived.request(name, derived.encode(index), index.numel(), (rows, source.shape[1]), whole=True).wire()
    malformed(daemon, client, {**bad, "blocks": 2}, "'blocks' must be a positive integer below 2")


def test_stop_leaves_nothing_of_the_namespace(tmp_path, checkpoint):
    daemon, namespace = _start(tmp_path, checkpoint)
    try:
        with ExpertClient(daemon.endpoint, timeout=60) as c:
            name, source = expert_stack(c)
            index = permutation(source[0].numel(), seed=5)
            shape = (source.shape[0], index.numel())
            (out,) = c.derived([ask(name, index, shape)])
            c.update({name: torch.zeros_like(source)})
            with ExpertClient(daemon.endpoint, timeout=60) as newer:  # generations 1 and 2 live, each derived
                (zeros,) = newer.derived([ask(name, index, shape)])
                assert not bool(zeros.any()) and bool(out.any())
            assert len([p for p in _left(namespace) if ".v" in p]) == 2
        del out, zeros
    finally:
        code = daemon.stop()
    left = _left(namespace)
    for path in left:
        os.unlink(path)
    assert code == 0 and not left, (code, left)
