"""Leases count per holder, never per process or connection, and readers never block a push: each test performs an
attack the review found (issue 37, findings 8 and 9) against a real daemon and asserts the harm is absent.

A holder is what the transport vouches for: a uid on ipc:// (SO_PEERCRED), a CURVE key on tcp://. Many processes
of one uid share its `max_leases_per_client`; another uid (made with setpriv) has its own; `max_leases` caps them
all, however many throwaway CURVE keys ask. A heartbeat, refresh or release acts only on the sender's own leases.
When `max_generations` are pinned, a push waits `revoke_after_s` and the oldest generation's leases are revoked
(their holders are told LeaseRevoked; the Python client leases the latest and moves on at its next refresh); what a
holder may still map of a revoked generation counts against its quota until released or its process is gone.
Figures print with `-s` (leases one uid can hold, the manifest's size under the flood).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import LeaseExpired, LeaseLimit, LeaseRevoked, MappedLimit
from expertd.protocol import PROTOCOL_VERSION
from expertd.security import Credentials
from expertd.server.serving.leases import lease_tag
from helpers.polling import wait_until
from helpers.curve import curve_daemon
from helpers.takers import MEMBER, NOBODY, TAKER, ask, finish, needs_root, spawn

pytestmark = pytest.mark.timeout(600)

NORM = "model.layers.2.post_attention_layernorm.weight"
# beats a lease id it was given (a victim's, leaked) until stdin closes; prints what each beat was answered
BEATER = """
import collections, sys, threading
from expertd.connection import Connection
from expertd.errors import DaemonError
conn, seen, done = Connection(sys.argv[1], timeout=30), collections.Counter(), threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.wait(0.05):
    for op in ("heartbeat", "refresh"):
        try:
            conn.request(op, client=sys.argv[2])
            seen[op + " renewed"] += 1
        except DaemonError as exc:
            seen[op + " " + exc.kind] += 1
