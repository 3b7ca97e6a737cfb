"""Prometheus metrics scraped from a real daemon agree with what `status` says."""

import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertd.client import ExpertClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def eventually(check, timeout: float = 10.0):
    """The loop refreshes metrics between requests: give it a few turns."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_metrics_match_status(start_daemon, tiny_checkpoint):
    port = free_port()
    daemon = start_daemon(tiny_checkpoint, metrics_port=port)
    with ExpertClient(daemon.endpoint, heartbeat=False) as client:
        client.index()
        status = daemon.status()

        def matches():
            m = scrape(port)
            assert m[("expertd_generation", ())] == status["generation"]
            assert m[("expertd_serving", ())] == 1
            assert m[("expertd_tensors", ())] == status["tensors"]
            assert m[("expertd_leases", ())] == len(status["leases"]) == 1
            served = {dict(labels)["dtype"]: v for (name, labels), v in m.items() if name == "expertd_served_bytes"}
            assert served == {k: v for k, v in status["bytes"].items() if k != "total"}
            assert m[("expertd_load_progress_bytes", ())] == m[("expertd_load_total_bytes", ())] \
                == status["bytes"]["total"]
            assert m[("expertd_requests_total", (("op", "status"),))] >= 1
            assert m[("expertd_requests_total", (("op", "lease"),))] == 1
            assert ("expertd_requests_total", (("op", "index"),)) not in m  # attach reads the index segment
            assert m[("expertd_build_seconds_count", (("kind", "load"),))] == 1
            assert m[("expertd_build_seconds_sum", (("kind", "load"),))] == \
                pytest.approx(status["job"]["seconds"], abs=1e-3)
            return m

        eventually(matches)
    # an error reply is counted by kind and error
    from expertd.connection import Connection

    conn = Connection(daemon.endpoint, timeout=5)
    with pytest.raises(Exception):
        conn.request("heartbeat", client="nobody")
    conn.close()

    def counted():
        m = scrape(port)
        assert m[("expertd_request_errors_total", (("error", "LeaseExpired"), ("op", "heartbeat")))] == 1
        assert m[("expertd_leases", ())] == 0

    eventually(counted)
    assert daemon.stop() == 0
    with pytest.raises(OSError):  # the metrics server ends with the daemon
        scrape(port)


def test_metrics_port_in_use_is_a_config_error(start_daemon, tiny_checkpoint):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        daemon = start_daemon(tiny_checkpoint, wait=False, metrics_port=busy.getsockname()[1])
        assert daemon.proc.wait(120) == 2
        err = daemon.proc.stderr.read()
    assert "metrics_port" in err and "choose a free port" in err and "Traceback" not in err


def test_metrics_show_the_expert_parallel_partition(start_daemon, tiny_checkpoint):
    port = free_port()
    daemon = start_daemon(tiny_checkpoint, metrics_port=port, expert_parallel={"size": 4, "ranks": [1, 2]})
    status = daemon.status()
    blocks = status["expert_parallel"]["experts"]

    def partition():
        m = scrape(port)
        assert m[("expertd_expert_parallel_size", ())] == 4
        assert m[("expertd_expert_parallel_ranks", (("rank", "1"),))] == 1
        assert m[("expertd_expert_parallel_ranks", (("rank", "2"),))] == 1
        assert ("expertd_expert_parallel_ranks", (("rank", "0"),)) not in m
        assert m[("expertd_served_experts", ())] == sum(sum(n for _, n in b["ranges"]) for b in blocks.values())

    eventually(partition)
