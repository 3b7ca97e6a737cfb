"""Derived tensors are held by readers, not by generations (issue 49, finding 1): each test performs the attack the red
team reproduced against a real daemon, with the hoarder another uid (setpriv), and asserts the harm is absent.

The attack: uid A casts every served tensor into every float dtype. With the per-reader cap defaulting to the
daemon's, A held all of it: B's 32-byte cast was refused, and after A exited B's `load_model(dtype=torch.float16)`
still failed (derived tensors lived as long as their generation). Now a reader's share is a quarter of the daemon's
cap by default, a derived tensor counts against the readers whose live leases hold it, and the ones nobody holds are
reclaimed first when the daemon's cap is reached.
"""

from __future__ import annotations

import os

import pytest
import torch

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import DerivedLimit
from expertd.protocol import PROTOCOL_VERSION
from helpers.polling import wait_until
from helpers.takers import MEMBER, NOBODY, finish, needs_root, spawn

pytestmark = [pytest.mark.timeout(600), needs_root]

NORM = "model.norm.weight"

# casts each tensor named in argv[2:] into every float dtype, one request each, skipping those refused; prints the
# last refusal's words; holds its lease until stdin closes
HOARDER = """
import os, sys, time
from expertd import procfs
from expertd.connection import Connection
from expertd.errors import DerivedLimit
from expertd.protocol import PROTOCOL_VERSION
conn = Connection(sys.argv[1], timeout=60)
lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION, pid_ns=procfs.pid_namespace(),
                     start_time=procfs.process_start_time(os.getpid()))["client"]
why = "never refused"
for dtype in ("torch.float64", "torch.float32", "torch.float16"):
    for name in sys.argv[2:]:
        try:
            while conn.request("cast", client=lease, tensors=[{"name": name, "dtype": dtype}]).get("building"):
                time.sleep(0.01)
        except DerivedLimit as exc:
            why = str(exc)
print(why.replace(chr(10), " "), flush=True)
sys.stdin.read()
"""


def float_names(client: ExpertClient) -> list[str]:
    """What the hoarder casts: every float tensor but the one its neighbour casts (which it would find made)."""
    return [n for n, t in client.served_tensors().items() if t.is_floating_point() and n != NORM]


def readers(daemon) -> dict[str, int]:
    return {row["reader"]: row["bytes"] for row in daemon.status()["derived"]["readers"]}


def hoard(daemon, names: list[str]):
    hoarder = spawn(HOARDER, daemon.endpoint, *names, prefix=MEMBER)
    why = hoarder.stdout.readline().strip()
    assert why, hoarder.stderr.read()
    return hoarder, why


def cast_once(daemon, name: str, dtype: str = "torch.float32") -> dict:
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
        try:
            return conn.request("cast", client=lease, tensors=[{"name": name, "dtype": dtype}])
        finally:
            conn.request("release", client=lease)
    finally:
        conn.close()


def test_a_hoarder_takes_its_share_and_a_neighbour_still_loads_in_float16(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, group="root")
    with ExpertClient(daemon.endpoint) as neighbour:
        names = float_names(neighbour)
        hoarder, why = hoard(daemon, names)
        try:
            limits = daemon.status()["derived"]
            assert "max_derived_bytes_per_reader" in why and f"uid {NOBODY}" in why, why
            held = readers(daemon)[f"uid {NOBODY}"]
            assert 0 < held <= limits["max_bytes_per_reader"] == limits["max_bytes"] // 4
            print(f"\nthe hoarder holds {held} of {limits['max_bytes']} derived bytes (its share: "
                  f"{limits['max_bytes_per_reader']})")
            assert cast_once(daemon, NORM)["tensors"][0]["dtype"] == "torch.float32"  # a small cast: made
            model = neighbour.load_model(dtype=torch.float16)  # and a whole model cast, while the hoarder holds
            assert next(model.parameters()).dtype == torch.float16
            assert readers(daemon)[f"uid {NOBODY}"] == held
        finally:
            finish([hoarder])
        # its lease ended with its process: what it held counts against no reader now (the neighbour's stays)
        wait_until(lambda: f"uid {NOBODY}" not in readers(daemon), "the hoarder's share is freed when it exits")
        assert daemon.status()["derived"]["unheld_files"] > 0


def test_what_an_exited_hoarder_held_is_reclaimed_for_a_neighbour(tiny_checkpoint, start_daemon, tmp_path):
    """The old configuration (per-reader = daemon-wide, which the daemon now warns of under `group:`): the hoarder
    takes everything and a neighbour's cast is refused while it holds it; once the hoarder exits, the neighbour's
    `load_model(dtype=torch.float16)` is made, reclaiming what nobody holds."""
    log_path = tmp_path / "daemon.log"
    cap = 24 << 20
    with open(log_path, "w") as log:
        daemon = start_daemon(tiny_checkpoint, group="root", max_derived_bytes=cap, max_derived_bytes_per_reader=cap,
                              stderr=log)
    with ExpertClient(daemon.endpoint) as neighbour:
        names = float_names(neighbour)
        hoarder, why = hoard(daemon, names)
        try:
            assert "max_derived_bytes" in why, why  # its own cap or the daemon's: the same number here
            assert readers(daemon)[f"uid {NOBODY}"] > cap - (1 << 20)
            with pytest.raises(DerivedLimit, match="max_derived_bytes="):
                cast_once(daemon, NORM)  # held by a live lease: nothing to reclaim
        finally:
            finish([hoarder])
        wait_until(lambda: f"uid {NOBODY}" not in readers(daemon), "the hoarder's share is freed when it exits")
        model = neighbour.load_model(dtype=torch.float16)
        assert next(model.parameters()).dtype == torch.float16
        status = daemon.status()["derived"]
        assert status["bytes"] <= cap and set(readers(daemon)) == {"uid 0"}
    lines = log_path.read_text().splitlines()
    assert any("lets one reader take every derived byte" in line and "group mode" in line for line in lines)
    assert any("reclaimed" in line and "no lease holds" in line for line in lines), lines[-20:]
