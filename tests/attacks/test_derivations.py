"""Derived tensors a reader may ask for are named by what they are and bounded before any work: each test performs
one attack the review of issue 37 found (findings 2-6), with raw requests where the attacker sent raw requests.

A derivation's name is a BLAKE2b digest of its canonical request over the served bytes' checksums, recomputed by
the victim's client; a gather reads its sources where they lie, one index chunk at a time; derived bytes count in
pages and files against the reader's and the daemon's quotas, with the room a push needs kept apart; a large
derivation is made off the request loop; a request with a bad last item makes nothing.
"""

from __future__ import annotations

import glob
import os
import subprocess
import time
import zlib

import pytest
import torch

from expertd import derived, messages
from expertd.client import ExpertClient
from expertd.client.derived_tensors import derive
from expertd.connection import Connection
from expertd.errors import DerivedLimit, ProtocolError, DerivedRejected
from expertd.replies import DerivedReply

pytestmark = pytest.mark.timeout(600)

BIG = "model.layers.1.mlp.experts.gate_up_proj"  # the tiny model's largest tensor: [8, 400, 320] bf16, 2 MB


def high_water(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) << 10


def reset_high_water(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:  # 5: reset the peak RSS to the current RSS
        f.write("5")


def one_block(name: str, index: torch.Tensor, also=()) -> messages.GatherItem:
    return derived.request(name, derived.encode(index), index.numel(), (index.numel(),), also=list(also), whole=True)


def ask_raw(conn: Connection, lease: str, items: list[messages.GatherItem]) -> DerivedReply:
    """A raw gather, asked again while the daemon says `building`."""
    while True:
        reply = conn.send(messages.Gather(client=lease, tensors=items), DerivedReply)
        if not reply.building:
            return reply
        time.sleep(0.01)


def test_a_reader_asking_first_cannot_make_a_victim_map_other_bytes(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint)
    with ExpertClient(daemon.endpoint) as attacker, ExpertClient(daemon.endpoint) as victim:
        source = victim.served_tensors()[BIG].reshape(-1)
        genuine = torch.randperm(source.numel(), generator=torch.Generator().manual_seed(1))[:50_000]
        forged = genuine.clone()
        forged[:1913] = forged[:1913].flip(0)  # another in-range index: what an xxh3 collision handed the victim
        conn = Connection(daemon.endpoint, timeout=30)
        try:
            (theirs,) = ask_raw(conn, attacker.lease, [one_block(BIG, forged)]).tensors
            # a daemon (or a man in the middle) answering the victim's request with the attacker's entry: refused

            class Replaying:
                def send(self, request, reply_type):
                    return DerivedReply(generation=victim.generation, tensors=[theirs])

            with pytest.raises(ProtocolError, match="not the"):
                derive(Replaying(), victim.lease, victim.index(), [one_block(BIG, genuine)])
        finally:
            conn.close()
        (out,) = victim.derived([one_block(BIG, genuine)])
        assert torch.equal(out, source[genuine]) and theirs["derivation"].startswith("blake2b:")
        assert mapping_path(out) != f"/dev/shm{theirs['segment']}"


def test_also_x64_and_a_100m_entry_index_stay_within_the_output_and_a_few_mib(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, max_derived_bytes=1 << 30)
    pid = daemon.proc.pid
    with ExpertClient(daemon.endpoint, timeout=120) as client:
        n = client.served_tensors()[BIG].numel()
        client.derived([one_block(BIG, torch.arange(8))])  # torch imported by the daemon before measuring
        # `also` x64 of the largest tensor (the old daemon concatenated 65 x 2 MB on its heap), a random index
        index = torch.randint(-1, 65 * n, (100_000,), generator=torch.Generator().manual_seed(2))
        reset_high_water(pid)
        before = high_water(pid)
        (out,) = client.derived([one_block(BIG, index, also=[BIG] * 64)])
        grew = high_water(pid) - before
        flat = client.served_tensors()[BIG].reshape(-1)
        want = torch.where(index >= 0, flat[index.clamp(min=0) % n], torch.zeros((), dtype=flat.dtype))
        assert torch.equal(out, want)
        # output + the source, once + a constant (a derivation job: its threads' heap and index chunks, as below)
        assert grew < out.numel() * 2 + n * 2 + (24 << 20), grew

        # 100M entries, 0..65n-1 cycling: 400 MB inflated from a deflated index under 512 KiB
        length, total = 100_000_000, 65 * n
        deltas = torch.ones(length, dtype=torch.int32)
        deltas[0] = 0
        deltas[total::total] = -(total - 1)
        deflated = zlib.compress(deltas.numpy().tobytes(), 9)
        del deltas
        assert len(deflated) <= messages.MAX_INDEX_BYTES
        item = derived.request(BIG, deflated, length, (length,), also=[BIG] * 64, whole=True)
        reset_high_water(pid)
        before = high_water(pid)
        (big,) = client.derived([item])
        grew = high_water(pid) - before
        print(f"\ndaemon peak growth: also x64 {grew / 2**20:.1f} MiB for a {length * 2 / 2**20:.0f} MiB output")
        # a derivation job: the output, the source once, and a constant of its threads' heap and index chunks (12-15 MiB
        # measured for 25M and for 100M entries alike), never anything proportional to the index or to `also`
        assert grew < length * 2 + n * 2 + (24 << 20), grew
        assert torch.equal(big[:n], flat) and torch.equal(big[total:total + 5], flat[:5])


def test_casts_of_everything_stop_at_the_quota_and_a_push_on_a_small_shm_dir_still_succeeds(
        tiny_checkpoint, start_daemon, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=1777", "expertd-test", str(shm)], check=True)
    try:
        daemon = start_daemon(tiny_checkpoint, shm_dir=str(shm), max_derived_bytes=1 << 30)
        with ExpertClient(daemon.endpoint) as attacker:
            names = [n for n, t in attacker.served_tensors().items() if t.dtype.is_floating_point]
            conn = Connection(daemon.endpoint, timeout=30)
            made = refused = 0
            try:
                for dtype in ("torch.float64", "torch.float32", "torch.float16"):
                    for name in names:
                        try:  # a large cast is a derivation job: asked again until made
                            request = messages.Cast(client=attacker.lease, tensors=[messages.CastItem(name, dtype)])
                            while conn.send(request, DerivedReply).building:
                                time.sleep(0.01)
                            made += 1
                        except DerivedLimit as exc:
                            assert "a reload or a push needs" in str(exc)
                            refused += 1
            finally:
                conn.close()
            assert made and refused, (made, refused)
            status = daemon.status()["derived"]
            st = os.statvfs(shm)
            assert st.f_bavail * st.f_frsize >= status["shm_reserve"]
            with ExpertClient(daemon.endpoint) as trainer:  # pushes still find room, again and again
                norm = "model.norm.weight"
                for k in range(3):
                    trainer.update({norm: torch.full_like(trainer.served_tensors()[norm], float(k))})
            print(f"\ncasts made {made}, refused {refused}; derived {status['bytes']} bytes in {status['files']} files")
        daemon.stop()
    finally:
        subprocess.run(["umount", str(shm)], check=True)


def test_5000_one_element_gathers_stop_at_the_files_quota(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, max_derived_bytes=1 << 30, max_derived_files=1000)
    with ExpertClient(daemon.endpoint) as attacker:
        items = [one_block(BIG, torch.tensor([k])) for k in range(5000)]
        conn = Connection(daemon.endpoint, timeout=60)
        made, refusal = 0, None
        try:
            for at in range(0, 5000, 250):
                try:
                    made += len(ask_raw(conn, attacker.lease, items[at:at + 250]).tensors)
                except DerivedLimit as exc:
                    refusal = str(exc)
                    break
            for item in items[made:made + 300]:  # one by one: exactly up to the quota
                try:
                    ask_raw(conn, attacker.lease, [item])
                    made += 1
                except DerivedLimit as exc:
                    refusal = str(exc)
                    break
            status = conn.request("status")
        finally:
            conn.close()
        # one reader's share: a quarter of max_derived_files
        assert made == 250 and "max_derived_files_per_reader=250" in refusal, (made, refusal)
        assert status["derived"]["files"] == 250 and status["derived"]["bytes"] == 250 * 4096
        assert len([p for p in glob.glob(f"/dev/shm/{daemon.namespace}.*") if ".v" in p]) == 250
        assert len(str(status)) < 512 << 10  # status lists at most 256 derived tensors a generation


def test_a_request_with_a_bad_last_item_makes_nothing(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, max_derived_bytes=1 << 30)
    with ExpertClient(daemon.endpoint) as client:
        n = client.served_tensors()[BIG].numel()
        big = [one_block(BIG, torch.arange(65 * n - k), also=[BIG] * 64) for k in range(3)]  # 3 x 133 MB
        bad = torch.arange(16)
        bad[-1] = n  # out of range, found only once the last index is inflated
        before = sorted(glob.glob(f"/dev/shm/{daemon.namespace}.*"))
        with pytest.raises(DerivedRejected, match="outside"):
            client.derived(big + [one_block(BIG, bad)])
        assert sorted(glob.glob(f"/dev/shm/{daemon.namespace}.*")) == before
        (out,) = client.derived([one_block(BIG, torch.arange(16))])
        assert ".v1.000." in mapping_path(out)  # the first derived segment ever made: none made and unlinked


def mapping_path(t: torch.Tensor) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return parts[5].strip()
    raise AssertionError("not mapped")


def test_status_is_answered_while_a_large_derivation_is_made(tiny_checkpoint, start_daemon):
    daemon = start_daemon(tiny_checkpoint, max_derived_bytes=1 << 30)
    with ExpertClient(daemon.endpoint) as client:
        n = client.served_tensors()[BIG].numel()
        item = one_block(BIG, torch.arange(65 * n), also=[BIG] * 64)  # 133 MB made from 65 sources
        conn, other = Connection(daemon.endpoint, timeout=30), Connection(daemon.endpoint, timeout=30)
        try:
            first = conn.send(messages.Gather(client=client.lease, tensors=[item]), DerivedReply)
            assert first.building
            waits, building = [], True
            while building:
                started = time.perf_counter()
                status = other.request("status")
                waits.append(time.perf_counter() - started)
                building = status["derived"]["job"] is not None
                if building:
                    assert status["derived"]["job"]["reader"] == "uid 0"
            assert len(waits) > 1  # answered (more than once) while the derivation was being made
            waits.sort()
            print(f"\nstatus during a 133 MB derivation: {len(waits)} answers, median "
                  f"{waits[len(waits) // 2] * 1e3:.2f} ms, worst {waits[-1] * 1e3:.1f} ms")
            reply = ask_raw(conn, client.lease, [item])
            assert reply.tensors[0]["nbytes"] == 65 * n * 2
        finally:
            conn.close()
            other.close()
