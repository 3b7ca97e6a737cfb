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

from expertd import messages, replies
from expertd.errors import ExpertdError, ProtocolError
from expertd.extents import extents_of
from expertd.procfs import default_threads

from ..derived.requests import DerivedRequests
from ..load.built import Built, Cancelled, publish
from ..push.pushes import Pushes
from ..restart import adopt, ledger
from ..restart.derived_records import Recorder
from ..restart.runstate import RunState, namespace_segments
from ..serving.dispatch import handles
from ..serving.generations import Generation, Generations, place_index
from ..serving.jobs import Job, Jobs, forget_frames
from ..serving.leases import LeaseTable
from ..serving.peers import Peer
from ..serving.permissions import allowed_checkpoint
from ..shm.arena import segment_prefix, unlink_segment
from .config import DaemonConfig
from .readers import Readers
from .snapshot import Snapshot

# What builds (torch, transformers, the checkpoint reader, the kernels) is imported by the methods that start one,
# so that serving adopted generations waits for none of it: `loader` and `updates` (see `built`); a derived tensor
# imports torch only to make one (`tensors.make`).

log = logging.getLogger("expertd.daemon")

LEASES_EVERY_S = 0.5  # the manifest's record of leases lags the live ones by at most this


class WeightService:
    """The generation lifecycle (load, adopt, reload, publish, retire, the manifest) over its components: the lease
    table, the live generations, the build jobs, the derived tensors readers ask for (`derived`), the reader ops
    (`readers`) and the push ops (`pushes`); `snapshot` is what status and metrics read of them."""

    def __init__(self, cfg: DaemonConfig, runstate: RunState, should_stop):
        self.cfg = cfg
        self.runstate = runstate
        self._device = None  # the torch device builds run on, resolved by the first one (`device`)
        self.should_stop = should_stop
        self.checkpoint = cfg.checkpoint  # what the latest generation was built from
        self.leases = LeaseTable(cfg.max_leases_per_client, cfg.max_leases, cfg.lease_timeout_s,
                                 max_leases_per_process=cfg.max_leases_per_process)
        self.gens = Generations(self.leases, cfg.max_generations,
                                on_retire=lambda n: self.derived_records.remove(n),
                                revoke_after_s=cfg.revoke_after_s, hold_s=cfg.lease_timeout_s,
                                max_old_per_holder=cfg.max_old_generations_per_holder)
        self.run_dir = cfg.resolved_run_dir
        self.conditions = ledger.build_conditions(cfg.checkpoint, cfg.expert_parallel, cfg.shm_dir)
        self.derived_records = Recorder(self.run_dir, cfg.namespace)  # each generation's derived tensors, kept
        self._recorded_leases: list[dict] = []  # the leases the manifest last recorded
        self._leases_written = 0.0
        self.jobs = Jobs()
        self.pushes = Pushes(cfg, self.leases, self.gens, self.jobs, self)
        self.derived = DerivedRequests(cfg, self.gens)  # casts and gathers: checked whole, counted, made off the loop
        self.readers = Readers(cfg, self.leases, self.gens, self.derived)
        self.first_generation = 1
        self.load_error: BaseException | None = None
        self.build_progress = (0, 0)  # (bytes placed, bytes to place) of the latest build from a checkpoint
        self._preparing = False  # a job is in `_prepare`: it has made nothing yet
        self.abandoned = False  # a build that had not stopped within stop_timeout_s when the daemon stopped
        self._live: set[str] = set()  # the segments of the generations live when it was abandoned

    @property
    def device(self):
        """The torch device dequant runs on (`device:`), resolved once, by the first build that needs it."""
        if self._device is None:
            from ..load.loader import resolve_device

            self._device = resolve_device(self.cfg.device)
        return self._device

    def latest(self) -> Generation:
        return self.gens.serving()

    @property
    def deriving(self) -> bool:
        """A derivation job is under way: its next step waits for a tick (the loop polls sooner)."""
        return self.derived.busy

    def snapshot(self) -> Snapshot:
        """What is served, leased, built and derived now: the one thing `status` and the metrics read."""
        return Snapshot(self.gens, self.leases, self.jobs, self.derived, generation=self.status_generation(),
                        checkpoint=self.checkpoint, build_progress=self.build_progress)

    def start_load(self, ckpt, plan) -> None:
        """Build the first generation from a validated checkpoint (its number continues the namespace's count)."""
        self.first_generation = self.runstate.next_generation()
        number = self.first_generation
        self.start_build("load", number, lambda: self._build(ckpt, plan, number, None))

    def adopt(self, manifest: dict | None) -> adopt.Adopted | None:
        """What a dead or handed-over predecessor left that this daemon can serve again (see `adopt`), verified."""
        adopted = adopt.adopt(manifest, namespace=self.cfg.namespace, run_dir=self.run_dir,
                              conditions=self.conditions, mode=self.cfg.adopt_verify,
                              threads=self.cfg.load_threads or default_threads(),
                              gid=grp.getgrnam(self.cfg.group).gr_gid if self.cfg.group else None,
                              rebuild=self._rebuild)
        ledger.remove_all(self.run_dir, self.cfg.namespace,  # what is not adopted is reaped: its records go too
                          keep={r.number for r in adopted.records} if adopted is not None else frozenset())
        return adopted

    def _rebuild(self, names: list[str]) -> dict:
        """Tensors `names` made anew from the configured checkpoint (those it still makes)."""
        from ..load.loader import prepare, rebuild_tensors

        try:
            ckpt, plan = prepare(self.cfg.checkpoint, self.cfg.expert_parallel, self.cfg.layout_cache)
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
        a changed one becomes the next generation (incrementally). Their derived tensors are served again too."""
        gens = [Generation(Built(adopt.arena_of(r, self.cfg.group), r.index, r.parts, r.known,
                                 sums=adopted.sums.get(r.number, {})),
                           place_index(r.index, self.cfg.group)) for r in adopted.records]
        derived_segments = {x.segment for mine in adopted.derived.values() for v in mine.values()
                            for x in extents_of(v.entry)}
        for gen in gens:
            mine = adopted.derived.get(gen.number, {})
            gen.adopt_derived(mine, derived_segments)
            self.derived_records.adopted(gen.number, -1 if gen.number in adopted.rerecord else len(mine))
        self.gens.adopt(gens, adopted.leases)
        self.derived.holds.adopt(self.gens)  # the re-granted leases hold what their readers made
        latest = self.gens.latest
        publish(latest.index, self.cfg.index_path)
        self.first_generation = latest.number
        log.info("adopted generation(s) %s (%d lease(s) re-granted, %d tensor(s) rebuilt from the checkpoint, %d "
                 "derived tensor segment(s) kept) in %.2fs: serving generation %d",
                 ", ".join(str(r.number) for r in adopted.records), len(adopted.leases), len(adopted.repaired),
                 len(derived_segments), adopted.seconds, latest.number)
        self.write_manifest("serving")
        number = latest.number + 1

        def work():
            ckpt, plan = self._prepare(self.cfg.checkpoint)  # torch and transformers load here, while serving
            if adopt.matches(ckpt, plan, latest.built):
                ckpt.close()
                return None
            log.info("the checkpoint changed while no daemon served it: building generation %d from it", number)
            return self._build(ckpt, plan, number, latest.built)

        self.start_build("check", number, work)  # a reload or update meanwhile is Busy for these seconds

    def tick(self, reload_requested: bool) -> None:
        """Between requests: publish a finished build, start a SIGHUP reload, expire leases and stale staging."""
        job = self.jobs.finished()
        if job is not None:
            self.finish(job)
        if reload_requested:
            try:
                self._start_reload(self.cfg.checkpoint)
            except ExpertdError as exc:
                log.error("SIGHUP reload not started: %s", exc)
        ended = self.leases.expire(self.cfg.lease_timeout_s)
        if self.gens.end_holds(self.cfg.lease_timeout_s) or ended:
            self.gens.retire()
        self.gens.revoke_due()  # a push waited revoke_after_s for room: the oldest generation's readers move on
        self._record_leases()
        self.pushes.sweep()
        self.derived.tick()
        self.derived_records.flush(self.gens.live.values())  # what the loop's requests made, for a successor

    def _prepare(self, checkpoint: str):
        """`loader.prepare` on a job's thread (importing torch and transformers the first time): until it returns,
        the job has made nothing, and a stop does not wait for it."""
        self._preparing = True
        try:
            from ..load.loader import prepare

            return prepare(checkpoint, self.cfg.expert_parallel, self.cfg.layout_cache)
        finally:
            self._preparing = False

    def _build(self, ckpt, plan, number: int, previous):
        from ..load.loader import build

        self.build_progress = (0, plan.nbytes)

        def placed(nbytes: int) -> None:  # on the job's thread; a tuple swap is atomic
            self.build_progress = (self.build_progress[0] + nbytes, plan.nbytes)

        return build(ckpt, plan, namespace=self.cfg.namespace, generation=number, previous=previous,
                     device=self.cfg.device, threads=self.cfg.load_threads,
                     progress=self.cfg.progress and previous is None, should_stop=self.should_stop,
                     group=self.cfg.group, on_progress=placed, shm_dir=self.cfg.shm_dir,
                     ranges=self.cfg.expert_ranges)

    def start_build(self, kind: str, number: int, work, on_end=None, update: int | None = None) -> Job:
        """Start a build job (of staged update `update`: it takes that update's slot) and record it in the manifest."""
        job = self.jobs.start(kind, number, work, on_end, update)
        self.write_manifest("loading" if kind == "load" else "serving", building=number)
        return job

    def _start_reload(self, checkpoint: str) -> Job:
        self.jobs.check_idle()  # Busy while a build runs or an update is staged: one reload or update at a time
        self.gens.check_room()
        previous, number = self.gens.latest.built, self.gens.latest.number + 1

        def work():
            ckpt, plan = self._prepare(checkpoint)  # every check `start` does, before anything is created
            return self._build(ckpt, plan, number, previous)

        def on_end(job: Job) -> None:
            if job.state == "published":
                self.checkpoint = checkpoint

        job = self.start_build("reload", number, work, on_end)
        job.checkpoint = checkpoint
        return job

    def finish(self, job: Job) -> None:
        """Publish a built generation (index segment, index JSON, then the switch, then the manifest), or record a
        failure."""
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
        self.write_manifest("serving" if self.gens.latest else "loading")

    def write_manifest(self, state: str, building: int | None = None) -> None:
        segments = self.gens.segments_by_generation()
        if building is not None:  # its segments are created one by one: record the names they will have
            segments[building] = [segment_prefix(self.cfg.namespace, os.getpid(), building) + "*"]
        latest = self.gens.latest.number if self.gens.latest else self.first_generation
        self._recorded_leases = self.leases.recorded()
        self._leases_written = time.monotonic()
        self.runstate.write_manifest(latest, segments, state, self.cfg.endpoint,
                                     staging=self.pushes.segments(),
                                     shm_dir=self.cfg.shm_dir,
                                     conditions=self.conditions, leases=self._recorded_leases)

    def _record_leases(self) -> None:
        """Keep the manifest's leases current, so that a successor re-grants them: rewritten only when they changed,
        at most twice a second, and of at most `leases.RECORDED_LEASES` leases (heartbeats change nothing it
        records; the caps bound how many there are)."""
        if self.gens.latest is None or time.monotonic() - self._leases_written < LEASES_EVERY_S:
            return
        if self.leases.recorded() != self._recorded_leases:
            self.write_manifest("serving")

    @handles(messages.Reload)
    def op_reload(self, req: messages.Reload, peer: Peer) -> replies.JobReply:
        checkpoint = allowed_checkpoint(self.cfg, req.checkpoint)  # the configured one or under checkpoint_roots
        self.latest()
        return self._start_reload(checkpoint).report(replies.JobReply)

    @handles(messages.Job)
    def op_job(self, req: messages.Job, peer: Peer) -> replies.JobReply:
        job = self.jobs.get(req.job)
        if job is None:
            raise ProtocolError(f"no job {req.job!r} (finished jobs are kept a while, not forever)")
        return job.report(replies.JobReply)

    def status_generation(self) -> int:
        if self.gens.latest is not None:
            return self.gens.latest.number
        return self.jobs.current.generation if self.jobs.current is not None else self.first_generation

    def close(self, keep: bool = False) -> None:
        """Remove every segment, staged update and the published index (the daemon is stopping); with `keep` (a
        handover) leave the live generations, their ledger and the manifest for a successor to adopt."""
        if self._preparing and self.jobs.current is not None:  # reading headers or importing torch: nothing made yet
            log.info("%s %d had not started building (it was still importing torch or planning the checkpoint): "
                     "left unfinished", self.jobs.current.kind, self.jobs.current.number)
            self.abandoned = True
        else:
            self.abandoned = not self.jobs.join(self.cfg.stop_timeout_s)
            if self.abandoned:
                log.error("%s %d did not stop within stop_timeout_s (%gs): abandoned, its segments unlinked",
                          self.jobs.current.kind, self.jobs.current.number, self.cfg.stop_timeout_s)
        if self.abandoned:
            self._live = {name for names in self.gens.segments_by_generation().values() for name in names}
            self.sweep()
        self.derived.close()  # a derivation job stops; what it made goes
        job = self.jobs.current
        if job is not None and job.built is not None:
            job.built.close()  # built but never published
        self.pushes.close()
        if keep and self.gens.latest is not None:
            self.derived_records.flush(self.gens.live.values(), force=True)
            segments = self.gens.segments_by_generation()
            self.runstate.write_manifest(self.gens.latest.number, segments, "handover", self.cfg.endpoint,
                                         shm_dir=self.cfg.shm_dir, conditions=self.conditions,
                                         leases=self.leases.recorded())
            log.info("handing over generation(s) %s: left in shared memory for a successor",
                     ", ".join(str(n) for n in sorted(segments)))
            self.gens.leave()
            return
        self.derived_records.wait()
        ledger.remove_all(self.run_dir, self.cfg.namespace)
        if self.gens.latest is not None:
            self.gens.close()
            try:
                os.unlink(self.cfg.index_path)
            except FileNotFoundError:
                pass
        self.runstate.write_manifest(self.status_generation(), {}, "stopped", self.cfg.endpoint,
                                     shm_dir=self.cfg.shm_dir)

    def sweep(self) -> None:
        """Unlink what an abandoned build made so far: this process's segments that no generation live when it was
        abandoned holds (those go with the generations, or stay for a successor on a handover)."""
        for name, pid in namespace_segments(self.cfg.namespace, self.cfg.shm_dir).items():
            if pid == os.getpid() and name not in self._live:
                unlink_segment(name, self.cfg.shm_dir)
