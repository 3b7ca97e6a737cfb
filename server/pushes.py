"""The push ops of the weight service: update → stage → commit → publish (or abort).

A trainer's push is checked against the latest generation, written into a staging segment (in place on
this host, as frames from another), verified and built into the next generation by a job; with `hold`
the built generation waits until every daemon of the push has built its share. `WeightService` mixes
these in: they share its generations, jobs and manifest. `updates` (torch) is imported by the op that
first needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from expertd import messages
from expertd.errors import UpdateRejected

from .generations import lease_tag

if TYPE_CHECKING:
    from .updates import Staging


class PushOps:
    staging: dict[int, Staging]

    def op_update(self, req: messages.Update) -> dict:
        """Check a push against the latest generation and hand out a staging segment to write it into."""
        from .updates import Staging, plan_update

        lease = self.gens.get(req.client)
        latest = self.latest()
        self._check_idle()
        self.gens.check_room()
        pushes = plan_update(latest.index, req.tensors)
        self._updates += 1
        staging = Staging(self.cfg.namespace, self._updates, pushes, lease.client, group=self.cfg.group,
                          shm_dir=self.cfg.shm_dir)
        self.staging[staging.number] = staging
        self._write_manifest("serving")
        return staging.reply().wire()

    def _staging_of(self, req: messages.UpdateRequest) -> Staging:
        lease = self.gens.get(req.client)
        staging = self.staging.get(req.update)
        if staging is None or staging.client != lease.client:
            raise UpdateRejected(f"no staged update {req.update!r} of lease {lease_tag(lease.client)}")
        return staging

    def op_stage(self, req: messages.Stage) -> dict:
        """Write pushed bytes that came as frames of this request (an updater on another host) into its staging."""
        staging = self._staging_of(req)
        if staging.committed:
            raise UpdateRejected(f"update {staging.number} is committed: its bytes can no longer change")
        return messages.StageReply(written=staging.write(req.tensor, req.at, req.frames)).wire()

    def op_publish(self, req: messages.Publish) -> dict:
        """Publish an update committed with `hold` once it is built (every daemon of a push has built its share)."""
        lease = self.gens.get(req.client)
        job = self.jobs.get(req.job)
        if job is None or not job.hold or job.client != lease.client:
            raise UpdateRejected(f"no held update job {req.job!r} of lease {lease_tag(lease.client)}")
        if job.state != "built":
            raise UpdateRejected(f"update job {job.number} is {job.state}, not built: it cannot be published")
        job.hold = False  # the loop publishes it between this request and the next
        return job.report(messages.JobReply).wire()

    def _cancel_held(self, job, why: str) -> None:
        job.built.close()
        job.built = None
        job.state, job.error, job.message = "failed", "Aborted", f"update aborted before publishing: {why}"
        job.hold = False
        self._finish(job)

    def op_commit(self, req: messages.Commit) -> dict:
        """Verify the staged bytes and build the new generation from them (a job: poll it with `job`); with
        `hold` the built generation waits for `publish` or `abort`."""
        staging = self._staging_of(req)
        self.jobs.check_idle()
        previous, number = self.latest().built, self.gens.latest.number + 1
        checksums = req.checksums

        def work():
            from .updates import build_update

            staged = staging.verify(checksums)
            return build_update(previous, staging, staged, generation=number, device=self.device, group=self.cfg.group)

        job = self._start_build("update", number, work, on_end=lambda job: self._drop_staging(staging.number))
        job.hold, job.client = req.hold, staging.client
        staging.committed = True
        return job.report(messages.JobReply).wire()

    def op_abort(self, req: messages.Abort) -> dict:
        """Drop a staged update its updater will not commit (it failed after `update`), or a held one that is
        built but not published (another daemon of the same push failed): its segments go and the next
        reload or update may start."""
        staging = self._staging_of(req)
        held = self.jobs.held()
        if staging.committed and held is not None and held.client == staging.client:
            self._cancel_held(held, "its updater aborted it")
            return messages.Done().wire()
        if staging.committed:
            raise UpdateRejected(f"update {staging.number} is committed and building: it can no longer be aborted")
        self._drop_staging(staging.number)
        self._write_manifest("serving")
        return messages.Done().wire()

    def _drop_staging(self, number: int) -> None:
        staging = self.staging.pop(number, None)
        if staging is not None:
            staging.close()
