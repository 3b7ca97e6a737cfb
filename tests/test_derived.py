"""Derived tensors (`expertd.derived`, `server/variants.py`): a served expert stack gathered into another layout by a
real daemon, once per host, into a read-only shared segment of its own; reused by a newer generation whose source
bytes are the same, made afresh when they change; every bad request refused with VariantRejected before anything
is left in shared memory; nothing of the namespace left once the daemon stops.
"""

from __future__ import annotations

import bisect
import glob
import math
import os
import uuid
import zlib

import pytest
import torch

from expertd import derived, messages
from expertd.client import ExpertClient
from expertd.client.residency import shared_ranges
from expertd.connection import Connection
from expertd.errors import DaemonError, DerivedLimit, VariantRejected
from expertd.messages import GatherItem
from expertd.tools.generate import generate_model_type
from helpers.daemon import DaemonProcess

PAD = 64  # -1 entries mixed into the permutation: zeros in the derived block


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("derived") / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False)
    return folder


def _start(folder, checkpoint: str) -> tuple[DaemonProcess, str]:
    namespace = f"edt{uuid.uuid4().hex[:10]}"
    daemon = DaemonProcess.launch(folder, checkpoint, namespace, max_generations=8)
    daemon.wait_serving()
    return daemon, namespace


def _left(namespace: str) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/{namespace}*"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, checkpoint):
    """One daemon for the module; afterwards it must have exited 0 and left nothing of its namespace."""
    daemon, namespace = _start(tmp_path_factory.mktemp("run"), checkpoint)
    yield daemon
    code = daemon.stop()
    left = _left(namespace)
    for path in left:
        os.unlink(path)
    assert code == 0 and not left, (code, left)


@pytest.fixture
def client(daemon):
    with ExpertClient(daemon.endpoint, timeout=60) as c:
        yield c


def expert_stack(client: ExpertClient, layer: int = 0, which: str = "gate_up_proj") -> tuple[str, torch.Tensor]:
    (name,) = [n for n in client.served_tensors() if n.endswith(f"layers.{layer}.mlp.experts.{which}")]
    return name, client.served_tensors()[name]


def permutation(n: int, seed: int) -> torch.Tensor:
    """A random permutation of a block's n elements with PAD -1 entries mixed in (m = n + PAD)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.cat([torch.randperm(n, generator=g), torch.full((PAD,), -1, dtype=torch.int64)])
    return index[torch.randperm(n + PAD, generator=g)]


def reference(source: torch.Tensor, index: torch.Tensor, shape) -> torch.Tensor:
    """The gather computed here in torch: block j-th element = source block[index[j]], 0 where index[j] == -1."""
    blocks = source.reshape(source.shape[0], -1)
    out = blocks[:, index.clamp(min=0)].clone()
    out[:, index < 0] = 0
    return out.reshape(shape)


def ask(name: str, index: torch.Tensor, shape) -> GatherItem:
    return derived.request(name, derived.encode(index), index.numel(), shape)


def derivation(client: ExpertClient, item: GatherItem) -> str:
    """The derivation's name as the client computes it: a digest of the request and its sources' checksums."""
    served = {t.name: t for t in client.index().tensors}
    sources = [served[n] for n in (item.name, *(item.also or ()))]
    return derived.Gather(item, list(sources[0].shape), "test", [list(s.shape) for s in sources[1:]]).key(sources)


def derived_listed(daemon: DaemonProcess, generation: int) -> list[dict]:
    (gen,) = [g for g in daemon.status()["generations"] if g["generation"] == generation]
    return [v for v in gen["variants"] if "derivation" in v]


def mapping_of(t: torch.Tensor) -> tuple[str, str]:
    """(file, permissions) of this process's mapping that holds the tensor's first byte."""
    lo = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= lo < end:
                return (parts[5].strip() if len(parts) == 6 else ""), parts[1]
    raise AssertionError(f"no mapping holds {lo:#x}")


def in_shared_memory(t: torch.Tensor, shm_dir: str) -> bool:
    """All of the tensor's bytes lie in one read-only shared mapping of a file in `shm_dir`."""
    ranges = shared_ranges(shm_dir)
    k = bisect.bisect_right([lo for lo, _ in ranges], t.data_ptr()) - 1
    return k >= 0 and t.data_ptr() + t.numel() * t.element_size() <= ranges[k][1]


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


def malformed(daemon: DaemonProcess, client: ExpertClient, item: dict, needle: str) -> None:
    """Send a `gather` of one raw item: refused by the daemon's parser (ProtocolError naming the field) before it
    looks anything up; nothing made."""
    before, listed = _left(daemon.namespace), derived_listed(daemon, client.generation)
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        with pytest.raises(DaemonError, match="ProtocolError") as caught:
            conn.request("gather", client=client.lease, tensors=[item])
    finally:
        conn.close()
    assert needle in str(caught.value), (needle, str(caught.value))
    assert _left(daemon.namespace) == before and derived_listed(daemon, client.generation) == listed


