"""Prometheus metrics of one daemon, served on http://metrics_host:metrics_port/metrics (`metrics_port:` in the config).

The daemon's loop reports each request and, between requests, lets `refresh` read the weight service's snapshot (what
`status` reads too); the HTTP thread only renders what the loop set. Each daemon has a private registry, so metrics of
one never mix with another's in the same process (tests start several).
"""

from __future__ import annotations

import logging

from expertd.errors import ConfigError
from expertd.messages import OPS

log = logging.getLogger("expertd.metrics")

BUILD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class DaemonMetrics:
    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        r = self.registry = CollectorRegistry()
        self.generation = Gauge("expertd_generation", "Latest published generation (0 while the first loads)",
                                registry=r)
        self.serving = Gauge("expertd_serving", "1 when a generation is served, 0 while the first loads", registry=r)
        self.served_bytes = Gauge("expertd_served_bytes", "Bytes of the latest generation in shared memory, by dtype",
                                  ["dtype"], registry=r)
        self.tensors = Gauge("expertd_tensors", "Served tensors in the latest generation", registry=r)
        self.leases = Gauge("expertd_leases", "Live client leases (attached workers)", registry=r)
        self.live_generations = Gauge("expertd_live_generations", "Generations still held in shared memory", registry=r)
        self.load_progress = Gauge("expertd_load_progress_bytes",
                                   "Bytes of the build in progress already placed (of expertd_load_total_bytes)",
                                   registry=r)
        self.load_total = Gauge("expertd_load_total_bytes", "Bytes the build in progress places in all", registry=r)
        self.requests = Counter("expertd_requests", "Requests answered, by kind", ["op"], registry=r)
        self.errors = Counter("expertd_request_errors", "Requests answered with an error, by kind and error",
                              ["op", "error"], registry=r)
        self.builds = Histogram("expertd_build_seconds",
                                "Seconds to build a generation, by kind (load, reload, update)",
                                ["kind"], buckets=BUILD_BUCKETS, registry=r)
        self.build_failures = Counter("expertd_build_failures", "Builds that failed, by kind", ["kind"], registry=r)
        self.ep_size = Gauge("expertd_expert_parallel_size",
                             "EP world size the served experts are partitioned for (1: not partitioned)", registry=r)
        self.ep_ranks = Gauge("expertd_expert_parallel_ranks", "1 for each EP rank whose experts this daemon serves",
                              ["rank"], registry=r)
        self.served_experts = Gauge("expertd_served_experts",
                                    "Experts served per MoE layer's fused tensors, summed over them", registry=r)
        self.derived_bytes = Gauge("expertd_derived_bytes", "Bytes (whole pages) of derived tensors (casts, gathers)",
                                   registry=r)
        self.derived_files = Gauge("expertd_derived_files", "Files of derived tensors (casts, gathers)", registry=r)
        self.derived_readers = Gauge("expertd_derived_readers", "Readers (uids, CURVE keys) holding derived tensors",
                                     registry=r)
        self.derived_limit = Gauge("expertd_derived_limit", "Limits on derived tensors: max_bytes, max_files, ...",
                                   ["limit"], registry=r)
        self._dtypes: set[str] = set()
        self._seen_generation = None
        self._seen_job = 0
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=r)
        except OSError as exc:
            raise ConfigError(f"metrics_port {port} on {host}: {exc.strerror or exc}; choose a free port "
                              "(or leave metrics_port out)") from exc
        log.info("metrics on http://%s:%d/metrics", host, port)

    def request(self, op, error: str | None) -> None:
        """Count one answered request; ops outside the protocol count as 'unknown' (bounded labels)."""
        op = op if op in OPS else "unknown"
        self.requests.labels(op).inc()
        if error is not None:
            self.errors.labels(op, error).inc()

    def refresh(self, snap) -> None:
        """Set the gauges from the weight service's snapshot (`WeightService.snapshot`, taken on the loop's thread
        between requests); the latest generation's figures only when it changed."""
        latest = snap.latest
        self.serving.set(1 if latest is not None else 0)
        self.generation.set(snap.number)
        self.leases.set(snap.lease_count)
        self.live_generations.set(snap.live_generations)
        if latest is not None and latest.number != self._seen_generation:
            self._seen_generation = latest.number
            by_dtype = snap.bytes_by_dtype
            for dtype in self._dtypes - set(by_dtype):
                self.served_bytes.remove(dtype)
            for dtype, nbytes in by_dtype.items():
                self.served_bytes.labels(dtype).set(nbytes)
            self._dtypes = set(by_dtype)
            self.tensors.set(snap.tensors)
            ep = snap.partition
            self.ep_size.set(ep.size if ep is not None else 1)
            for rank in ep.ranks if ep is not None else ():
                self.ep_ranks.labels(str(rank)).set(1)
            self.served_experts.set(snap.served_experts)
        derived = snap.derived
        self.derived_bytes.set(derived["bytes"])
        self.derived_files.set(derived["files"])
        self.derived_readers.set(len(derived["readers"]))
        for limit in ("max_bytes", "max_files", "max_bytes_per_reader", "max_files_per_reader", "shm_reserve"):
            self.derived_limit.labels(limit).set(derived[limit])
        done, total = snap.build_progress
        self.load_progress.set(done)
        self.load_total.set(total)
        for ended in snap.ended:
            if ended.number <= self._seen_job:
                continue
            self._seen_job = ended.number
            if ended.seconds is not None:
                self.builds.labels(ended.kind).observe(ended.seconds)
            elif ended.state == "failed":
                self.build_failures.labels(ended.kind).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
