"""Pushing weights to an expert-parallel deployment: push_all over TCP gives each daemon its rows, publishes
nowhere when one refuses, and relies on held (two-phase) updates."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from expertd.server.load.loader import prepare
from helpers.ep import EXPERT, experts_of, free_port


TOKEN = "push-token-0123456789abcdef"


@pytest.fixture
def two_tcp_daemons(dsv3, tmp_path, namespace, monkeypatch):
    """Two daemons on tcp://127.0.0.1 with an auth token, serving EP ranks [0] and [1] of 2 (no CURVE: the test's
    clients are told to send the token in clear)."""
    from helpers.daemon import DaemonProcess

    monkeypatch.setenv("EXPERTD_ALLOW_PLAIN_TCP_TOKENS", "1")

    folder, _ = dsv3
    started = []
    try:
        for rank in (0, 1):
            started.append(DaemonProcess.launch(tmp_path / f"host{rank}", folder, f"{namespace}h{rank}",
                                                endpoint=f"tcp://127.0.0.1:{free_port()}", auth_token=TOKEN,
                                                expert_parallel={"size": 2, "ranks": [rank]}))
        for d in started:
            d.wait_serving()
        yield started
    finally:
        for d in started:
            d.stop()


def served(d) -> dict[str, torch.Tensor]:
    from expertd.client import ExpertClient

    with ExpertClient(d.endpoint, token=TOKEN) as client:
        return {k: v.clone() for k, v in client.served_tensors().items()}


def test_push_all_over_tcp_gives_each_daemon_its_share(two_tcp_daemons, dsv3):
    """One call pushes a state dict to both hosts over tcp (bytes in ZeroMQ frames): dense tensors reach both,
    a whole fused expert block is cut into each daemon's rows, FP8 expert weights go with their scales to
    the daemon that serves them; both publish generation 2."""
    from expertd.client import push_all

    folder, _ = dsv3
    a, b = two_tcp_daemons
    before = [served(d) for d in (a, b)]
    total = experts_of(folder)
    fused = f"{EXPERT}down_proj"
    block = torch.randn(total, *before[0][fused].shape[1:]).to(torch.bfloat16)
    norm = torch.randn(before[0]["model.norm.weight"].shape).to(torch.bfloat16)
    done = push_all([a.endpoint, b.endpoint], {fused: block, "model.norm.weight": norm}, token=TOKEN)
    assert done == {a.endpoint: 2, b.endpoint: 2}
    after = [served(d) for d in (a, b)]
    half = total // 2
    assert torch.equal(after[0][fused], block[:half]) and torch.equal(after[1][fused], block[half:])
    assert all(torch.equal(s["model.norm.weight"], norm) for s in after)
    unchanged = [n for n in before[0] if n not in (fused, "model.norm.weight")]
    assert all(torch.equal(after[0][n], before[0][n]) for n in unchanged)
    for d in (a, b):
        status = d.status()
        assert status["generation"] == 2 and status["job"]["kind"] == "update"


def test_push_all_publishes_nowhere_when_one_daemon_refuses(two_tcp_daemons, dsv3):
    from expertd.client import push_all
    from expertd.errors import AuthError, DaemonError, UpdateRejected

    folder, _ = dsv3
    a, b = two_tcp_daemons
    total = experts_of(folder)
    norm = served(a)["model.norm.weight"]
    # a tensor nobody serves: refused before anything is staged
    nobody = f"{EXPERT}{total + 3}.down_proj.weight"
    with pytest.raises(UpdateRejected, match=f"served by none of .*{nobody}"):
        push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm, nobody: torch.zeros(2, 2)}, token=TOKEN)
    # the second daemon refuses its share (a wrong shape for an expert only it serves) after the first staged
    theirs = f"{EXPERT}{total - 1}.down_proj.weight"
    with pytest.raises(UpdateRejected, match="does not match the served"):
        push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm, theirs: torch.zeros(3, 3, dtype=torch.bfloat16)},
                 token=TOKEN)
    # a daemon that is not running
    from expertd.errors import DaemonNotRunning

    with pytest.raises(DaemonNotRunning):
        push_all([a.endpoint, "ipc:///tmp/expertd-no-such-daemon/expertd.sock"], {"model.norm.weight": norm},
                 token=TOKEN)
    # a wrong token
    with pytest.raises(DaemonError) as err:
        push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm}, token="wrong-token-0123456789")
    assert err.value.kind == AuthError.__name__
    for d in (a, b):
        assert d.status()["generation"] == 1
    # nothing held or staged was left behind: the next push goes through at once
    assert push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm * 2}, token=TOKEN) == \
        {a.endpoint: 2, b.endpoint: 2}


def test_update_on_a_partitioned_daemon_names_every_tensor_it_does_not_serve(dsv3, start_daemon):
    from expertd.client import ExpertClient
    from expertd.errors import UpdateRejected

    folder, _ = dsv3
    d = start_daemon(folder, expert_parallel={"size": 2, "ranks": [0]})
    total = experts_of(folder)
    theirs = [f"{EXPERT}{e}.down_proj.weight" for e in (total - 2, total - 1)]
    with ExpertClient(d.endpoint) as client:
        mine = client.tensors()[f"{EXPERT}0.down_proj.weight"]
        with pytest.raises(UpdateRejected) as err:
            client.update({name: mine.clone() for name in theirs})
    message = str(err.value)
    assert all(repr(name) in message for name in theirs) and "EP ranks [0] of 2" in message
    assert d.status()["generation"] == 1


def test_a_partitioned_gpt_oss_daemon_serves_its_rows_and_takes_its_rows_of_a_push(gpt_oss, start_daemon):
    """A daemon serving EP rank 1 of 2 of gpt-oss: its expert stacks are the second half of each whole stack,
    bit for bit; push_all of whole MXFP4 blocks and scales (all experts) gives it its rows only."""
    from safetensors import safe_open

    from expertd.client import ExpertClient, push_all
    from expertd.server.load.filling import dequantized

    folder, _ = gpt_oss
    total = experts_of(folder)
    half = total // 2
    whole_ckpt, whole = prepare(folder)
    stacks = {t.name: torch.cat([dequantized(whole_ckpt, s) for s in t.sources]) for t in whole.tensors
              if ".mlp.experts." in t.name}
    whole_ckpt.close()
    d = start_daemon(folder, expert_parallel={"size": 2, "ranks": [1]})
    with ExpertClient(d.endpoint) as client:
        served = client.served_tensors()
        entries = {e.name: e for e in client.index().tensors}
        for name, rows in stacks.items():
            assert entries[name].experts.to_dict() == {"total": total, "ranges": [[half, half]]}
            assert torch.equal(served[name], rows[half:]), name
        assert client.verify() == []
    name = "model.layers.0.mlp.experts.down_proj"
    shard = next(f for f in glob.glob(os.path.join(folder, "*.safetensors"))
                 if name + "_blocks" in safe_open(f, framework="pt").keys())
    with safe_open(shard, framework="pt") as f:
        blocks, scales = f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales")
    pushed = torch.flip(blocks, dims=[0]).contiguous()  # expert e gets expert E-1-e's codes
    flipped_scales = torch.flip(scales, dims=[0]).contiguous()
    assert push_all([d.endpoint], {name + "_blocks": pushed, name + "_scales": flipped_scales}) == {d.endpoint: 2}
    with ExpertClient(d.endpoint) as client:
        assert client.index().generation == 2
        assert torch.equal(client.served_tensors()[name], torch.flip(stacks[name], dims=[0])[half:])

def test_a_held_update_publishes_only_on_publish_and_goes_on_abort_or_when_its_lease_ends(dsv3, start_daemon):
    """The two-phase commit push_all relies on: built with `hold`, nothing is published until `publish`;
    `abort` (or the updater's lease ending) drops the built generation and the daemon takes the next update."""
    import time

    from expertd.client import ExpertClient
    from expertd import messages
    from expertd.client.push import _stage, _wait
    from expertd.connection import Connection
    from expertd.protocol import PROTOCOL_VERSION

    folder, _ = dsv3
    d = start_daemon(folder)
    with ExpertClient(d.endpoint) as client:
        norm = client.tensors()["model.norm.weight"].clone()
    conn = Connection(d.endpoint, 10)
    try:
        lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]

        def held(value, latest):
            staging, sums = _stage(conn, lease, {"model.norm.weight": torch.full_like(norm, value)})
            job = conn.send(messages.Commit(client=lease, update=staging.update, checksums=sums, hold=True),
                            messages.JobReply)
            job = _wait(conn, job, 30, until=("building",))
            assert job.state == "built" and job.hold
            time.sleep(0.3)  # a few turns of the loop: a held build is not published
            assert d.status()["generation"] == latest
            return staging, job

        staging, job = held(2.0, latest=1)
        assert conn.request("abort", client=lease, update=staging.update)["ok"]
        assert conn.request("job", job=job.job)["error"] == "Aborted" and d.status()["generation"] == 1
        staging, job = held(3.0, latest=1)
        conn.request("publish", client=lease, job=job.job)
        assert _wait(conn, job, 30).state == "published" and d.status()["generation"] == 2
        staging, job = held(4.0, latest=2)
        conn.request("release", client=lease)  # the updater goes away: its held build goes with its lease
        deadline = time.monotonic() + 10
        while conn.request("job", job=job.job)["state"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert conn.request("job", job=job.job)["error"] == "Aborted" and d.status()["generation"] == 2
    finally:
        conn.close()
    with ExpertClient(d.endpoint) as client:
        assert torch.equal(client.tensors()["model.norm.weight"], torch.full_like(norm, 3.0))
        assert client.update({"model.norm.weight": norm}) == 3  # nothing held or staged is in the way