def refused(daemon: DaemonProcess, client: ExpertClient, items: list[GatherItem], *needles: str) -> str:
    """Ask `items`: VariantRejected whose message holds every needle, and nothing made (no new segment, nothing more
    listed in status)."""
    before, listed = _left(daemon.namespace), derived_listed(daemon, client.generation)
    with pytest.raises(VariantRejected) as caught:
        client.derived(items)
    message = str(caught.value)
    assert all(needle in message for needle in needles), (needles, message)
    assert _left(daemon.namespace) == before
    assert derived_listed(daemon, client.generation) == listed
    return message


def high_water_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        (line,) = [line for line in f if line.startswith("VmHWM:")]
    return int(line.split()[1]) << 10


def test_bad_requests_are_refused_by_name_and_make_nothing(daemon, client):
    name, source = expert_stack(client)
    blocks, n = source.shape[0], source[0].numel()
    index = permutation(n, seed=4)
    m = index.numel()
    deflated = derived.encode(index)

    refused(daemon, client, [ask("model.layers.0.mlp.experts.nope", index, (blocks, m))],
            "'model.layers.0.mlp.experts.nope'", "no tensor", "derived layout")
    malformed(daemon, client, {"name": name, "index": "0,1,2", "length": m, "shape": [blocks, m]},
              "'index' must be binary data")
    refused(daemon, client, [derived.request(name, b"not deflated data at all", m, (blocks, m))],
            repr(name), "not deflated data")
    # deflated differences one short of `length`, and one too many
    refused(daemon, client, [derived.request(name, deflated, m + 1, (blocks, m + 1))],
            repr(name), f"does not inflate to {m + 1} int32")
    refused(daemon, client, [derived.request(name, deflated, m - 1, (blocks, m - 1))],
            repr(name), f"does not inflate to {m - 1} int32")
    # a deflate bomb: ~100 KB that inflates to 100 MB, refused without being inflated past what `length` allows
    bomb = zlib.compress(bytes(100 << 20), 9)
    assert len(bomb) <= messages.MAX_INDEX_BYTES
    high = high_water_bytes(daemon.proc.pid)
    refused(daemon, client, [derived.request(name, bomb, m, (blocks, m))], repr(name), f"does not inflate to {m} int32")
    assert high_water_bytes(daemon.proc.pid) - high < 32 << 20
    # entries outside [-1, n)
    for bad, held in ((n, n), (-2, -2)):
        outside = index.clone()
        outside[m // 2] = bad
        refused(daemon, client, [ask(name, outside, (blocks, m))], repr(name), f"holds {held}", f"outside [-1, {n})")
    # shapes that are not the source's blocks of `length`
    refused(daemon, client, [ask(name, index, (blocks + 1, m))], repr(name), f"{blocks} block(s)",
            f"[{blocks + 1}, {m}]")
    refused(daemon, client, [ask(name, index, (blocks, m // 4, 5))], repr(name), f"[{blocks}, {m // 4}, 5]")
    malformed(daemon, client, ask(name, index, (blocks, 0)).wire(), "'shape'[1] must be a positive integer")
    # an index over the cap, refused before it is inflated
    over = os.urandom(messages.MAX_INDEX_BYTES + 1)
    malformed(daemon, client, derived.request(name, over, m, (blocks, m)).wire(),
              f"'index' holds {messages.MAX_INDEX_BYTES + 1} bytes; at most {messages.MAX_INDEX_BYTES}")
    # every refusal left the daemon serving the good request
    (out,) = client.derived([ask(name, index, (blocks, m))])
    assert torch.equal(out, reference(source, index, (blocks, m)))


def test_derived_bytes_are_capped_at_the_served_bytes(daemon, client):
    """max_derived_bytes by default: the served bytes of the live generation (one here), in whole pages; a request
    over it is refused whole (DerivedLimit names the limit), nothing of it made."""
    generation = client.index().generation
    derived_now = daemon.status()["derived"]
    pages = sum(-(-max(t.nbytes, 1) // 4096) * 4096 for t in client.served_tensors().values() if t.nbytes)
    cap = derived_now["max_bytes"]
    assert cap == derived_now["max_bytes_per_reader"] == pages
    name, source = expert_stack(client, layer=1)
    blocks, size = source.shape[0], source.element_size()

    # one gather bigger than everything served (an index of -1s deflates to a few hundred bytes)
    huge = cap // (blocks * size) + 1
    pad = torch.full((huge,), -1, dtype=torch.int64)
    refused(daemon, client, [ask(name, pad, (blocks, huge))], repr(name), "max_derived_bytes",
            f"generation {generation}")

    # a request whose last gather passes the budget: those made before it in the request do not stay either
    # (the longest gather there is doubles the block: an index of padding, distinct lengths, distinct tensors)
    left = cap - derived_now["bytes"]
    n = source[0].numel()
    items = [ask(name, torch.full((2 * n - k,), -1, dtype=torch.int64), (blocks, 2 * n - k))
             for k in range(left // (blocks * 2 * n * size) + 2)]
    refused(daemon, client, items, repr(name), "max_derived_bytes", "nothing made")
    # asked one at a time: made until the next is over what is left, never past the cap
    made = 0
    for item in items:
        try:
            (out,) = client.derived([item])
        except DerivedLimit as exc:
            assert "max_derived_bytes" in str(exc) and repr(name) in str(exc)
            break
        assert not bool(out.any())
        made += 1
    else:
        raise AssertionError("every gather was made: the budget did not hold")
    sizes = [-(-blocks * (2 * n - k) * size // 4096) * 4096 for k in range(len(items))]
    assert made == max(k for k in range(len(items) + 1) if sum(sizes[:k]) <= left)
    assert daemon.status()["derived"]["bytes"] <= cap


def test_a_new_generation_gets_its_own_layouts_while_the_old_one_lives_at_its_cap(daemon, client):
    """The default cap sums the live generations' served bytes: with the generation a reader still leases derived up
    to its cap (an engine's expert layouts take about the served bytes), a newer generation an engine refreshes onto
    still gets a layout of its own; one that fits under no single generation's cap."""
    name, source = expert_stack(client, layer=1)
    blocks, n, size = source.shape[0], source[0].numel(), source.element_size()
    one = daemon.status()["derived"]["max_bytes"]
    for k in range(1000):  # padding gathers of distinct lengths until the leased generation's cap refuses one
        try:
            client.derived([ask(name, torch.full((2 * n - k,), -1, dtype=torch.int64), (blocks, 2 * n - k))])
        except DerivedLimit:
            break
    else:
        raise AssertionError("the cap never refused a gather")
    index = torch.cat([permutation(n, seed=7), torch.full((n - PAD,), -1, dtype=torch.int64)])  # the longest
    assert blocks * index.numel() * size > one - daemon.status()["derived"]["bytes"]  # over one generation's cap
    norm = "model.norm.weight"
    newer_generation = client.update({norm: torch.full_like(client.served_tensors()[norm], 0.5)})
    with ExpertClient(daemon.endpoint, timeout=60) as newer:
        assert newer.index().generation == newer_generation and client.index().generation < newer_generation
        assert daemon.status()["derived"]["max_bytes"] == 2 * one  # both generations serve the same sizes
        (out,) = newer.derived([ask(name, index, (blocks, index.numel()))])
        assert torch.equal(out, reference(newer.served_tensors()[name], index, (blocks, index.numel())))
        assert daemon.status()["derived"]["bytes"] <= 2 * one


def test_a_bomb_of_the_length_it_claims_is_refused_by_the_budget_before_it_is_inflated(daemon, client):
    name, source = expert_stack(client)
    blocks = source.shape[0]
    length = 25 << 20  # 100 MB of int32 zeros, deflated to ~100 KB; the derived tensor would be 400 MB
    bomb = zlib.compress(bytes(4 * length), 9)
    high = high_water_bytes(daemon.proc.pid)
    refused(daemon, client, [derived.request(name, bomb, length, (blocks, length))], repr(name), "served bytes")
    assert high_water_bytes(daemon.proc.pid) - high < 32 << 20


def test_a_length_past_any_budget_is_refused_unread(daemon, client):
    """A length of 2^61 is refused by the parser (no OverflowError, nothing inflated); one under the parser's bound
    but past the generation's budget by the budget check, naming the tensor."""
    name, source = expert_stack(client)
    length = 1 << 61
    malformed(daemon, client, derived.request(name, zlib.compress(bytes(8)), length, (source.shape[0], length)).wire(),
              "'length' must be a positive integer below 2^40")
    length = (1 << 39) // source.shape[0]
    refused(daemon, client, [derived.request(name, zlib.compress(bytes(8)), length, (source.shape[0], length))],
            repr(name), "served bytes")


def test_a_refused_request_lists_no_reused_tensor(daemon, client):
    name, source = expert_stack(client, layer=1)
    blocks = source.shape[0]
    index = permutation(source[0].numel(), seed=6)
    item = ask(name, index, (blocks, index.numel()))
    client.derived([item])
    norm = "model.norm.weight"
    newer_generation = client.update({norm: torch.zeros_like(client.served_tensors()[norm])})
    with ExpertClient(daemon.endpoint, timeout=60) as newer:
        assert newer.index().generation == newer_generation
        huge = daemon.status()["derived"]["max_bytes"] // (blocks * source.element_size()) + 1
        pad = ask(name, torch.full((huge,), -1, dtype=torch.int64), (blocks, huge))
        refused(daemon, newer, [item, pad], repr(name), "max_derived_bytes")
        assert derived_listed(daemon, newer_generation) == []  # (refused checks this too: the message says why)


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
