"""The derivation job belongs to no reader: each test performs one attack a review of the issue 37 work found
against the job that makes large casts and gathers off the request loop.

A job's refusal is told only to the reader who asked (it may be that reader's quota), kept as its words alone (not
the request's frames and indexes); large requests wait in a queue bounded per reader and for the daemon, and are made
a slice at a time, the reader served least lately first, so readers flooding the job cannot starve another's.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from expertd import derived
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import DerivedLimit
from expertd.protocol import PROTOCOL_VERSION
from expertd.security import Credentials, create_keys
from expertd.server.derived.requests import INLINE_ENTRIES, INLINE_ITEMS
from helpers.curve import curve_daemon
from helpers.floods import FLOODER
from helpers.polling import wait_until
from helpers.takers import MEMBER, finish, needs_root, spawn

pytestmark = pytest.mark.timeout(600)

BIG = "model.layers.1.mlp.experts.gate_up_proj"  # [8, 400, 320] bf16: one block of 1,024,000 elements
SMALL = "model.layers.1.mlp.experts.down_proj"  # [8, 320, 200] bf16: 1 MB, 2 MB as float32
ENTRIES = 1_500_000  # over the inline bound (2^20 index entries): a derivation job; 3 MB of output


def genuine() -> torch.Tensor:
    return torch.arange(ENTRIES) % 1_024_000


def item_of(index: torch.Tensor):
    return derived.request(BIG, derived.encode(index), index.numel(), (index.numel(),), whole=True)


# A reader of another uid: takes a lease, then (mode "quota") fills its own quota with a cast and asks the victim's
# gather once, leaving the job's refusal behind; (mode "flood") asks distinct large gathers that fail only when
# their index is inflated, over and over, until its stdin closes.
ATTACKER = """
import os, sys, threading, torch
from expertd import derived, messages
from expertd.connection import Connection
from expertd.errors import DerivedLimit
from expertd.protocol import PROTOCOL_VERSION
from expertd.errors import DaemonError
from expertd.protocol import PROTOCOL_VERSION
from expertd.replies import LeaseReply, DerivedReply
endpoint, mode = sys.argv[1], sys.argv[2]
conn = Connection(endpoint, timeout=60)
lease = conn.send(messages.Lease(pid=os.getpid(), protocol=PROTOCOL_VERSION), LeaseReply).client
big = "model.layers.1.mlp.experts.gate_up_proj"
def gather(index):
    item = derived.request(big, derived.encode(index), index.numel(), (index.numel(),), whole=True)
    return messages.Gather(client=lease, tensors=[item])
if mode == "quota":
    conn.send(messages.Cast(client=lease, tensors=[messages.CastItem(name="model.layers.1.mlp.experts.down_proj",
                                                                     dtype="torch.float32")]), DerivedReply)
    reply = conn.send(gather(torch.arange(1_500_000) % 1_024_000), DerivedReply)
    print("building" if reply.building else "made", flush=True)
else:
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    bad = []
    for k in range(6):
        index = torch.arange(1_500_000) % 1_024_000
        index[-1] = 10_000_000 + k  # out of range: found only once the whole index is inflated
        bad.append(gather(index))
    print("flooding", flush=True)
    asked = 0
    while not done.is_set():
        for request in bad:
            try:
                conn.send(request, DerivedReply)
            except DaemonError:
                pass
            asked += 1
    print(asked, flush=True)
