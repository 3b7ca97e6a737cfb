"""Revocation is fair (issue 49, finding 2): a reader that pins old generations cannot make a push revoke a
neighbour's lease. The attack: uid 0 keeps leases on the two newest old generations while uid 65534 (setpriv) reads
the oldest; at `max_generations`, the old rule revoked the oldest generation's leases — the neighbour's. Now the
generations of a holder pinning more than `max_old_generations_per_holder` (1) old ones are revoked first, and a lease
that would make a holder pin one more old generation is refused."""

from __future__ import annotations

import os

import pytest

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import LeaseLimit, LeaseRevoked
from expertd.protocol import PROTOCOL_VERSION
from expertd.server.serving.leases import lease_tag
from helpers.takers import MEMBER, TAKER, ask, finish, needs_root, spawn

pytestmark = pytest.mark.timeout(600)

NORM = "model.layers.2.post_attention_layernorm.weight"


def _leases(daemon) -> dict[str, int]:
    return {row["client"]: row["generation"] for row in daemon.status()["leases"]}


@needs_root
def test_a_reader_pinning_two_old_generations_is_revoked_before_its_neighbour(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, group="root", max_generations=4, revoke_after_s=0, lease_timeout_s=300)
    neighbour = spawn(TAKER, daemon.endpoint, prefix=MEMBER)  # uid 65534, reading generation 1
    attacker = Connection(daemon.endpoint, timeout=30)  # uid 0
    trainer = ExpertClient(daemon.endpoint, heartbeat=False)  # uid 0 too: the attacker's own pushes
    me = {"pid": os.getpid(), "protocol": PROTOCOL_VERSION}
    try:
        count, why, ids = ask(neighbour, 1)
        assert count == 1, why
        theirs = lease_tag(ids[0])
        base = trainer.tensors()[NORM].clone()
        pins = {}
        for k in (2, 3, 4):
            assert trainer.update({NORM: base * k}) == k
            trainer.refresh()
            if k < 4:  # the attacker leases generations 2 and 3 while each is the latest, and never refreshes
                pins[k] = attacker.request("lease", **me)["client"]
        assert sorted(set(_leases(daemon).values())) == [1, 2, 3, 4]
        # a third old pin is refused outright: uid 0 already pins two generations older than the latest
        with pytest.raises(LeaseLimit, match="max_old_generations_per_holder=1"):
            attacker.request("lease", generation=1, **me)
        again = attacker.request("lease", generation=3, **me)["client"]  # one it pins already: allowed (a resume)
        attacker.request("release", client=again)
        # the next push needs room: generation 2 (uid 0 pins 2 and 3) goes, not generation 1 (the neighbour's only)
        assert trainer.update({NORM: base * 5}) == 5
        with pytest.raises(LeaseRevoked):
            attacker.request("heartbeat", client=pins[2])
        assert attacker.request("heartbeat", client=pins[3])["generation"] == 3
        assert _leases(daemon)[theirs] == 1
        live = [g["generation"] for g in daemon.status()["generations"]]
        assert live == [5, 4, 3, 1], live  # 4: the trainer's own lease, until it refreshes
    finally:
        finish([neighbour])
        trainer.close()
        attacker.close()
