"""The push ops: update → stage → commit → publish (or abort), a component of the weight service.

A trainer's push is checked against the latest generation, written into a staging segment (in place on
this host, as frames from another), verified and built into the next generation by a job; with `hold`
the built generation waits until every daemon of the push has built its share. What it uses of the service
is declared: the lease table, the generations, the jobs and `Builds` (building, publishing, the manifest). A staged
update holds the jobs' one build slot (`Jobs.stage`) until its commit builds it or it is dropped, so "one reload or
update at a time" is the jobs' to answer: the service never asks the push ops back.
`updates` (torch) is imported by the op that first needs it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from expertd import messages, replies
from expertd.errors import LeaseRevoked, UpdateRejected

from ..serving.dispatch import handles
from ..serving.generations import Generation, Generations
from ..serving.jobs import Job, Jobs
from ..serving.leases import LeaseTable, lease_tag
from ..serving.peers import Peer

if TYPE_CHECKING:
    from .updates import Staging

log = logging.getLogger("expertd.daemon")


class Builds(Protocol):
    """What the push ops ask of the weight service."""

    device: object  # the torch device builds run on

    def latest(self) -> Generation: ...

    def start_build(self, kind: str, number: int, work, on_end=None, update: int | None = None) -> Job: ...

    def finish(self, job: Job) -> None: ...

    def write_manifest(self, state: str) -> None: ...


class Pushes:
    def __init__(self, cfg, leases: LeaseTable, gens: Generations, jobs: Jobs, builds: Builds):
        self.cfg, self.leases, self.gens, self.jobs, self.builds = cfg, leases, gens, jobs, builds
        self.staging: dict[int, Staging] = {}  # update number -> its staging segment
        self._updates = 0

    @handles(messages.Update)
    def op_update(self, req: messages.Update, peer: Peer) -> replies.UpdateReply:
        """Check a push against the latest generation and hand out a staging segment to write it into."""
        from .updates import Staging, plan_update

        lease = self.leases.get(req.client, peer.holder)  # only the lease's holder pushes on it
        latest = self.builds.latest()
        self.jobs.check_idle()  # a build in flight, or another update staged (the slot is the jobs')
        self.gens.check_room()
        if req.client not in self.leases.leases:  # its generation's leases were revoked for this very push
            raise LeaseRevoked(f"lease {lease_tag(lease.client)} read generation {lease.generation}, whose leases were "
                               f"revoked to make room for this push: lease the latest and push again")
        pushes = plan_update(latest.index, req.tensors)
        self._updates += 1
        staging = Staging(self.cfg.namespace, self._updates, pushes, lease.client, group=self.cfg.group,
                          shm_dir=self.cfg.shm_dir, writer=peer.uid)  # only the pusher may write it (tcp://: none)
        self.staging[staging.number] = staging
        self.jobs.stage(staging.number)
        self.builds.write_manifest("serving")
        return staging.reply()

    def _staging_of(self, req: messages.UpdateRequest, peer: Peer) -> Staging:
        lease = self.leases.get(req.client, peer.holder)
        staging = self.staging.get(req.update)
        if staging is None or staging.client != lease.client:
            raise UpdateRejected(f"no staged update {req.update!r} of lease {lease_tag(lease.client)}")
        return staging

    @handles(messages.Stage)
    def op_stage(self, req: messages.Stage, peer: Peer) -> replies.StageReply:
        """Write pushed bytes that came as frames of this request (an updater on another host) into its staging."""
        staging = self._staging_of(req, peer)
        if staging.committed:
            raise UpdateRejected(f"update {staging.number} is committed: its bytes can no longer change")
        return replies.StageReply(written=staging.write(req.tensor, req.at, list(peer.frames)))

    @handles(messages.Publish)
    def op_publish(self, req: messages.Publish, peer: Peer) -> replies.JobReply:
        """Publish an update committed with `hold` once it is built (every daemon of a push has built its share)."""
        lease = self.leases.get(req.client, peer.holder)
        job = self.jobs.get(req.job)
        if job is None or not job.hold or job.client != lease.client:
            raise UpdateRejected(f"no held update job {req.job!r} of lease {lease_tag(lease.client)}")
        if job.state != "built":
            raise UpdateRejected(f"update job {job.number} is {job.state}, not built: it cannot be published")
        job.hold = False  # the loop publishes it between this request and the next
        return job.report(replies.JobReply)

    def cancel_held(self, job: Job, why: str) -> None:
        """Drop an update built with `hold` and never published."""
        job.built.close()
        job.built = None
        job.state, job.error, job.message = "failed", "Aborted", f"update aborted before publishing: {why}"
        job.hold = False
        self.builds.finish(job)

    @handles(messages.Commit)
    def op_commit(self, req: messages.Commit, peer: Peer) -> replies.JobReply:
        """Verify the staged bytes and build the new generation from them (a job: poll it with `job`); with
        `hold` the built generation waits for `publish` or `abort`."""
        staging = self._staging_of(req, peer)
        self.jobs.check_idle(staging.number)  # its own staged slot passes to its build
        previous, number = self.builds.latest().built, self.gens.latest.number + 1
        checksums, builds, group, ranges = req.checksums, self.builds, self.cfg.group, self.cfg.expert_ranges

        def work():
            from .updates import build_update

            staged = staging.verify(checksums)
            return build_update(previous, staging, staged, generation=number, device=builds.device, group=group,
                                ranges=ranges)

        job = self.builds.start_build("update", number, work, on_end=lambda job: self.drop(staging.number),
                                      update=staging.number)
        job.hold, job.client = req.hold, staging.client
        staging.committed = True
        return job.report(replies.JobReply)

    @handles(messages.Abort)
    def op_abort(self, req: messages.Abort, peer: Peer) -> replies.Done:
        """Drop a staged update its updater will not commit (it failed after `update`), or a held one that is
        built but not published (another daemon of the same push failed): its segments go and the next
        reload or update may start."""
        staging = self._staging_of(req, peer)
        held = self.jobs.held()
        if staging.committed and held is not None and held.client == staging.client:
            self.cancel_held(held, "its updater aborted it")
            return replies.Done()
        if staging.committed:
            raise UpdateRejected(f"update {staging.number} is committed and building: it can no longer be aborted")
        self.drop(staging.number)
        self.builds.write_manifest("serving")
        return replies.Done()

    def drop(self, number: int) -> None:
        """Unlink a staged update's segment (an uncommitted one gives the jobs' slot back)."""
        staging = self.staging.pop(number, None)
        self.jobs.unstage(number)
        if staging is not None:
            staging.close()

    def segments(self) -> list[str]:
        """The staging segments (the manifest names them, so that a successor reaps what a crash leaves)."""
        return [s.segment.name for s in self.staging.values()]

    def close(self) -> None:
        """Drop every staged update (the daemon is stopping)."""
        for number in list(self.staging):
            self.drop(number)

    def sweep(self) -> None:
        """Between requests: drop staged updates and held builds whose updater's lease is gone."""
        for number, staging in list(self.staging.items()):
            if staging.client not in self.leases.leases and not staging.committed:
                log.info("update %d dropped: its lease %s is gone", number, lease_tag(staging.client))
                self.drop(number)
        held = self.jobs.held()
        if held is not None and held.client not in self.leases.leases:
            log.info("update %d dropped unpublished: its lease %s is gone", held.number, lease_tag(held.client))
            self.cancel_held(held, "its updater's lease is gone")
