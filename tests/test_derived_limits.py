"""Derived tensors refused: every bad gather request refused by name (the parser's ProtocolError, or DerivedRejected)
before anything is made or listed; derived bytes capped (`max_derived_bytes`, per reader and daemon-wide), a new
generation's layouts made while the old one lives at its cap, deflate bombs and lengths past any budget refused
before they are inflated. A real daemon, as tests/test_derived.py's.
"""

from __future__ import annotations

import os
import zlib

import torch

from expertd import derived, messages
from expertd.client import ExpertClient
from expertd.errors import DerivedLimit
from helpers import derived_cases
from helpers.derived_cases import (
    PAD, ask, derived_listed, expert_stack, high_water_bytes, malformed, permutation, reference, refused,
)


# this module's fixtures, test_derived.py's too (tests/helpers/derived_cases.py): a checkpoint and a daemon
# for the module, a client per test
checkpoint, daemon, client = derived_cases.checkpoint, derived_cases.daemon, derived_cases.client


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


def mine(status: dict) -> int:
    """The derived bytes this process's uid (root's) holds."""
    return sum(row["bytes"] for row in status["readers"] if row["reader"] == f"uid {os.getuid()}")


def test_derived_bytes_are_capped_at_the_served_bytes(daemon, client):
    """max_derived_bytes_per_reader by default: the served bytes of the live generation (one here), in whole pages
    (a quarter of max_derived_bytes, four times them); a request over it is refused whole (DerivedLimit names the
    limit), nothing of it made."""
    generation = client.index().generation
    derived_now = daemon.status()["derived"]
    pages = sum(-(-max(t.nbytes, 1) // 4096) * 4096 for t in client.served_tensors().values() if t.nbytes)
    cap = derived_now["max_bytes_per_reader"]
    assert cap == pages and derived_now["max_bytes"] == 4 * pages
    name, source = expert_stack(client, layer=1)
    blocks, size = source.shape[0], source.element_size()

    # one gather bigger than everything served (an index of -1s deflates to a few hundred bytes)
    huge = cap // (blocks * size) + 1
    pad = torch.full((huge,), -1, dtype=torch.int64)
    refused(daemon, client, [ask(name, pad, (blocks, huge))], repr(name), "max_derived_bytes",
            f"generation {generation}")

    # a request whose last gather passes the budget: those made before it in the request do not stay either
    # (the longest gather there is doubles the block: an index of padding, distinct lengths, distinct tensors)
    left = cap - mine(derived_now)
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
    assert mine(daemon.status()["derived"]) <= cap


def test_a_new_generation_gets_its_own_layouts_while_the_old_one_lives_at_its_cap(daemon, client):
    """The default cap sums the live generations' served bytes: with the generation a reader still leases derived up
    to its cap (an engine's expert layouts take about the served bytes), a newer generation an engine refreshes onto
    still gets a layout of its own; one that fits under no single generation's cap."""
    name, source = expert_stack(client, layer=1)
    blocks, n, size = source.shape[0], source[0].numel(), source.element_size()
    one = daemon.status()["derived"]["max_bytes_per_reader"]
    for k in range(1000):  # padding gathers of distinct lengths until the leased generation's cap refuses one
        try:
            client.derived([ask(name, torch.full((2 * n - k,), -1, dtype=torch.int64), (blocks, 2 * n - k))])
        except DerivedLimit:
            break
    else:
        raise AssertionError("the cap never refused a gather")
    index = torch.cat([permutation(n, seed=7), torch.full((n - PAD,), -1, dtype=torch.int64)])  # the longest
    assert blocks * index.numel() * size > one - mine(daemon.status()["derived"])  # over one generation's cap
    norm = "model.norm.weight"
    newer_generation = client.update({norm: torch.full_like(client.served_tensors()[norm], 0.5)})
    with ExpertClient(daemon.endpoint, timeout=60) as newer:
        assert newer.index().generation == newer_generation and client.index().generation < newer_generation
        assert daemon.status()["derived"]["max_bytes_per_reader"] == 2 * one  # both generations serve the same sizes
        (out,) = newer.derived([ask(name, index, (blocks, index.numel()))])
        assert torch.equal(out, reference(newer.served_tensors()[name], index, (blocks, index.numel())))
        assert mine(daemon.status()["derived"]) <= 2 * one


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

