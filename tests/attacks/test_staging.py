"""A staged update only its pusher can write, sealed before it is checked: each test performs one attack the review
found.

The staging segment is 0600 whatever the group; an updater of another uid on this host is let write it by an ACL
entry naming its uid alone (SO_PEERCRED says who it is), so a group member can neither open it for writing nor read
it. At commit the daemon closes the segment (0600, which masks that entry too) and copies the staged bytes into its
private memory; the checksums are checked on that copy and the new generation is built from it alone: bytes the
updater's own mapping changes after the check are never published. Every open of a staging file refuses a symlink
(O_NOFOLLOW): the daemon writes pushed bytes nowhere else. A group member (uid 65534 in a group made for the test)
that tries to map the staging segment of another uid's push is refused, and that push is published.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from expertd import messages
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.client import push as push_mod
from expertd.errors import DaemonError, ShmError
from expertd.index import tensor_checksum
from expertd.server.push import updates
from expertd.server.push.updates import ACL_XATTR, Push, Staging, writer_acl
from expertd.segments import map_segment
from expertd.shm import segment_bytes
from test_group_mode import NOBODY, daemon_group  # noqa: F401  (a group made for the test, deleted after)

pytestmark = pytest.mark.timeout(300)

NORM = "model.layers.2.post_attention_layernorm.weight"
PUSH = "staging-push-token-0123456789"


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the staging segment to group root: needs root")
def test_staged_bytes_changed_after_the_check_are_not_what_is_built(namespace):
    pushes = [Push("w", [300], "torch.float32", None, None, 1), Push("b", [7], "torch.bfloat16", None, None, 1)]
    staging = Staging(namespace, 1, pushes, "lease", group="root", writer=NOBODY)  # an updater of another uid
    try:
        path = f"/dev/shm/{staging.segment.name.lstrip('/')}"
        assert staging.writer == NOBODY and os.getxattr(path, ACL_XATTR) == writer_acl(NOBODY)  # its uid alone
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
            with contextlib.suppress(FileNotFoundError):  # the daemon drops the failed update's staging as well
                os.unlink(path)
            conn.close()
    assert victim.read_bytes() == b"precious" * 1024
    assert daemon.status()["generation"] == 1


def test_a_folder_without_acls_keeps_staging_private(namespace, monkeypatch):
    """Where the shm folder takes no ACL (hugetlbfs), the segment stays the daemon's alone (0600): the updater of
    another uid cannot open it and sends its bytes as frames instead."""
    def no_acl(*args):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(updates.os, "setxattr", no_acl)
    staging = Staging(namespace, 1, [Push("w", [30], "torch.float32", None, None, 1)], "lease", group="root",
                      writer=NOBODY)
    try:
        assert staging.writer is None
        assert stat.S_IMODE(os.stat(f"/dev/shm/{staging.segment.name[1:]}").st_mode) == 0o600
    finally:
        staging.close()


def test_a_pusher_that_cannot_open_its_staging_segment_sends_frames(tiny_checkpoint, start_daemon, monkeypatch):
    daemon = start_daemon(tiny_checkpoint)

    def refused(name, *args, **kwargs):
        raise ShmError(f"no permission to open shared-memory segment {name}") from PermissionError(13, "denied")

    monkeypatch.setattr(push_mod, "map_segment", refused)
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        value = client.tensors()[NORM] * 3
        assert client.update({NORM: value}) == 2
        client.refresh()
        assert torch.equal(client.tensors()[NORM], value)


PUSHER = r"""
import sys, time, torch
from expertd import messages
from expertd.connection import Connection
from expertd.index import tensor_checksum
from expertd.leasing import lease_request
from expertd.security import Credentials
from expertd.segments import map_segment
from expertd.shm import segment_bytes
endpoint, token, name, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
conn = Connection(endpoint, timeout=60, credentials=Credentials.resolve(push_token=token))
lease = lease_request(conn).client
value = torch.full((count,), 0.25, dtype=torch.bfloat16)
spec = [messages.PushedTensor(name=name, shape=[count], dtype="torch.bfloat16")]
staging = conn.send(messages.Update(client=lease, tensors=spec), messages.UpdateReply)
mapping = map_segment(staging.segment, staging.nbytes, shared_write=True, shm_dir=staging.shm_dir)
slot = staging.tensors[0]
segment_bytes(mapping)[slot.offset: slot.offset + slot.nbytes] = value.view(torch.uint8)
mapping.close()
print(staging.segment, flush=True)
sys.stdin.readline()
job = conn.send(messages.Commit(client=lease, update=staging.update, checksums=[tensor_checksum(value)]),
                messages.JobReply)
while job.state in ("building", "built"):
    time.sleep(0.02)
    job = conn.send(messages.Job(job=job.job), messages.JobReply)
conn.send(messages.Release(client=lease))
print(job.state, job.generation, flush=True)
"""
# a group member's program (the system python, stdlib only): how opening the file for writing and for reading ends
OPENER = r"""
import errno, os, sys
for flags in (os.O_RDWR, os.O_WRONLY, os.O_RDONLY):
    try:
        os.close(os.open(sys.argv[1], flags))
        print("opened")
    except OSError as exc:
        print(errno.errorcode[exc.errno])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a pusher and a group member as other uids: needs root (setpriv)")
def test_only_the_pusher_can_write_its_staging_segment(tiny_checkpoint, start_daemon, daemon_group):  # noqa: F811
    group, gid = daemon_group
    daemon = start_daemon(tiny_checkpoint, group=group, push_token=PUSH)
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        count = client.tensors()[NORM].numel()
        assert client.tensors()[NORM].dtype == torch.bfloat16
    pusher_uid = NOBODY - 1  # another uid in the daemon's group; it reads this python and the tree with
    pusher = ["setpriv", "--reuid", str(pusher_uid), "--regid", str(gid), "--groups", str(gid),  # dac_read_search
              "--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search", "--"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(pusher + [sys.executable, "-c", PUSHER, daemon.endpoint, PUSH, NORM, str(count)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        segment = proc.stdout.readline().strip()  # it wrote its bytes through a mapping of its own
        assert segment.startswith("/"), proc.communicate(timeout=60)
        path = f"/dev/shm/{segment[1:]}"
        member = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--groups", str(gid),
                                 "--", "/usr/bin/python3", "-c", OPENER, path], capture_output=True, text=True,
                                timeout=60)
        assert member.stdout.split() == ["EACCES", "EACCES", "EACCES"], member.stdout + member.stderr
        out, err = proc.communicate("commit\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.split() == ["published", "2"], out + err
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        assert torch.equal(client.tensors()[NORM], torch.full((count,), 0.25, dtype=torch.bfloat16))
        assert client.verify() == []