"""


def job_running(daemon) -> bool:
    return daemon.status()["derived"]["job"] is not None


@needs_root
def test_a_readers_refusal_by_its_own_quota_is_not_told_to_another_reader(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, group="root", max_derived_bytes_per_reader=4 << 20)
    attacker = spawn(ATTACKER, daemon.endpoint, "quota", prefix=MEMBER)
    try:
        assert attacker.stdout.readline().strip() == "building", attacker.stderr.read()
        wait_until(lambda: not job_running(daemon), "the attacker's job ends (refused: past its own quota)")
    finally:
        finish([attacker])
    with ExpertClient(daemon.endpoint) as victim:  # uid 0: its quota is untouched
        (out,) = victim.derived([item_of(genuine())])
        assert torch.equal(out, victim.served_tensors()[BIG].reshape(-1)[genuine()])


@needs_root
def test_a_reader_flooding_the_job_does_not_starve_another(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, group="root")
    attacker = spawn(ATTACKER, daemon.endpoint, "flood", prefix=MEMBER)
    try:
        assert attacker.stdout.readline().strip() == "flooding", attacker.stderr.read()
        wait_until(lambda: job_running(daemon), "the attacker holds the derivation job")
        with ExpertClient(daemon.endpoint) as victim:
            (out,) = victim.derived([item_of(genuine())])
            assert torch.equal(out, victim.served_tensors()[BIG].reshape(-1)[genuine()])
        assert attacker.poll() is None  # made while the flood went on, not after it
    finally:
        attacker.stdin.close()
        asked = attacker.stdout.readline().strip()
        finish([attacker])
    assert int(asked) > 6, asked  # the attacker kept asking all along


def test_refused_jobs_keep_nothing_of_their_requests(tiny_checkpoint, start_daemon):
    """64 large requests of two 500 KB indexes each, every one refused when its job inflates it, never asked again:
    the daemon keeps their words, not their frames (each would hold ~1 MB of index)."""
    daemon = start_daemon(tiny_checkpoint)
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        with ExpertClient(daemon.endpoint) as client:
            lease = client.lease
            before = rss(daemon.proc.pid)
            generator = torch.Generator().manual_seed(3)
            for _ in range(64):
                items = [derived.request(BIG, torch.randint(0, 256, (500_000,), dtype=torch.uint8,
                                                            generator=generator).numpy().tobytes(),
                                         ENTRIES, (ENTRIES,), whole=True) for _ in range(2)]
                conn.request("gather", client=lease, tensors=[i.wire() for i in items])  # `building`: not again
                wait_until(lambda: not job_running(daemon), "the job refuses the request")
            grown = rss(daemon.proc.pid) - before
    finally:
        conn.close()
    assert grown < 24 << 20, f"the daemon grew by {grown / 2**20:.1f} MiB keeping 64 refusals"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) << 10


def test_a_readers_queue_is_bounded(tiny_checkpoint, start_daemon):
    """One reader's large requests wait at most QUEUED_PER_READER at once behind the job; more are refused by name
    (DerivedLimit), nothing made."""
    daemon = start_daemon(tiny_checkpoint)
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        with ExpertClient(daemon.endpoint) as client:
            requests = []  # made before the first is sent, so they follow one another as fast as the daemon answers
            for k in range(20):  # each job inflates 8 distinct indexes of 6 MB: far longer than a reply takes
                items = []
                for j in range(8):
                    index = genuine()
                    index[-1] = 10_000_000 + 8 * k + j
                    items.append(item_of(index).wire())
                requests.append(items)
            replies = []
            for items in requests:
                try:
                    replies.append(conn.request("gather", client=client.lease, tensors=items))
                except DerivedLimit as exc:
                    replies.append(exc)
            refused = [r for r in replies if isinstance(r, Exception)]
            assert refused and all("waiting for the daemon's derivation job" in str(r) for r in refused), replies
            assert all(r["building"] for r in replies if isinstance(r, dict))
            wait_until(lambda: not job_running(daemon), "the queued jobs end")
    finally:
        conn.close()


def test_twenty_listed_keys_flooding_the_queue_neither_starve_a_victim_nor_grow_the_daemon(tiny_checkpoint,
                                                                                           start_daemon, tmp_path):
    """Issue 49, finding 3: a victim's 65-item cast waited behind every flooding key's parked requests (28.5 s with 10
    keys), and 60 keys x 4 parked requests grew the daemon without bound. With 20 listed keys (each a reader of its
    own) keeping 4 large requests each asked: the queue holds at most 64 requests and 32 MiB of indexes, and the
    victim's cast is made while the flood goes on (its figures: benchmarks/bench_fair_readers.py F2)."""
    listed = tmp_path / "clients"
    secrets = []
    for k in range(21):
        secret = create_keys(str(listed), f"reader{k}")[1]
        secrets.append(str(tmp_path / os.path.basename(secret)))
        os.rename(secret, secrets[-1])
    daemon, public = curve_daemon(start_daemon, tiny_checkpoint, tmp_path, probe_key=secrets[0],
                                  curve_client_keys=str(listed), max_derived_bytes=1 << 30,
                                  max_derived_bytes_per_reader=1 << 28)
    before = rss(daemon.proc.pid)
    flooder = spawn(FLOODER, daemon.endpoint, public, *secrets[1:])
    victim = Connection(daemon.endpoint, timeout=60, credentials=Credentials.resolve(server_key=public,
                                                                                    client_key=secrets[0]))
    try:
        assert flooder.stdout.readline().strip() == "flooding", flooder.stderr.read()
        wait_until(lambda: victim.request("status")["derived"]["queued"] >= 32, "the flood fills the queue")
        lease = victim.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
        served = [t for t in victim.request("index", client=lease)["index"]["tensors"]
                  if t["dtype"] in ("torch.bfloat16", "torch.float32")]
        items = [{"name": t["name"], "dtype": d} for d in ("torch.float16", "torch.float64") for t in served][:65]
        seen = []
        while True:
            reply = victim.request("cast", client=lease, tensors=items)
            seen.append(victim.request("status")["derived"])
            if not reply.get("building"):
                break
            time.sleep(0.05)
        assert len(reply["tensors"]) == 65
        assert flooder.poll() is None  # made while the flood went on
        assert max(s["queued"] for s in seen) <= 64 and max(s["queued_bytes"] for s in seen) <= 32 << 20
        grown = rss(daemon.proc.pid) - before
        assert grown < 64 << 20, f"the daemon grew by {grown / 2**20:.1f} MiB under 20 flooding keys"
    finally:
        victim.close()
        flooder.stdin.close()
        said = flooder.stdout.readline().strip()
        finish([flooder])
    assert int(said) >= 1  # the flood was refused (queue full, or its own requests' late refusals)


def test_a_request_past_the_loops_small_bound_is_made_off_it(tiny_checkpoint, start_daemon):
    """Issue 49, finding 4: requests at the old inline bound (64 items, 2^20 entries, 8 MiB) ran on the request loop
    and stalled every other client. What runs there now is at most INLINE_ITEMS items, INLINE_ENTRIES index entries
    and INLINE_BYTES to make: one more item, or one more entry, and the reply says `building` (a derivation job)."""
    daemon = start_daemon(tiny_checkpoint)
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
        m = INLINE_ENTRIES // INLINE_ITEMS

        def request(items: int, entries: int, seed: int) -> list:
            g = torch.Generator().manual_seed(seed)
            return [item_of(torch.randint(0, 1_024_000, (entries,), generator=g)).wire() for _ in range(items)]

        at_bound = conn.request("gather", client=lease, tensors=request(INLINE_ITEMS, m, 1))
        assert not at_bound.get("building") and len(at_bound["tensors"]) == INLINE_ITEMS
        for items, entries, seed in ((INLINE_ITEMS + 1, 1, 2), (1, INLINE_ENTRIES + 1, 3)):
            assert conn.request("gather", client=lease, tensors=request(items, entries, seed))["building"]
        wait_until(lambda: not job_running(daemon), "the jobs end")
    finally:
        conn.close()