conn.request("release", client=sys.argv[2])
print(dict(seen), flush=True)
"""


def manifest(daemon, folder) -> tuple[dict, int]:
    path = folder / "run" / f"{daemon.namespace}.manifest.json"
    text = path.read_text()
    return json.loads("{" + text.split(",", 1)[1]), len(text.encode())  # a sealed record: {"hmac":"...",REST


@needs_root
def test_twenty_processes_of_one_uid_share_its_cap_and_the_manifest_stays_small(tiny_checkpoint, start_daemon,
                                                                                 tmp_path):
    # a uid's cap of 64 (the default is larger: 1024), each process's share of it 16 (the default)
    daemon = start_daemon(tiny_checkpoint, group="root", lease_timeout_s=120, max_leases_per_client=64)
    mine = [spawn(TAKER, daemon.endpoint) for _ in range(20)]
    theirs = [spawn(TAKER, daemon.endpoint, prefix=MEMBER) for _ in range(5)]
    try:
        got_mine = [ask(p, 200) for p in mine]  # 4,000 lease requests from 20 processes of uid 0
        got_theirs = [ask(p, 200) for p in theirs]  # 1,000 from 5 processes of uid 65534, while uid 0's are held
        assert sum(n for n, _, _ in got_mine) == 64 and sum(n for n, _, _ in got_theirs) == 64
        assert {why for _, why, _ in got_mine + got_theirs} == {"LeaseLimit"}
        rows = daemon.status()["leases"]
        assert len(rows) == 128
        assert {row["pid"] for row in rows} <= {p.pid for p in mine + theirs}  # the kernel's pids, as named
        recorded, size = wait_until(lambda: (m := manifest(daemon, tmp_path)) and len(m[0]["leases"]) == 128 and m,
                                  "the manifest records the 128 leases")
        assert {item["owner"] for item in recorded["leases"]} == {"uid 0", f"uid {NOBODY}"}
        assert size < 48 * 1024
        # heartbeats change nothing the manifest records: it is not rewritten while 64 leases are beaten
        before = (tmp_path / "run" / f"{daemon.namespace}.manifest.json").stat().st_mtime_ns
        conn = Connection(daemon.endpoint, timeout=30)
        try:
            leases = [lease for _, _, ids in got_mine for lease in ids]
            began = time.monotonic()
            beats = 0
            while time.monotonic() - began < 1.5:  # three of the manifest's half-second rounds
                for lease in leases:
                    conn.request("heartbeat", client=lease)
                    beats += 1
        finally:
            conn.close()
        assert (tmp_path / "run" / f"{daemon.namespace}.manifest.json").stat().st_mtime_ns == before
        print(f"\nleases one uid can hold: {sum(n for n, _, _ in got_mine)} from 20 processes (4,000 asked); another "
              f"uid: {sum(n for n, _, _ in got_theirs)}; manifest with 128 leases: {size} bytes, not rewritten by "
              f"{beats} heartbeats")
    finally:
        finish(mine + theirs)
    wait_until(lambda: not daemon.status()["leases"], "the takers' leases end with their processes")


@needs_root
def test_heartbeats_from_another_uid_neither_renew_nor_reveal_a_lease(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, group="root", lease_timeout_s=2)
    victim = Connection(daemon.endpoint, timeout=30)
    try:
        lease = victim.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
        attacker = spawn(BEATER, daemon.endpoint, lease, prefix=MEMBER)  # it knows the id, as if leaked
        try:
            # the victim stays silent: its lease ends after lease_timeout_s however often the attacker beats it
            wait_until(lambda: lease_tag(lease) not in {r["client"] for r in daemon.status()["leases"]},
                     "the victim's lease expires under the attacker's heartbeats")
        finally:
            out, err = attacker.communicate("", timeout=60)  # stdin closes: it stops
        seen = json.loads(out.strip().replace("'", '"'))
        assert seen and set(seen) == {"heartbeat LeaseExpired", "refresh LeaseExpired"}, (seen, err)
        with pytest.raises(LeaseExpired):  # and it is gone for its holder too: nothing renewed it
            victim.request("heartbeat", client=lease)
    finally:
        victim.close()


def test_a_live_lease_is_answered_to_another_holder_as_unknown(tiny_checkpoint, start_daemon, tmp_path):
    """Over tcp:// with CURVE each key is a holder: another key's heartbeat, refresh and release of a live lease
    are answered as for an unknown id, and the lease lives on for its holder."""
    daemon, public = curve_daemon(start_daemon, tiny_checkpoint, tmp_path, lease_timeout_s=60)
    holder = Connection(daemon.endpoint, timeout=30, credentials=Credentials.resolve(server_key=public))
    other = Connection(daemon.endpoint, timeout=30, credentials=Credentials.resolve(server_key=public))
    try:
        lease = holder.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
        for op in ("heartbeat", "refresh", "index"):
            with pytest.raises(LeaseExpired) as refused:
                other.request(op, client=lease)
            assert "expired or released" in str(refused.value)
        other.request("release", client=lease)  # answered alike, and nothing released
        assert holder.request("heartbeat", client=lease)["generation"] == 1
    finally:
        holder.close()
        other.close()


def test_two_readers_pinning_old_generations_do_not_block_a_push(tiny_checkpoint, start_daemon, tmp_path):
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, max_generations=2, revoke_after_s=1, lease_timeout_s=3, stderr=log)
    first = ExpertClient(daemon.endpoint)  # heartbeats on: it learns of a revocation by itself
    raw = Connection(daemon.endpoint, timeout=30)
    trainer = ExpertClient(daemon.endpoint)
    try:
        pinned = first.lease
        base = first.tensors()[NORM].clone()
        assert trainer.update({NORM: base * 2}) == 2
        second = ExpertClient(daemon.endpoint)
        try:
            assert second.index().generation == 2
            trainer.refresh()
            # generations 1 (first, raw) and 2 (second, trainer) are pinned: the push waits revoke_after_s, then
            # generation 1's leases are revoked and it proceeds
            assert trainer.update({NORM: base * 3}) == 3
            with pytest.raises(LeaseRevoked):  # what its holder is told (until it releases it)
                raw.request("heartbeat", client=pinned)
            wait_until(lambda: first._lease_state.snapshot().revoked,
                       "the first reader's heartbeat learns of the revocation")
            assert first.lease != pinned  # it leased the latest by itself
            first.refresh()
            assert first.generation == 3 and first.verify() == []
            assert first._lease_state.snapshot().revoked == ()
            assert torch.equal(first.tensors()[NORM], base * 3)
            with pytest.raises(LeaseExpired):  # released by refresh()
                raw.request("heartbeat", client=pinned)
            trainer.refresh()
            assert trainer.update({NORM: base * 4}) == 4  # now generation 2 (second) is revoked alike
            wait_until(lambda: second._lease_state.snapshot().revoked, "the second reader learns of it")
            second.refresh()
            assert second.generation == 4 and second.verify() == []
        finally:
            second.close()
        assert [g["generation"] for g in daemon.status()["generations"]] == [4, 3]
    finally:
        for c in (first, trainer):
            c.close()
        raw.close()
    revoked = [line for line in log_path.read_text().splitlines() if "revoked" in line]
    assert any("on generation 1" in line and f"pid {os.getpid()}" in line for line in revoked), revoked


def test_revoked_generations_still_mapped_count_against_their_holder(tiny_checkpoint, start_daemon):
    """Design §5: revoking frees a name, not the pages. A holder whose leases were revoked, and that neither
    releases them nor exits, is refused new leases past its quota (MappedLimit); once that process is gone, the
    quota is free again."""
    daemon = start_daemon(tiny_checkpoint, max_generations=2, revoke_after_s=0, max_leases_per_client=4,
                          lease_timeout_s=60)
    taker = spawn(TAKER, daemon.endpoint)
    trainer = ExpertClient(daemon.endpoint, heartbeat=False)
    conn = Connection(daemon.endpoint, timeout=30)
    try:
        base = trainer.tensors()[NORM].clone()
        for k in range(2, 5):  # the taker leases each generation and ignores every revocation
            assert ask(taker, 1)[0] == 1
            assert trainer.update({NORM: base * k}) == k
            trainer.refresh()
        # uid 0: the trainer's lease, the taker's live one on generation 3 and two revoked it may still map
        with pytest.raises(MappedLimit, match="may still map"):
            conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)
        assert ask(taker, 1)[:2] == (0, "MappedLimit")
        finish([taker])  # its process is gone: what it could map went with it
        wait_until(lambda: len(daemon.status()["leases"]) == 1, "the taker's live lease ends with its process")
        lease = wait_until(lambda: _try_lease(conn), "the quota is free again")
        conn.request("release", client=lease)
    finally:
        finish([taker])
        trainer.close()
        conn.close()


def _try_lease(conn) -> str | None:
    try:
        return conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
    except LeaseLimit:
        return None


def test_throwaway_curve_keys_are_one_anonymous_reader(tiny_checkpoint, start_daemon, tmp_path):
    """Issue 49, finding 3: 20 throwaway keys from one process held 1,280 leases. Every key the config does not list
    is one reader, "anonymous": together they stop at one holder's cap, and a listed key (here the daemon's own,
    always admin) is not held back by them."""
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon, public = curve_daemon(start_daemon, tiny_checkpoint, tmp_path, stderr=log, max_leases_per_client=50,
                                      lease_timeout_s=60)
    conns = [Connection(daemon.endpoint, timeout=30, credentials=Credentials.resolve(server_key=public))
             for _ in range(20)]  # 20 throwaway keys: no curve_client_keys, so any key with ours connects
    listed = Connection(daemon.endpoint, timeout=30, credentials=Credentials.resolve(
        server_key=public, client_key=str(tmp_path / "keys" / "daemon.key_secret")))
    try:
        got, refused = [], []
        for conn in conns:
            for _ in range(64):
                try:
                    got.append(conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"])
                except LeaseLimit as exc:
                    refused.append(str(exc))
        assert len(got) == 50 and len(refused) == 20 * 64 - 50
        assert all("anonymous already holds 50 leases" in why for why in refused), refused[0]
        print(f"\n20 throwaway CURVE keys: {len(got)} leases (max_leases_per_client=50), {len(refused)} refused")
        mine = [listed.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"] for _ in range(10)]
        assert len(set(mine)) == 10  # a listed key counts on its own
        # derived tensors too: two throwaway keys' casts count against one reader, "anonymous"
        conns[0].request("release", client=got.pop())  # room for another throwaway key's lease
        got.append(conns[1].request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"])
        for conn, lease, dtype in ((conns[0], got[0], "torch.float32"), (conns[1], got[-1], "torch.float16")):
            conn.request("cast", client=lease, tensors=[{"name": NORM, "dtype": dtype}])
        readers = {row["reader"]: row["files"] for row in listed.request("status")["derived"]["readers"]}
        assert readers == {"anonymous": 2}, readers
        stranger = Connection(daemon.endpoint, timeout=30, credentials=Credentials.resolve(server_key=public))
        try:
            for lease in got:
                stranger.request("release", client=lease)  # a lease still belongs to its key: nothing released
            assert len(stranger.request("status")["leases"]) == 60
        finally:
            stranger.close()
    finally:
        for conn in (*conns, listed):
            conn.close()
    warned = [line for line in log_path.read_text().splitlines() if "without curve_client_keys" in line]
    assert len(warned) == 1 and "one reader, 'anonymous'" in warned[0], warned
