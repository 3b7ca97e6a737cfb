"""A lease belongs to whoever took it: each test performs one attack the least-privilege review found.

A lease id is 128 random bits and a bearer secret: knowing it is holding it, so no reply shows it to anyone but
its holder (status shows 8 hex digits of its SHA-256). A holder (one uid on ipc://, as the kernel names it; one
CURVE key on tcp://) holds at most `max_leases_per_client` leases, and one of its processes (on ipc://, where the
kernel names it) at most `max_leases_per_process`: beyond them `LeaseLimit`, for that process only; the manifest that
records leases, rewritten at most twice a second, stays small (tests/attacks/test_lease_holders.py: many processes,
other uids, heartbeats for another's lease, readers pinning old generations, throwaway CURVE keys). Expired leases
make one log line per sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import LeaseExpired, LeaseLimit
from expertd.protocol import PROTOCOL_VERSION
from expertd.server.serving.leases import lease_tag

from helpers.polling import wait_until

pytestmark = pytest.mark.timeout(300)

NORM = "model.layers.2.post_attention_layernorm.weight"


def test_a_reader_cannot_release_refresh_or_beat_for_anothers_lease(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, lease_timeout_s=60)
    with ExpertClient(daemon.endpoint, heartbeat=False) as victim:
        lease = victim.lease
        assert victim.index().generation == 1
        assert len(lease) >= 32 and int(lease, 16) >= 0  # 128 bits of hex at least: not guessable
        with ExpertClient(daemon.endpoint) as updater:  # a newer generation: the victim's is pinned by its lease only
            updater.update({NORM: updater.tensors()[NORM] * 2})
        reader = Connection(daemon.endpoint, timeout=10)
        try:
            status = reader.request("status")
            assert lease not in json.dumps(status)  # the id is shown to nobody (the CLI prints this reply)
            assert lease_tag(lease) in [row["client"] for row in status["leases"]]
            shown = {row["client"] for row in status["leases"]}
            shown |= {row["client"] for gen in status["generations"] for row in gen["leases"]}
            guesses = shown | {f"c{n}" for n in range(1, 9)} | {"handover-g1", "handover-g2", lease[:8], lease[:16]}
            for guess in sorted(guesses):
                reader.request("release", client=guess)  # answered alike whether a lease exists or not
                for op in ("refresh", "heartbeat"):
                    with pytest.raises(LeaseExpired):
                        reader.request(op, client=guess)
            after = reader.request("status")
        finally:
            reader.close()
        assert [g["generation"] for g in after["generations"]] == [2, 1]  # the victim's generation is still served
        assert victim.verify() == []  # and its lease still works
        victim.refresh()
        assert victim.generation == 2


def test_one_process_taking_20000_leases_stops_at_its_share_and_locks_out_no_other(tiny_checkpoint, start_daemon,
                                                                                    tmp_path):
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, lease_timeout_s=60, stderr=log)
    conn = Connection(daemon.endpoint, timeout=10)
    granted, refused = [], 0
    try:
        for _ in range(20_000):
            try:
                granted.append(conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"])
            except LeaseLimit as exc:
                refused += 1
                assert "max_leases_per_process" in str(exc)
        assert len(granted) == 16 and refused == 20_000 - 16  # the default max_leases_per_process
        manifest = tmp_path / "run" / f"{daemon.namespace}.manifest.json"

        def recorded() -> list:  # a sealed record: {"hmac":"...",REST (replaced whole: never read half-written)
            return json.loads("{" + manifest.read_text().split(",", 1)[1])["leases"]

        # the manifest records leases twice a second at most: polled until it has caught up
        wait_until(lambda: len(recorded()) >= 16, "the manifest records the 16 leases", timeout=30)
        assert len(recorded()) == 16 and manifest.stat().st_size < 64 * 1024
        # another process of the same uid is not held back by this one (the red team's lock-out of a whole uid)
        other = subprocess.run([sys.executable, "-c", (
            "import sys; from expertd.client import ExpertClient\n"
            f"with ExpertClient({daemon.endpoint!r}, heartbeat=False) as c: print(len(c.lease))")],
            capture_output=True, text=True, timeout=120)
        assert other.returncode == 0 and other.stdout.strip() == "32", other.stderr
        for lease in granted:
            conn.request("release", client=lease)
        assert daemon.status()["leases"] == []
    finally:
        conn.close()
    lines = log_path.read_text().splitlines()
    assert len(lines) < 40, lines[-20:]  # no line per lease, granted or refused


def test_expired_leases_make_one_log_line_per_sweep(tiny_checkpoint, start_daemon, tmp_path):
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, lease_timeout_s=1, stderr=log, max_leases_per_process=64)
    conn = Connection(daemon.endpoint, timeout=10)
    try:
        for _ in range(50):  # from one process: its share raised for them
            conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)
    finally:
        conn.close()
    wait_until(lambda: daemon.status()["leases"] == [], "the 50 silent leases end", timeout=30, every=0.1)
    lines = log_path.read_text().splitlines()
    ended = [line for line in lines if "lease(s) ended" in line]
    # 50 leases, silent alike: one sweep ends them (two if they straddle one); no line per lease
    assert 1 <= len(ended) <= 3 and len(lines) < 20, lines
    assert sum(int(line.split(" lease(s) ended")[0].rsplit(" ", 1)[-1]) for line in ended) == 50, ended
