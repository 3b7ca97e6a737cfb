"""A staged update is sealed before it is checked: each test performs one attack the review found.

In group mode the staging segment is 0660 (the updater, another uid in the group, writes it through a mapping of
its own), so a group member can change the staged bytes at any time. At commit the daemon closes the segment to
the group (0600) and copies the staged bytes into its private memory; the checksums are checked on that copy and
the new generation is built from it alone: bytes changed in the segment after the check are never published.
Every open of a staging file refuses a symlink (O_NOFOLLOW): the daemon writes pushed bytes nowhere else. A group member (uid 65534 in a group made for
the test) scribbling over a committed update through its own writable mapping gets it refused (the copy fails the
checksum) or changes nothing published.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time

import pytest
import torch

from expertd import messages
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.index import tensor_checksum
from expertd.security import Credentials
from expertd.server.updates import Push, Staging
from expertd.segments import map_segment
from expertd.shm import segment_bytes
from test_group_mode import NOBODY, daemon_group  # noqa: F401  (a group made for the test, deleted after)

pytestmark = pytest.mark.timeout(300)

NORM = "model.layers.2.post_attention_layernorm.weight"
PUSH = "staging-push-token-0123456789"
# a group member's program (the system python, stdlib only): map the staging segment writable, say so, then write
# 0xFF over it until told to stop, and say how often it did
SCRIBBLER = r"""
import mmap, os, select, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size)
print("mapped", flush=True)
n = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    m[:] = b"\xff" * len(m)
    n += 1
print(n)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the staging segment to group root: needs root")
def test_staged_bytes_changed_after_the_check_are_not_what_is_built(namespace):
    pushes = [Push("w", [300], "torch.float32", None, None, 1), Push("b", [7], "torch.bfloat16", None, None, 1)]
    staging = Staging(namespace, 1, pushes, "lease", group="root")  # group mode: the updater's group may write
    try:
        path = f"/dev/shm/{staging.segment.name.lstrip('/')}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        mine = {"w": torch.arange(300, dtype=torch.float32), "b": torch.full((7,), 2.5, dtype=torch.bfloat16)}
        mapping = map_segment(staging.segment.name, staging.segment.nbytes, shared_write=True)  # the updater's
        shared = segment_bytes(mapping)
        for t in staging.tensors:
            shared[t.offset: t.offset + t.nbytes] = mine[t.name].view(-1).view(torch.uint8)
        staged = staging.verify([tensor_checksum(mine[t.name]) for t in staging.tensors])  # commit: the check passes
        shared.fill_(0xFF)  # a group member's mapping, after the check: the build must not see this
        assert all(torch.equal(staged[n], mine[n]) for n in mine)  # what is built from is what was checked
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # and nobody but the daemon may open it any more
        del shared
        mapping.close()
    finally:
        staging.close()


def test_a_symlink_planted_for_a_staging_file_is_not_followed(tiny_checkpoint, start_daemon, namespace, tmp_path):
    daemon = start_daemon(tiny_checkpoint)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1024)
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        value = client.tensors()[NORM] * 2
        conn = Connection(daemon.endpoint, timeout=30)
        try:
            spec = [messages.PushedTensor(name=NORM, shape=list(value.shape), dtype=str(value.dtype))]
            staging = conn.send(messages.Update(client=client.lease, tensors=spec), messages.UpdateReply)
            path = f"/dev/shm/{staging.segment.lstrip('/')}"
            os.unlink(path)  # whoever may write the shm folder's entry (here its owner) plants a link in its place
            os.symlink(victim, path)
            raw = memoryview(value.contiguous().view(-1).view(torch.uint8).numpy())
            with pytest.raises(DaemonError):
                conn.send(messages.Stage(client=client.lease, update=staging.update, tensor=0, at=0),
                          messages.StageReply, frames=[raw])
            job = conn.send(messages.Commit(client=client.lease, update=staging.update,
                                            checksums=[tensor_checksum(value)]), messages.JobReply)
            while job.state == "building":  # nor is the link read at commit: the build fails
                time.sleep(0.05)
                job = conn.send(messages.Job(job=job.job), messages.JobReply)
            assert job.state == "failed", job
        finally:
            if os.path.islink(path):
                os.unlink(path)
            conn.close()
    assert victim.read_bytes() == b"precious" * 1024
    assert daemon.status()["generation"] == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a group member as another uid: needs root (setpriv, groupadd)")
def test_a_group_member_scribbling_on_a_committed_update_changes_nothing_published(tiny_checkpoint, start_daemon,
                                                                                    daemon_group):  # noqa: F811
    group, gid = daemon_group
    daemon = start_daemon(tiny_checkpoint, group=group, push_token=PUSH)
    conn = Connection(daemon.endpoint, timeout=30, credentials=Credentials.resolve(push_token=PUSH))
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        value = client.tensors()[NORM] * 2
        spec = [messages.PushedTensor(name=NORM, shape=list(value.shape), dtype=str(value.dtype))]
        staging = conn.send(messages.Update(client=client.lease, tensors=spec), messages.UpdateReply)
        path = f"/dev/shm/{staging.segment.lstrip('/')}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # the updater's group may write it, until commit
        mapping = map_segment(staging.segment, staging.nbytes, shared_write=True)  # the updater writes its bytes
        segment_bytes(mapping)[staging.tensors[0].offset:][:staging.tensors[0].nbytes] = \
            value.contiguous().view(-1).view(torch.uint8)
        mapping.close()
        member = subprocess.Popen(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--groups", str(gid),
                                   "--", "/usr/bin/python3", "-c", SCRIBBLER, path],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert member.stdout.readline().strip() == "mapped"  # its writable mapping outlives any chmod
            job = conn.send(messages.Commit(client=client.lease, update=staging.update,
                                            checksums=[tensor_checksum(value)]), messages.JobReply)
            while job.state in ("building", "built"):  # built: published between two requests
                time.sleep(0.02)
                job = conn.send(messages.Job(job=job.job), messages.JobReply)
        finally:
            out, _ = member.communicate("stop\n", timeout=60)
        assert int(out) > 0, out  # it wrote all along the commit and the build
        if job.state == "published":  # harmless: what is served is what the updater checksummed
            client.refresh()
            assert torch.equal(client.tensors()[NORM], value) and client.verify() == []
        else:  # or refused: the copy the daemon took did not match the updater's checksum
            assert job.state == "failed" and "checksum" in (job.message or ""), job
            assert daemon.status()["generation"] == 1
    conn.close()
