"""The lease table alone, on a clock the test moves: a lease ends one timeout after its last heartbeat and not a moment
before; an ended lease's generation counts against its holder one more timeout, or while its process lives; a
restarted daemon's leases start afresh. (/proc lookups, paced: test_lease_reaping.)"""

from __future__ import annotations

import os
import time

import pytest

from expertd.errors import LeaseExpired, LeaseLimit, MappedLimit
from expertd.server.serving.leases import WATCH_EVERY_S, LeaseTable, process_of

from helpers.clock import STEP, FakeClock

TIMEOUT_S = 30.0
HOLDER = "uid 1000"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_the_daemon_reads_the_monotonic_clock():
    assert LeaseTable().clock is time.monotonic


def test_a_silent_lease_ends_just_after_its_timeout(clock):
    table = LeaseTable(timeout_s=TIMEOUT_S, clock=clock)
    lease = table.take(os.getpid(), 1, owner=HOLDER)
    clock.advance(TIMEOUT_S)  # the deadline itself: still held
    assert table.expire(TIMEOUT_S) == [] and table.get(lease.client, HOLDER) is lease
    clock.advance(STEP)
    assert table.expire(TIMEOUT_S) == [lease] and table.leases == {}
    with pytest.raises(LeaseExpired):
        table.beat(lease.client, HOLDER)


def test_each_heartbeat_gives_the_lease_another_timeout(clock):
    table = LeaseTable(timeout_s=TIMEOUT_S, clock=clock)
    lease = table.take(os.getpid(), 1, owner=HOLDER)
    for _ in range(5):  # five timeouts' worth of time, a beat just before each deadline
        clock.advance(TIMEOUT_S - STEP)
        assert table.expire(TIMEOUT_S) == []
        table.beat(lease.client, HOLDER)
    (row,) = table.status(clock())
    assert row["age_s"] == round(5 * (TIMEOUT_S - STEP), 3) and row["idle_s"] == 0
    clock.advance(TIMEOUT_S)
    assert table.expire(TIMEOUT_S) == []
    clock.advance(STEP)
    assert table.expire(TIMEOUT_S) == [lease]


def test_a_silent_lease_counts_against_its_holder_one_more_timeout(clock):
    """Without a process to watch, the generation may still be mapped for one lease timeout after the lease ends:
    it counts against the holder until then (forgotten by the first sweep after, sweeps every WATCH_EVERY_S)."""
    table = LeaseTable(max_leases_per_client=1, timeout_s=TIMEOUT_S, clock=clock)
    lease = table.take(os.getpid(), 1, owner=HOLDER)
    clock.advance(TIMEOUT_S + STEP)
    assert table.expire(TIMEOUT_S) == [lease]
    with pytest.raises(MappedLimit):
        table.take(os.getpid(), 1, owner=HOLDER)
    clock.advance(TIMEOUT_S)  # to the record's end exactly: still counted
    table.expire(TIMEOUT_S)
    assert len(table.retained) == 1
    clock.advance(STEP)  # past it, but the last sweep was STEP ago
    table.expire(TIMEOUT_S)
    assert len(table.retained) == 1
    clock.advance(WATCH_EVERY_S - STEP)  # the next sweep
    table.expire(TIMEOUT_S)
    assert table.retained == {}
    assert table.take(os.getpid(), 1, owner=HOLDER).generation == 1


def test_a_silent_lease_whose_process_lives_counts_until_its_holder_releases_it(clock):
    table = LeaseTable(max_leases_per_client=1, timeout_s=TIMEOUT_S, clock=clock)
    lease = table.take(os.getpid(), 1, owner=HOLDER, process=process_of(os.getpid()))
    clock.advance(TIMEOUT_S + STEP)
    assert table.expire(TIMEOUT_S) == [lease]
    clock.advance(100 * TIMEOUT_S)  # this process lives on: it may map generation 1 however long that is
    table.expire(TIMEOUT_S)
    with pytest.raises(MappedLimit):
        table.take(os.getpid(), 1, owner=HOLDER)
    assert table.release(lease.client, HOLDER) is False  # no live lease, but the record of the ended one goes
    assert table.retained == {} and table.take(os.getpid(), 1, owner=HOLDER).generation == 1


def test_restored_leases_start_as_if_they_had_just_beaten(clock):
    table = LeaseTable(timeout_s=TIMEOUT_S, clock=clock)
    clock.advance(500)  # whenever the successor starts
    table.restore([{"client": "a" * 32, "pid": os.getpid(), "generation": 1, "owner": HOLDER},
                   {"client": "b" * 32, "pid": os.getpid(), "generation": 9, "owner": HOLDER}], live={1})
    assert list(table.leases) == ["a" * 32]  # generation 9 is not served here
    clock.advance(TIMEOUT_S)
    assert table.expire(TIMEOUT_S) == []
    clock.advance(STEP)
    assert [lease.client for lease in table.expire(TIMEOUT_S)] == ["a" * 32]


def test_256_worker_processes_of_one_uid_hold_a_lease_each_and_one_greedy_process_shuts_out_only_itself(clock):
    """The defaults: a many-core host's 256 workers of one uid each take a lease (and a second, as a refresh
    does); a process that takes leases without end stops at its share, and the uid's other processes still get
    theirs."""
    table = LeaseTable(timeout_s=TIMEOUT_S, clock=clock)
    workers = [(10_000 + k, 777) for k in range(256)]  # (pid, start time): as SO_PEERCRED and /proc name them
    for process in workers:
        for _ in range(2):
            table.take(process[0], 1, owner=HOLDER, process=process)
    greedy = (99_999, 777)
    taken = 0
    with pytest.raises(LeaseLimit, match="max_leases_per_process"):
        while True:
            table.take(greedy[0], 1, owner=HOLDER, process=greedy)
            taken += 1
    assert taken == table.max_leases_per_process == 16
    newcomer = (12_345, 778)
    assert table.take(newcomer[0], 1, owner=HOLDER, process=newcomer).owner == HOLDER
    released = next(lease for lease in table.leases.values() if lease.process == greedy)
    table.release(released.client, HOLDER)  # a released lease gives its process room again
    assert table.take(greedy[0], 1, owner=HOLDER, process=greedy).process == greedy
