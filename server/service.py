"""The weight service: the generations a daemon serves, and how new ones are built and published.

The daemon's loop dispatches requests; this module decides. It owns the live generations and
their leases (`generations`), the one build in flight (`jobs`), staged updates (`updates`), and
the manifest that lets a successor reap what a crash leaves behind. Everything that changes
what is served runs on the loop's thread: builds only hand back an unpublished generation.
"""

from __future__ import annotations

import grp
import logging
import os
import time

import torch

from expertd import messages
from expertd.errors import Busy, ExpertdError, GenerationGone, NotReady, ProtocolError, UpdateRejected

from . import adopt, ledger, variants
from .arena import segment_name, unlink_segment
from .config import DaemonConfig
from .permissions import allowed_checkpoint
from .runstate import RunState, namespace_segments
from .generations import Generation, Generations, lease_tag, place_index
from .jobs import Job, Jobs, forget_frames
from .filling import default_threads
from .loader import Built, Cancelled, build, prepare, publish, rebuild_tensors
from .updates import Staging, build_update, plan_update

log = logging.getLogger("expertd.daemon")

LEASES_EVERY_S = 0.5  # the manifest's record of leases lags the live ones by at most this


class WeightService:
    def __init__(self, cfg: DaemonConfig, runstate: RunState, device: torch.device, should_stop):
        self.cfg = cfg
        self.runstate = runstate
        self.device = device
        self.should_stop = should_stop
        self.checkpoint = cfg.checkpoint  # what the latest generation was built from
        self.gens = Generations(cfg.max_generations, on_retire=lambda n: ledger.remove(self.run_dir, cfg.namespace, n),
                                max_leases_per_client=cfg.max_leases_per_client)
        self.run_dir = cfg.resolved_run_dir
        self.conditions = ledger.build_conditions(cfg.checkpoint, cfg.expert_parallel, cfg.shm_dir)
        self._recorded_leases: list[dict] = []  # the leases the manifest last recorded
        self._leases_written = 0.0
        self.jobs = Jobs()
        self.staging: dict[int, Staging] = {}
        self._updates = 0
        self.first_generation = 1
        self.load_error: BaseException | None = None
        self.build_progress = (0, 0)  # (bytes placed, bytes to place) of the latest build from a checkpoint
        self.abandoned = False  # a build that had not stopped within stop_timeout_s when the daemon stopped
        self._live: set[str] = set()  # the segments of the generations live when it was abandoned

    def latest(self) -> Generation:
        if self.gens.latest is None:
            raise NotReady("the daemon is still loading")
        return self.gens.latest

    def start_load(self, ckpt, plan) -> None:
        """Build the first generation from a validated checkpoint (its number continues the namespace's count)."""
        self.first_generation = self.runstate.next_generation()
        number = self.first_generation
        self._start_build("load", number, lambda: self._build(ckpt, plan, number, None))

    def adopt(self, manifest: dict | None) -> adopt.Adopted | None:
        """What a dead or handed-over predecessor left that this daemon can serve again (see `adopt`), verified."""
        adopted = adopt.adopt(manifest, namespace=self.cfg.namespace, run_dir=self.run_dir,
                              conditions=self.conditions, mode=self.cfg.adopt_verify,
                              threads=self.cfg.load_threads or default_threads(),
                              gid=grp.getgrnam(self.cfg.group).gr_gid if self.cfg.group else None, rebuild=self._rebuild)
        ledger.remove_all(self.run_dir, self.cfg.namespace,  # what is not adopted is reaped: its records go too
                          keep={r.number for r in adopted.records} if adopted is not None else frozenset())
        return adopted

    def _rebuild(self, names: list[str]) -> dict:
        """Tensors `names` made anew from the configured checkpoint (those it still makes)."""
        try:
            ckpt, plan = prepare(self.cfg.checkpoint, self.cfg.expert_parallel)
        except ExpertdError as exc:
            log.error("cannot rebuild from %s: %s", self.cfg.checkpoint, exc)
            return {}
        try:
            return rebuild_tensors(ckpt, plan, names, self.device)
        finally:
            ckpt.close()

    def serve_adopted(self, adopted: adopt.Adopted) -> None:
        """Serve the adopted generations under their numbers, re-grant the predecessor's leases, hold every adopted
        generation a lease timeout for workers that re-take theirs, then check the checkpoint in the background:
        a changed one becomes the next generation (incrementally)."""
        self.gens.adopt([Generation(Built(adopt.arena_of(r, self.cfg.group), r.index, r.parts, r.known),
                                    place_index(r.index, self.cfg.group)) for r in adopted.records], adopted.leases)
        latest = self.gens.latest
        publish(latest.index, self.cfg.index_path)
        self.first_generation = latest.number
        log.info("adopted generation(s) %s (%d lease(s) re-granted, %d tensor(s) rebuilt from the checkpoint) in "
                 "%.2fs: serving generation %d", ", ".join(str(r.number) for r in adopted.records), len(adopted.leases),
                 len(adopted.repaired), adopted.seconds, latest.number)
        self._write_manifest("serving")
        number = latest.number + 1

        def work():
            ckpt, plan = prepare(self.cfg.checkpoint, self.cfg.expert_parallel)
            if adopt.matches(ckpt, plan, latest.built):
                ckpt.close()
                return None
            log.info("the checkpoint changed while no daemon served it: building generation %d from it", number)
            return self._build(ckpt, plan, number, latest.built)

        self._start_build("check", number, work)  # a reload or update meanwhile is Busy for these seconds

    def tick(self, reload_requested: bool) -> None:
        """Between requests: publish a finished build, start a SIGHUP reload, expire leases and stale staging."""
        job = self.jobs.finished()
        if job is not None:
            self._finish(job)
        if reload_requested:
            try:
                self._start_reload(self.cfg.checkpoint)
            except ExpertdError as exc:
                log.error("SIGHUP reload not started: %s", exc)
        self.gens.expire(self.cfg.lease_timeout_s)
        self._record_leases()
        for number, staging in list(self.staging.items()):
            if staging.client not in self.gens.leases and not staging.committed:
                log.info("update %d dropped: its lease %s is gone", number, lease_tag(staging.client))
                self._drop_staging(number)
        held = self.jobs.held()
        if held is not None and held.client not in self.gens.leases:
            log.info("update %d dropped unpublished: its lease %s is gone", held.number, lease_tag(held.client))
            self._cancel_held(held, "its updater's lease is gone")

    def _build(self, ckpt, plan, number: int, previous):
        self.build_progress = (0, plan.nbytes)

        def placed(nbytes: int) -> None:  # on the job's thread; a tuple swap is atomic
            self.build_progress = (self.build_progress[0] + nbytes, plan.nbytes)

        return build(ckpt, plan, namespace=self.cfg.namespace, generation=number, previous=previous,
                     device=self.cfg.device, threads=self.cfg.load_threads, progress=self.cfg.progress and previous is None,
                     should_stop=self.should_stop, group=self.cfg.group, on_progress=placed, shm_dir=self.cfg.shm_dir)

    def _start_build(self, kind: str, number: int, work, on_end=None) -> Job:
        job = self.jobs.start(kind, number, work, on_end)
        self._write_manifest("loading" if kind == "load" else "serving", building=number)
        return job

    def _start_reload(self, checkpoint: str) -> Job:
        self._check_idle()
        self.gens.check_room()
        previous, number = self.gens.latest.built, self.gens.latest.number + 1

        def work():
            ckpt, plan = prepare(checkpoint, self.cfg.expert_parallel)  # every check `start` does, before anything is created
            return self._build(ckpt, plan, number, previous)

        def on_end(job: Job) -> None:
            if job.state == "published":
                self.checkpoint = checkpoint

        job = self._start_build("reload", number, work, on_end)
        job.checkpoint = checkpoint
        return job

    def _finish(self, job: Job) -> None:
        """Publish a built generation (index segment, index JSON, then the switch, then the manifest), or record a failure."""
        if job.state == "built":
            place = None
            try:
                place = place_index(job.built.index, self.cfg.group)
                publish(job.built.index, self.cfg.index_path)
            except BaseException as exc:
                if place is not None:
                    unlink_segment(place["segment"], job.built.index.shm_dir)
                job.built.close()
                job.exc, job.error, job.message, job.state = exc, type(exc).__name__, str(exc), "failed"
                forget_frames(exc)
            else:
                ledger.write(self.run_dir, job.built, job.kind, ledger.build_conditions(  # what it was built from
                    job.checkpoint or self.checkpoint, self.cfg.expert_parallel, self.cfg.shm_dir))
                self.gens.publish(Generation(job.built, place))
                job.state = "published"
                b = job.built
                log.info("serving generation %d on %s (%s: %d tensor(s), %.1f MiB written in %.2fs)", job.generation,
                         self.cfg.endpoint, job.kind, b.tensors_written, b.bytes_written / 2**20, b.seconds)
        if job.state == "unchanged":
            log.info("the checkpoint is what generation %d was built from: nothing to rebuild", job.generation - 1)
        if job.state == "failed":
            if job.kind == "load":
                self.load_error = job.exc
                if not isinstance(job.exc, Cancelled):
                    log.error("loading failed: %s", job.exc)
            else:
                log.error("%s %d failed; generation %s stays published: %s", job.kind, job.number,
                          self.gens.latest.number if self.gens.latest else None, job.message)
        self.jobs.close(job)
        if job.on_end is not None:
            job.on_end(job)
        self._write_manifest("serving" if self.gens.latest else "loading")

    def _write_manifest(self, state: str, building: int | None = None) -> None:
        segments = self.gens.segments_by_generation()
        if building is not None:  # its segments are created one by one: record the names they will have
            segments[building] = [segment_name(self.cfg.namespace, os.getpid(), building, 0).rsplit(".", 1)[0] + ".*"]
        latest = self.gens.latest.number if self.gens.latest else self.first_generation
        self._recorded_leases = self.gens.recorded()
        self._leases_written = time.monotonic()
        self.runstate.write_manifest(latest, segments, state, self.cfg.endpoint,
                                     staging=[s.segment.name for s in self.staging.values()], shm_dir=self.cfg.shm_dir,
                                     conditions=self.conditions, leases=self._recorded_leases)

    def _record_leases(self) -> None:
        """Keep the manifest's leases current (at most twice a second), so that a successor re-grants them."""
        if self.gens.latest is None or time.monotonic() - self._leases_written < LEASES_EVERY_S:
            return
        if self.gens.recorded() != self._recorded_leases:
            self._write_manifest("serving")

    def _check_idle(self) -> None:
        self.jobs.check_idle()
        if self.staging:
            number = next(iter(self.staging))
            raise Busy(f"update {number} is staged and not yet committed; one reload or update at a time")

    def _drop_staging(self, number: int) -> None:
        staging = self.staging.pop(number, None)
        if staging is not None:
            staging.close()

    def op_refresh(self, req: messages.Refresh) -> dict:
        """Move the lease to the latest generation; the reply names its index segment."""
        latest = self.latest()
        lease = self.gens.refresh(req.client)
        return messages.IndexSegmentReply(generation=lease.generation, index_segment=latest.index_place).wire()

    def op_reload(self, req: messages.Reload) -> dict:
        checkpoint = allowed_checkpoint(self.cfg, req.checkpoint)  # the configured one or under checkpoint_roots
        self.latest()
        return self._start_reload(checkpoint).report(messages.JobReply).wire()

    def op_update(self, req: messages.Update) -> dict:
        """Check a push against the latest generation and hand out a staging segment to write it into."""
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

    def op_variant(self, req: messages.Variant) -> dict:
        """Dtype variants of served tensors for a worker whose transformers loads them in another dtype: cast once
        per host into the lease's generation (or `generation`, which must be live), reused by every later ask."""
        lease = self.gens.get(req.client)
        number = req.generation if req.generation is not None else self.gens.generation_of(lease).number
        gen = self.gens.live.get(number)
        if gen is None:
            raise GenerationGone(f"generation {number} is not served any more (live: {sorted(self.gens.live)}): its "
                                 "variants went with it; refresh() and ask again")
        others = [g for g in self.gens.live.values() if g is not gen]
        made = variants.make(gen, others, req.tensors, group=self.cfg.group)
        return messages.VariantReply(generation=gen.number, tensors=[v.to_wire() for v in made]).wire()

    def op_job(self, req: messages.Job) -> dict:
        job = self.jobs.get(req.job)
        if job is None:
            raise ProtocolError(f"no job {req.job!r} (finished jobs are kept a while, not forever)")
        return job.report(messages.JobReply).wire()

    def status_generation(self) -> int:
        if self.gens.latest is not None:
            return self.gens.latest.number
        return self.jobs.current.generation if self.jobs.current is not None else self.first_generation

    def close(self, keep: bool = False) -> None:
        """Remove every segment, staged update and the published index (the daemon is stopping); with `keep` (a
        handover) leave the live generations, their ledger and the manifest for a successor to adopt."""
        self.abandoned = not self.jobs.join(self.cfg.stop_timeout_s)
        if self.abandoned:
            log.error("%s %d did not stop within stop_timeout_s (%gs): abandoned, its segments unlinked",
                      self.jobs.current.kind, self.jobs.current.number, self.cfg.stop_timeout_s)
            self._live = {name for names in self.gens.segments_by_generation().values() for name in names}
            self.sweep()
        job = self.jobs.current
        if job is not None and job.built is not None:
            job.built.close()  # built but never published
        for number in list(self.staging):
            self._drop_staging(number)
        if keep and self.gens.latest is not None:
            segments = self.gens.segments_by_generation()
            self.runstate.write_manifest(self.gens.latest.number, segments, "handover", self.cfg.endpoint,
                                         shm_dir=self.cfg.shm_dir, conditions=self.conditions,
                                         leases=self.gens.recorded())
            log.info("handing over generation(s) %s: left in shared memory for a successor",
                     ", ".join(str(n) for n in sorted(segments)))
            self.gens.leave()
            return
        ledger.remove_all(self.run_dir, self.cfg.namespace)
        if self.gens.latest is not None:
            self.gens.close()
            try:
                os.unlink(self.cfg.index_path)
            except FileNotFoundError:
                pass
        self.runstate.write_manifest(self.status_generation(), {}, "stopped", self.cfg.endpoint, shm_dir=self.cfg.shm_dir)

    def sweep(self) -> None:
        """Unlink what an abandoned build made so far: this process's segments that no generation live when it was
        abandoned holds (those go with the generations, or stay for a successor on a handover)."""
        for name, pid in namespace_segments(self.cfg.namespace, self.cfg.shm_dir).items():
            if pid == os.getpid() and name not in self._live:
                unlink_segment(name, self.cfg.shm_dir)
